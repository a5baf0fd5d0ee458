"""How a decoder of any family (models/common/decoder.py) is parallelized: the order of the parallelisms and
everything in them that does not depend on the family. A family's parallelize.py supplies its tensor-parallel
plan (`TPPlan`) and calls `parallelize_decoder`.

Order (docs/architecture.md §4, torchtitan's): tensor/sequence parallel plan -> context parallel attention ->
activation checkpointing -> per-block torch.compile -> fully_shard per block, then the embeddings, then the final
norm and output, then the root; or, for pure data parallelism, `replicate` (DDP) of the whole model.

MoE blocks (a `moe` submodule: models/common/moe.py) get `apply_moe_tp` under TP: the router replicated, the
experts sharded on their hidden dim (parallelisms/tensor_parallel/moe_styles.py), as torchtitan does while expert
parallelism is off. Under expert parallelism `apply_ep` shards the routed experts over the ep mesh first
(parallelisms/expert_parallel/), the TP plan then leaves them alone, and FSDP shards them over the data-parallel
ranks outside ep (`dp_shard_mod_ep`) in a group of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol, cast

import torch
from torch import nn

from parallelisms.activation_checkpoint import ACMode, apply_ac
from parallelisms.context_parallel import RingAttention, RotateMethod, SequenceSharding
from parallelisms.context_parallel.exchange import whole_sequences
from parallelisms.data_parallel import replicate
from parallelisms.dtensor import DeviceMesh, DTensor, Partial, Replicate, Shard
from parallelisms.dtensor.traceable import compile_whole
from parallelisms.expert_parallel import ExpertParallel
from parallelisms.fsdp import MixedPrecisionPolicy, fully_shard
from parallelisms.parallel_dims import ParallelDims
from parallelisms.ring_pass import RingGroup
from parallelisms.tensor_parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from parallelisms.tensor_parallel.async_styles import async_tp_plan
from parallelisms.tensor_parallel.moe_styles import GroupedExpertsParallel, NoParallel


class TPPlan(Protocol):
    """A family's tensor-parallel plan for its blocks (the top of the model is common): with `async_tp`, its
    collectives run as collective matmuls (parallelisms/tensor_parallel/async_styles.py: async_tp_plan)."""

    def __call__(self, block: nn.Module, tp_mesh: DeviceMesh, *, async_tp: bool = False) -> None: ...


def parallelize_decoder(
    model: nn.Module,
    parallel_dims: ParallelDims,
    world_mesh: DeviceMesh,
    *,
    block_tp_plan: TPPlan,
    loss_parallel: bool,
    ac_mode: ACMode = "none",
    ac_selective_option: str = "op",
    ac_early_stop: bool = True,
    ac_memory_budget: float = 0.5,
    ac_force_recompute_mm_fqns: tuple[str, ...] = ("moe.router.gate",),
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    compile_backend: str | None = None,
    cp_rotate_method: RotateMethod = "allgather",
    async_tp: bool = False,
) -> nn.Module:
    """Apply TP -> CP -> AC -> compile -> FSDP / DDP to `model` in place, as `parallel_dims` asks; returns `model`.
    `block_tp_plan` shards one block under TP. `compile_backend` (e.g. "inductor") compiles each block, in every
    layout; None leaves the model eager. `ac_selective_option` / `ac_early_stop` / `ac_memory_budget`: see
    `apply_ac`. `cp_rotate_method`: how ring attention moves K/V under context parallelism. `async_tp`: TP's
    all-gathers and reduce-scatters as collective matmuls."""
    if parallel_dims.ep_enabled:
        apply_ep(model, parallel_dims, world_mesh)
    if parallel_dims.tp_enabled:
        apply_tp(model, world_mesh["tp"], block_tp_plan, loss_parallel=loss_parallel, async_tp=async_tp)
    if parallel_dims.cp_enabled:
        apply_cp(model, world_mesh["cp"], rotate_method=cp_rotate_method)
    apply_ac(model, ac_mode, selective_option=ac_selective_option, early_stop=ac_early_stop,
             force_recompute_mm_fqns=ac_force_recompute_mm_fqns, memory_budget=ac_memory_budget)  # fmt: skip
    if compile_backend is not None:
        apply_compile(model, compile_backend, experts_eager=parallel_dims.ep_enabled)
    dp_mesh = data_parallel_mesh(parallel_dims, world_mesh)
    if dp_mesh is not None:
        experts = experts_fsdp(parallel_dims, world_mesh)
        apply_fsdp(model, dp_mesh, mp_policy or MixedPrecisionPolicy(), reshard_after_forward, experts=experts)
    elif parallel_dims.dp_replicate_enabled:  # pure data parallelism is DDP: whole replicas, bucketed all-reduces
        replicate(model, world_mesh["dp_replicate"])
    return model


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, block_tp_plan: TPPlan, *, loss_parallel: bool, async_tp: bool = False
) -> None:
    """Megatron-style tensor parallelism with sequence parallelism (Korthikanti et al. 2022): the embedding, the
    final norm and the output here; each block by `block_tp_plan`. Activations between blocks are sharded on the
    sequence dim (S(1)); with `loss_parallel` the logits stay sharded on the vocabulary dim for `loss_parallel()`."""
    top_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    # a pipeline part lacks some of them; between its blocks and stages the hidden states are plain local
    # (B, T/tp, D) sequence shards either way
    parallelize_module(model, tp_mesh, {k: v for k, v in top_plan.items() if getattr(model, k) is not None})
    for block in model.layers.values():  # type: ignore[operator]
        block_tp_plan(block, tp_mesh, async_tp=async_tp)
    if model.model_args.tie_word_embeddings:  # type: ignore[union-attr]
        _retie(model)


def attention_tp_plan() -> dict[str, ParallelStyle]:
    """Grouped-query attention under TP/SP (Llama, Qwen3): its norm on sequence shards; the input all-gathered
    (S(1) -> R) for wq, wk, wv, column-wise; wo row-wise, reduce-scattered back to S(1). (x, freqs_cis):
    freqs_cis is a plain replicated tensor and passes through untouched."""
    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    }


def mlp_tp_plan() -> dict[str, ParallelStyle]:
    """The dense SwiGLU under TP/SP: the input all-gathered, w1 and w3 column-wise, w2 row-wise reduce-scattered."""
    return {
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }


def apply_block_plan(block: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, ParallelStyle], *, async_tp: bool) -> None:
    """`plan` on `block`; with `async_tp`, its gathers and reduce-scatters as collective matmuls (async_tp_plan)."""
    parallelize_module(block, tp_mesh, async_tp_plan(block, plan) if async_tp else plan)


def apply_moe_tp(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Tensor parallelism of a block's `moe` (expert parallelism off; torchtitan's plan): the layer all-gathers
    the sequence and reduce-scatters its partial-sum output; the router is replicated, its gradient completed
    (`NoParallel` with a partial output gradient); every expert and the shared experts are sharded on their hidden
    dim, column-wise then row-wise, as a dense SwiGLU."""
    moe = block.get_submodule("moe")
    # a score scaling the experts' outputs (partial sums) gets a partial gradient; one scaling their input (which
    # `GroupedExpertsParallel` completes) gets a whole one
    score_grad = None if moe.score_before_experts else (Partial(),)
    plan = {
        "moe": PrepareModuleInputOutput(
            input_layouts=(Shard(1),),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Partial(),),
            desired_output_layouts=(Shard(1),),
        ),
        "moe.router.gate": NoParallel(local_output_grad_placements=score_grad),
    }
    if not isinstance(moe.get_submodule("experts").get_parameter("w1"), DTensor):  # else EP sharded them (apply_ep)
        plan["moe.experts"] = GroupedExpertsParallel()
    if moe.shared_experts is not None:
        plan |= {
            "moe.shared_experts.w1": ColwiseParallel(),
            "moe.shared_experts.w2": RowwiseParallel(output_layouts=Partial()),
            "moe.shared_experts.w3": ColwiseParallel(),
        }
    parallelize_module(block, tp_mesh, plan)


