"""One training step: the loss over the step's global target count, accumulation over micro-batches,
clipping, the optimizer update, and the non-finite guard; plus what a step is measured by (its global
target count and loss, its tokens per device).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from parallelisms.data_parallel import ReplicateModule
from parallelisms.dtensor import DeviceMesh, DTensor, Partial
from parallelisms.fsdp import FSDPModule
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import loss_parallel
from parallelisms.tensor_parallel.partial_grads import reduce_partial_grads

from .token_loss import IGNORE_INDEX, CrossEntropy, summed_cross_entropy, token_loss_sum

logger = logging.getLogger(__name__)
MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor  # this rank's share of the global mean token loss (averaging over dp gives it)
    grad_norm: torch.Tensor  # the global gradient 2-norm before clipping (0-d, on the device)
    skipped: bool  # a non-finite step whose optimizer update was skipped


def fetch_micro_batches(
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]], n: int, device: torch.device
) -> MicroBatches:
    """The step's `n` (input, label) micro-batches, on `device`."""
    return [(x.to(device), y.to(device)) for x, y in (next(batches) for _ in range(n))]


def global_target_count(labels: list[torch.Tensor], dp_cp_mesh: DeviceMesh | None) -> torch.Tensor:
    """Targets (ignore_index excluded) in the whole step: every micro-batch on every dp rank.
    One all_reduce of a scalar over `dp_cp_mesh` (None: one rank), left on the device (no host sync)."""
    local = sum((lab != IGNORE_INDEX).sum() for lab in labels).to(torch.float32)  # type: ignore[union-attr]
    if dp_cp_mesh is not None:
        local = DTensor.from_local(local, dp_cp_mesh, [Partial("sum")]).full_tensor()
    return local


def reduce_loss(loss: torch.Tensor, dp_cp_mesh: DeviceMesh | None) -> float:
    """The loss averaged over the data-parallel ranks (each saw a different batch), as a float."""
    loss = loss.detach()
    if isinstance(loss, DTensor):  # under loss_parallel: a DTensor over tp
        loss = loss.full_tensor()
    if dp_cp_mesh is not None:
        loss = DTensor.from_local(loss, dp_cp_mesh, [Partial("avg")]).full_tensor()
    return loss.item()


