"""The trainer under pipeline parallelism: this rank's model parts, their stages and schedule, and one step.

The whole Llama is built on meta, split into `pp x stages_per_rank` parts by torchtitan's rule (or
`parallelism.module_fqns_per_model_part`), and this rank keeps its stages (looped placement: rank r owns
r, r + pp, ...). Each part is parallelized like a whole model (FSDP or DDP over its data-parallel group)
and initialized from the whole model's random stream, so the global weights are one process's. A step
runs the schedule once per accumulation micro-batch, each split into
`local_batch_size / pipeline_parallel_microbatch_size` pipeline microbatches; the loss exists on the last
stage and is summed over the pp group for the log; the gradient norm is taken over every stage.

FSDP and DDP inside a stage gather its parameters once and reduce its gradients once per step, in the
stage's last weight backward (B, or W under a split backward: torch's REDUCE_GRAD); validation runs the
schedule's forwards only; tensor parallelism inside stages sends each TP rank's sequence shard.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.common.decoder import Decoder
from models.common.pipeline_split import split_model, tied_across_stages
from parallelisms.dtensor import DeviceMesh, DTensor
from parallelisms.dtensor.collectives import wait_point_to_point
from parallelisms.dtensor.dtensor import local_tensor
from parallelisms.pipeline_parallel import ScheduleSpec, lower_schedule, stage_to_rank
from parallelisms.pipeline_parallel.interpreter import PipelineSchedule
from parallelisms.pipeline_parallel.stage import BoundaryMeta, PipelineStage
from parallelisms.tensor_parallel import loss_parallel
from parallelisms.tensor_parallel.partial_grads import reduce_partial_grads

from .config.pipeline_setup import PipelineSetup
from .step import MicroBatches, StepResult, total_grad_norm
from .token_loss import IGNORE_INDEX

# The last stage's copy of a tied embedding (1B flavor) is saved and stepped under the embedding's name.
_TIED_NAMES = {"output.weight": "tok_embeddings.weight"}


class PipelineParts(nn.Module):
    """This rank's model parts seen as one model: parameters and state under their global FQNs (the parts
    are not registered as submodules, which would prefix their names). A tied output weight on the last
    stage is named as the embedding it copies, so every checkpoint holds one tied weight, as one process's.
    Under the V placement both stages are on this rank: the output's copy is then not a parameter of this
    model (the optimizer, the norm and the checkpoint see the embedding only) and `sync_tied_copy` keeps it
    equal to the embedding after each step and each load."""

    parts: list[Decoder]
    whole: Decoder
    pipeline: Pipeline  # set once the stages are built

    def __init__(self, parts: list[Decoder], whole: Decoder) -> None:
        super().__init__()
        self.__dict__["parts"] = parts
        self.__dict__["whole"] = whole  # on meta: the model args and the FLOPs count of the whole model
        self.model_args = whole.model_args

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Iterator:
        seen: set[str] = set()
        for part in self.parts:
            for name, p in part.named_parameters(prefix, recurse, remove_duplicate):
                name = _TIED_NAMES.get(name, name) if tied_across_stages(part) else name
                if name not in seen:  # a second name: the V placement's local copy of the tied weight
                    seen.add(name)
                    yield name, p

    def state_dict(self, *, prefix: str = "", keep_vars: bool = False) -> dict:  # type: ignore[override]
        merged: dict = {}
        for part in self.parts:
            for name, value in part.state_dict(prefix=prefix, keep_vars=keep_vars).items():
                merged.setdefault(_TIED_NAMES.get(name, name) if tied_across_stages(part) else name, value)
        return merged

    def local_tied_pair(self) -> tuple[nn.Parameter, nn.Parameter] | None:
        """(embedding, its copy in the output) when the first and the last stage are both on this rank."""
        tied = [_tied_weight(part) for part in self.parts if tied_across_stages(part)]
        return (tied[0], tied[1]) if len(tied) == 2 else None

    @torch.no_grad()
    def sync_tied_copy(self) -> None:
        """Copy the embedding into the output's copy on this rank (after an optimizer step or a load)."""
        pair = self.local_tied_pair()
        if pair is not None:
            local_tensor(pair[1]).copy_(local_tensor(pair[0]))

    def forward(self, *args: object) -> None:
        raise RuntimeError("a pipelined model runs through its schedule (trainer/pipeline_training.py), not forward()")