def apply_ep(model: nn.Module, parallel_dims: ParallelDims, world_mesh: DeviceMesh) -> None:
    """Expert parallelism of every MoE block's routed experts (parallelisms/expert_parallel/): over the "ep" mesh;
    with etp = tp over ("ep", "tp") (each expert also sharded on its hidden dim); with etp = 1 under TP, ep spans
    the tp ranks, which split the routed tokens between them. Before TP: `apply_moe_tp` leaves these experts be."""
    tp_enabled = parallel_dims.tp_enabled
    mesh = world_mesh["ep", "tp"] if tp_enabled and parallel_dims.etp_enabled else world_mesh["ep"]
    token_split = world_mesh["tp"] if tp_enabled and not parallel_dims.etp_enabled else None
    for block in model.layers.values():  # type: ignore[operator]
        moe = getattr(block, "moe", None)
        if moe is not None:
            ExpertParallel(token_split_mesh=token_split).apply(moe.experts, mesh)


def experts_fsdp(parallel_dims: ParallelDims, world_mesh: DeviceMesh) -> tuple[DeviceMesh, int] | None:
    """Under expert parallelism, the mesh FSDP shards the routed experts over (the data-parallel ranks outside ep:
    `dp_shard_mod_ep`, with dp_replicate for HSDP) and what their gradients are divided by; None without EP."""
    if not parallel_dims.ep_enabled:
        return None
    names = ("dp_replicate", "dp_shard_mod_ep") if parallel_dims.dp_replicate_enabled else ("dp_shard_mod_ep",)
    return world_mesh[names], parallel_dims.expert_gradient_divide_factor