def tokens_per_device(micro_batches: MicroBatches, parallel_dims: ParallelDims) -> int:
    """This step's tokens per device, torchtitan's definition behind tok/s and MFU: the ranks of one
    tp x cp x pp group all process the same local tokens, so each device is credited its share."""
    return sum(inputs.numel() for inputs, _ in micro_batches) // parallel_dims.non_data_parallel_size


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: MicroBatches,
    *,
    targets: torch.Tensor,
    grad_average_size: int,
    max_norm: float,
    use_loss_parallel: bool,
    skip_nonfinite: bool,
    autocast: torch.dtype | None = None,
    cross_entropy: CrossEntropy = summed_cross_entropy,
) -> StepResult:
    """One optimizer step over `micro_batches` (gradient accumulation; FSDP and DDP reduce only after
    the last). The loss is the sum of token losses over the whole step divided by its `targets`
    (the global count), not a mean of means; times `grad_average_size` because FSDP and DDP average
    gradients over that many ranks (dp_replicate x dp_shard x cp). With `skip_nonfinite` a non-finite
    gradient norm skips the update (deciding needs the norm on the host: one sync per step in that mode
    only); otherwise the loop's NonfiniteWatch stops the job at its next check.
    `autocast`: run forward and loss under torch.autocast in this dtype (mixed precision without FSDP)."""
    optimizer.zero_grad(set_to_none=True)
    total = accumulate_gradients(
        model, micro_batches, scale=grad_average_size / targets, use_loss_parallel=use_loss_parallel,
        autocast=autocast, cross_entropy=cross_entropy,
    )  # fmt: skip
    params = [p for p in model.parameters() if p.grad is not None]
    reduce_partial_grads(params)  # once, coalesced: left Partial, clipping and AdamW would each all-reduce them
    grad_norm = total_grad_norm([p.grad for p in params if p.grad is not None])
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, grad_norm, foreach=True)
    if skip_nonfinite and not math.isfinite(grad_norm.item()):
        optimizer.zero_grad(set_to_none=True)
        return StepResult(total, grad_norm, skipped=True)
    optimizer.step()
    return StepResult(total, grad_norm, skipped=False)


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all `grads` (0-d, plain). DTensor gradients may lie on several meshes (expert parallelism puts
    the routed experts on their own), which one norm cannot mix: one norm per mesh, each completed over its ranks,
    then combined. Every rank groups the same parameters alike, so the collectives match."""
    by_mesh: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def accumulate_gradients(
    model: nn.Module,
    micro_batches: MicroBatches,
    *,
    scale: torch.Tensor,
    use_loss_parallel: bool,
    autocast: torch.dtype | None,
    cross_entropy: CrossEntropy,
) -> torch.Tensor:
    """Forward and backward of every micro-batch, each token-loss sum times `scale`; the gradients sum in the
    parameters and FSDP / DDP reduce them only in the last backward. Returns the step's loss (the scaled sum)."""
    total: torch.Tensor | None = None
    accumulate = isinstance(model, (FSDPModule, ReplicateModule)) and len(micro_batches) > 1
    for i, (inputs, labels) in enumerate(micro_batches):
        if accumulate and i in (0, len(micro_batches) - 1):  # off for the first, on for the last
            model.set_requires_gradient_sync(i > 0)  # type: ignore[operator]
        token_sum = token_loss_sum(
            model, inputs, labels, autocast=autocast, vocab_parallel=use_loss_parallel, cross_entropy=cross_entropy
        )
        loss = token_sum * scale
        # the backward too runs inside loss_parallel, as torch requires (a fresh context per
        # micro-batch: a generator context cannot be entered twice)
        with loss_parallel() if use_loss_parallel else contextlib.nullcontext():
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    assert total is not None, "a step needs at least one micro-batch"
    return total


class NonfiniteWatch:
    """The non-finite guard. By default it remembers, on the device, the first step whose gradient norm
    was not finite, so stopping on NaN/inf costs no host sync per step: `check` reads it where the loop
    syncs anyway (the log step, before a checkpoint is saved, at the end) and stops the job naming that
    step. With `skip` (training.skip_nonfinite_steps) such steps were skipped instead; it counts them and
    stops once `max_consecutive_skips` in a row were (the run has diverged, skipping trains nothing)."""

    def __init__(self, device: torch.device, *, skip: bool = False, max_consecutive_skips: int = 10) -> None:
        self.first = torch.zeros((), dtype=torch.int64, device=device)  # 0: every step so far was finite
        self.skip, self.max_consecutive_skips = skip, max_consecutive_skips
        self.skipped, self.in_a_row = 0, 0

    def observe(self, step: int, result: StepResult) -> None:
        if not self.skip:
            self.note(step, result.grad_norm)
            return
        if not result.skipped:
            self.in_a_row = 0
            return
        self.skipped, self.in_a_row = self.skipped + 1, self.in_a_row + 1
        logger.warning("step %d: non-finite gradient norm, optimizer step skipped (%d so far)", step, self.skipped)
        if self.in_a_row >= self.max_consecutive_skips:
            raise FloatingPointError(
                f"step {step}: {self.in_a_row} steps in a row had a non-finite gradient norm and were skipped "
                f"(training.max_consecutive_skipped_steps={self.max_consecutive_skips}): training has diverged; "
                f"lower optimizer.lr or raise lr_scheduler.warmup_steps, and resume from an earlier checkpoint"
            )

    def note(self, step: int, grad_norm: torch.Tensor) -> None:
        bad = ~torch.isfinite(grad_norm) & (self.first == 0)
        self.first = torch.where(bad, step, self.first)

    def check(self) -> None:
        first = int(self.first.item())
        if first:
            raise FloatingPointError(
                f"step {first}: the gradient norm is not finite (a non-finite loss or gradient); lower "
                f"optimizer.lr or raise lr_scheduler.warmup_steps, or set training.skip_nonfinite_steps=true "
                f"to skip such steps"
            )