@dataclass
class Pipeline:
    """This rank's side of the pipeline: parts (in stage order), their stages and the lowered schedule."""

    model: PipelineParts
    stages: list[PipelineStage]
    schedule: ScheduleSpec
    num_microbatches: int
    pp_mesh: DeviceMesh  # holds its group weakly, so a pipeline that outlives destroy_process_group() holds none
    tie_group_ref: weakref.ref[dist.ProcessGroup] | None = None  # the first and last stage's ranks sharing a weight

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.pp_mesh.get_group()

    @property
    def tie_group(self) -> dist.ProcessGroup | None:
        return None if self.tie_group_ref is None else self.tie_group_ref()

    def microbatch_kwargs(self, inputs: torch.Tensor, n: int) -> list[dict[str, Any]] | None:
        """Per pipeline microbatch, the keyword arguments every stage's forward needs besides its input: under
        block-causal attention the document ids, read from the tokens, which every rank of the pipeline holds
        (the later stages see hidden states). None otherwise."""
        part = self.model.parts[0]
        if getattr(part.model_args, "attn_mask_type", "causal") != "block_causal":
            return None
        return [{"documents": ids} for ids in part.document_ids(inputs, None).chunk(n)]

    def runner(
        self, loss_fn: object, num_microbatches: int | None = None, loss_context: object = None
    ) -> PipelineSchedule:
        pp, rank = self.pp_group.size(), self.pp_group.rank()
        spec = self.schedule
        per_rank, m = len(self.stages), num_microbatches or self.num_microbatches
        mapping = stage_to_rank(pp, per_rank, spec.placement)
        lowered = lower_schedule(spec.generate(pp, per_rank, m), mapping, m)
        actions = [a for a in lowered[rank] if a is not None]
        return PipelineSchedule(self.stages, actions, loss_fn, loss_context=loss_context)  # type: ignore[arg-type]


def build_stages(
    setup: PipelineSetup, parts: list[Decoder], stage_indices: list[int], pp_mesh: DeviceMesh,
    device: torch.device, boundary_dtype: torch.dtype,
) -> list[PipelineStage]:  # fmt: skip
    """The stages of this rank's parts; boundary activations are `setup.boundary_shape`, (mb, T/(cp tp), D), in
    `boundary_dtype` (the parameters' compute dtype)."""
    num_stages, mapping = setup.num_stages, setup.stage_to_rank()
    meta = BoundaryMeta(setup.boundary_shape, boundary_dtype)
    return [
        PipelineStage(part, s, num_stages, pp_mesh.get_group(), mapping, device,
                      input_meta=None if s == 0 else meta, output_meta=None if s == num_stages - 1 else meta)
        for part, s in zip(parts, stage_indices)
    ]  # fmt: skip


def split_for_rank(setup: PipelineSetup, whole: Decoder, pp_rank: int) -> tuple[list[Decoder], list[int]]:
    """This rank's parts (of the meta `whole`) and their stage indices."""
    mine = setup.stages_of(pp_rank)
    return [split_model(whole, list(setup.stage_fqns[s])) for s in mine], mine


def pipeline_train_step(
    pipeline: Pipeline,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    *,
    targets: torch.Tensor,
    grad_average_size: int,
    max_norm: float,
    use_loss_parallel: bool = False,
) -> StepResult:
    """One optimizer step: the schedule over each accumulation micro-batch's pipeline microbatches, the loss
    over the step's global target count (as trainer/step.py), then the gradient norm over every stage."""
    optimizer.zero_grad(set_to_none=True)
    scale = grad_average_size / targets

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        token_sum = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                                    ignore_index=IGNORE_INDEX)  # fmt: skip
        return token_sum * scale

    runner = pipeline.runner(loss_fn, loss_context=loss_parallel if use_loss_parallel else None)
    first, last = pipeline.stages[0].is_first, any(s.is_last for s in pipeline.stages)
    device = pipeline.stages[0].device
    total = torch.zeros((), device=device)
    n = pipeline.num_microbatches
    for i, (inputs, labels) in enumerate(micro_batches):  # (B, T) each, B = n pipeline microbatches
        chunks = list(inputs.chunk(n)) if first else None
        result = runner.step(chunks, list(labels.chunk(n)) if last else None, sync_grads=i == len(micro_batches) - 1,
                             module_kwargs=pipeline.microbatch_kwargs(inputs, n))  # fmt: skip
        for loss in result.losses:  # under loss parallelism a DTensor, Replicate over tp
            total = total + (loss.full_tensor() if isinstance(loss, DTensor) else loss)
    # the last stage's loss, on every stage (for the log)
    _all_reduce_within_timeout(total, pipeline.pp_group, "the pipeline's loss all-reduce")
    _sum_tied_gradients(pipeline)
    grad_norm = _clip_over_stages(pipeline, max_norm)
    optimizer.step()
    pipeline.model.sync_tied_copy()
    return StepResult(total, grad_norm, skipped=False)