def data_parallel_mesh(parallel_dims: ParallelDims, world_mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh fully_shard gets: (dp_replicate, dp_shard_cp) for HSDP, dp_shard_cp for FSDP; None
    without sharded data parallelism (pure data parallelism replicates: DDP). TP parameters are then
    sharded again over it (FSDP x TP)."""
    if parallel_dims.fsdp_enabled and parallel_dims.dp_replicate_enabled:
        return world_mesh["dp_replicate", "dp_shard_cp"]  # fully_shard reads a 2-D mesh by position
    if parallel_dims.fsdp_enabled:
        return world_mesh["dp_shard_cp"]
    return None


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, *, rotate_method: RotateMethod) -> None:
    """Context parallelism (Liu et al. 2023; torchtitan's): each rank holds SequenceSharding's share of
    every sequence (the trainer shards the batch), so attention becomes ring attention over the cp ranks
    and RoPE takes the rows of this rank's global positions. Everything else is per token and unchanged."""
    sharding = SequenceSharding.of(cp_mesh)
    ring = RingAttention(cp_mesh, causal=True, load_balance=sharding.load_balance, rotate_method=rotate_method)
    positions = partial(sharding.positions, device=torch.device(cp_mesh.device_type))
    for block in model.layers.values():  # type: ignore[operator]
        block.attention.positions = positions
        block.attention.core_attention = ring
        block.attention.document_attention = ring  # (q, k, v, documents): the whole rows' document ids
    # block-causal: the document ids come from the whole rows, gathered from every cp rank's share of the tokens
    ring_group, ids_of = RingGroup.of(cp_mesh), cast(Callable[..., torch.Tensor], model.document_ids)
    model.document_ids = lambda tokens, eos_id: ids_of(whole_sequences(tokens, sharding, ring_group), eos_id)  # type: ignore[assignment]


def apply_compile(model: nn.Module, backend: str, *, experts_eager: bool = False) -> None:
    """torch.compile each block's forward (torchtitan's per-block compile; the blocks are identical,
    so one graph serves them all), with fullgraph=True so a graph break is an error, not a slow path.

    The instance's `forward` is replaced, not the module wrapped: `__call__` stays eager, so the
    fully_shard hooks applied after this (all-gather before forward, reshard after) run outside
    the compiled region, and parameter names do not change. Compiling happens at the first call
    (after `to_empty` and init), and again only for a new grad mode (validation's no_grad) or shape.

    `experts_eager` (expert parallelism): the experts move tokens with splits only the data knows and hold
    an FSDP group of their own, whose hooks a compiled block would have to trace. Each MoE block then compiles
    its other parts one by one (attention, norms, router, shared experts) and runs the experts eager, as
    torchtitan does.
    """
    for layer, block in model.layers.items():  # type: ignore[union-attr, operator]
        moe = getattr(block, "moe", None)
        if experts_eager and moe is not None:
            parts = [*block.named_children(), *((f"moe.{n}", c) for n, c in moe.named_children())]
            for name, child in parts:
                if child is not moe and child is not moe.experts:
                    child.forward = compile_whole(child.forward, backend, f"layers.{layer}.{name}")
        else:
            block.forward = compile_whole(block.forward, backend, f"layers.{layer}")


def _retie(model: nn.Module) -> None:
    """The plan distributed the shared weight twice (once per module); both copies are (vocab, dim)
    split on vocab, S(0), so one of them serves both modules again."""
    embedding, output = model.get_submodule("tok_embeddings").weight, model.get_submodule("output").weight
    assert embedding.placements == output.placements, (embedding.placements, output.placements)  # type: ignore[union-attr]
    model.tie_weights()  # type: ignore[operator]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool,
    *,
    experts: tuple[DeviceMesh, int] | None = None,
) -> None:
    """fully_shard each block, the embeddings, [norm, output] as one group, then the root (as
    torchtitan). Neither [norm, output] nor the last block reshard after forward: backward needs
    them at once. Tied embeddings put [embeddings, norm, output] in one group: a parameter lives in
    exactly one group, and this one is used first and last in forward (so it stays unsharded from
    the embedding lookup to the output's backward, which is when the whole group's grads are in).
    `experts` (expert parallelism: `experts_fsdp`): each MoE block's routed experts first get a group of their own
    on that mesh, their gradients divided by that factor."""
    blocks = list(model.layers.values())  # type: ignore[operator]
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        reshard = reshard_after_forward and not last
        moe = getattr(block, "moe", None)
        if experts is not None and moe is not None:
            experts_mesh, divide_factor = experts
            fully_shard(moe.experts, mesh=experts_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
            moe.experts.set_gradient_divide_factor(divide_factor)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard)
    # a pipeline part may lack the embedding or the head (models/common/pipeline_split.py)
    embeddings = cast(nn.Module | None, model.tok_embeddings)
    head = [cast(nn.Module, m) for m in (model.norm, model.output) if m is not None]
    if model.model_args.tie_word_embeddings and embeddings is not None:  # type: ignore[union-attr]
        fully_shard([embeddings, *head], mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    else:
        if embeddings is not None:
            fully_shard(embeddings, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
        if head:
            fully_shard(head, mesh=dp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp_policy)