def _all_reduce_within_timeout(tensor: torch.Tensor, group: dist.ProcessGroup | None, what: str) -> None:
    """A blocking all-reduce over the pipeline's ranks whose wait is bounded by the group's timeout and, past
    it, names itself (as the stages' sends and receives do): a hung stage is found wherever the others wait."""
    work = dist.all_reduce(tensor, group=group, async_op=True)
    wait_point_to_point([work], group or dist.group.WORLD, what)  # type: ignore[arg-type]


def _tied_weight(part: Decoder) -> nn.Parameter:
    module = part.tok_embeddings if part.tok_embeddings is not None else part.output
    return module.weight  # type: ignore[return-value]


def _sum_tied_gradients(pipeline: Pipeline) -> None:
    """A weight tied across the first and the last stage steps with the sum of both copies' gradients, so
    the copies stay equal and equal one process's: on two ranks (looped placement) one all-reduce of this
    rank's shard between them, each stepping its copy; on one rank (V placement) the output copy's gradient
    is added to the embedding's, which alone steps (`PipelineParts.sync_tied_copy` follows)."""
    pair = pipeline.model.local_tied_pair()
    if pair is not None:
        embedding, copy = pair
        assert embedding.grad is not None and copy.grad is not None, "a tied weight without a gradient"
        local_tensor(embedding.grad).add_(local_tensor(copy.grad))
        copy.grad = None
        return
    tied = [part for part in pipeline.model.parts if tied_across_stages(part)]
    if not tied:
        return
    assert pipeline.tie_group is not None and len(tied) == 1
    grad = _tied_weight(tied[0]).grad
    assert grad is not None, "a tied weight without a gradient after the step's backward"
    _all_reduce_within_timeout(local_tensor(grad), pipeline.tie_group, "the tied weight's gradient all-reduce")


def build_tie_group(world_mesh: DeviceMesh, tied: bool, placement: str) -> dist.ProcessGroup | None:
    """The 2-rank group of the first and the last pipeline stage of this rank's pp line (collective: every rank
    creates every line's group, in order). None when the model ties no weight (`tied`: the same on every rank)
    or when the placement puts both stages on one rank (V)."""
    if not tied or placement == "v":
        return None
    pp = world_mesh.size("pp")
    names = list(world_mesh.mesh_dim_names or ())
    lines = world_mesh.mesh.movedim(names.index("pp"), -1).reshape(-1, pp)  # (lines, pp) global ranks
    mine = None
    for line in lines.tolist():
        group = dist.new_group([line[0], line[-1]])
        if dist.get_rank() in (line[0], line[-1]):
            mine = group
    return mine


def _clip_over_stages(pipeline: Pipeline, max_norm: float) -> torch.Tensor:
    """The gradient 2-norm over every stage's parameters (norms squared add up over the pp group), clipped.
    The last stage's copy of a tied weight is left out of the norm: one process counts that gradient once."""
    twins = {id(_tied_weight(p)) for p in pipeline.model.parts if tied_across_stages(p) and p.output is not None}
    with_grads = [p for p in pipeline.model.parameters() if p.grad is not None]
    reduce_partial_grads(with_grads)  # once, coalesced (partial_grads.py)
    grads = [p.grad for p in with_grads if p.grad is not None and id(p) not in twins]
    squared = total_grad_norm(grads).pow(2)
    _all_reduce_within_timeout(squared, pipeline.pp_group, "the pipeline's gradient-norm all-reduce")
    norm = squared.sqrt()
    if max_norm > 0 and grads:
        torch.nn.utils.clip_grads_with_norm_([p for p in pipeline.model.parameters() if p.grad is not None],
                                             max_norm, norm, foreach=True)  # fmt: skip
    return norm


def pipeline_token_loss(
    pipeline: Pipeline, microbatch_size: int
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Validation's forward and loss under PP: the forward-only schedule over a batch's microbatches, the
    summed token loss of the last stage shared with every stage of the pp group."""

    def summed(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                               ignore_index=IGNORE_INDEX)  # fmt: skip

    def token_loss(inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        n = inputs.shape[0] // microbatch_size  # (B, T) -> n microbatches of (mb, T)
        runner = pipeline.runner(summed, num_microbatches=n)
        first, last = pipeline.stages[0].is_first, any(s.is_last for s in pipeline.stages)
        losses = runner.forward_only(
            list(inputs.chunk(n)) if first else None, list(labels.chunk(n)) if last else None,
            module_kwargs=pipeline.microbatch_kwargs(inputs, n),
        )  # fmt: skip
        total = sum(losses, torch.zeros((), device=inputs.device))
        dist.all_reduce(total, group=pipeline.pp_group)
        return total

    return token_loss
