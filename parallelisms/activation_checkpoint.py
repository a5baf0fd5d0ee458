"""Activation checkpointing of transformer blocks (torch.utils.checkpoint, non-reentrant).

Modes:
    "none"       keep every activation.
    "full"       keep only each block's input; recompute the whole block in backward.
    "selective"  with option "op": op-level selective checkpointing, torchtitan's policy: keep the outputs
                 of attention, `max` and every other matmul of a block (the 1st, 3rd, ...), recompute the
                 rest (the other matmuls, pointwise and norm ops) in backward; with an int N: full
                 checkpointing of every N-th block (torchtitan's layer SAC).
    "memory_budget"  nothing wrapped: torch.compile's min-cut partitioner chooses what the compiled blocks
                 save, keeping their activations within `memory_budget` (0: recompute all, 1: save all) of
                 what saving everything would take (torchtitan's; needs the blocks compiled).

Blocks are checkpointed by replacing their `forward` on the instance, not by wrapping them in a
new module, so parameter names (and so checkpoints and plans keyed by them) do not change.
Apply it after tensor parallelism and before fully_shard: fully_shard's hooks then sit outside the
checkpointed region, and the recomputation runs while the block's parameters are unsharded.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

ACMode = Literal["none", "full", "selective", "memory_budget"]
AC_MODES = ("none", "full", "selective", "memory_budget")

aten = torch.ops.aten
# ops whose outputs selective checkpointing keeps (their recomputation would cost the most), as torchtitan's
# default save list (torch's compute-intensive ops, attention, and `max`, the amax torchao's float8 scaling
# reads: models.float8 reads it with `linalg_vector_norm`, kept for the same reason, a scalar whose
# recomputation would read the whole tensor again); float8 linears multiply with `_scaled_mm`, which the
# policy counts as a matmul, as torchtitan's sees torchao's float8 matmul as `mm`; an MoE's experts multiply with
# `_grouped_mm` (one call per weight over all experts), counted as a matmul too
_MATMULS = frozenset((aten.mm.default, aten.linear.default, aten._scaled_mm.default, aten._grouped_mm.default))
_SAVE_OPS = _MATMULS | frozenset(
    getattr(aten, name).default
    for name in (
        "addmm",
        "bmm",
        "max",
        "linalg_vector_norm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(aten, name)
)


def apply_ac(
    model: nn.Module,
    mode: ACMode,
    *,
    selective_option: str = "op",
    early_stop: bool = True,
    force_recompute_mm_fqns: Sequence[str] = (),
    memory_budget: float = 0.5,
) -> nn.Module:
    """Checkpoint the blocks of `model.layers` (an nn.ModuleDict or nn.ModuleList) in place.

    `selective_option` (torchtitan's `selective_ac_option`) refines mode "selective": "op" checkpoints
    every block op by op; an int N checkpoints every N-th block fully (blocks N-1, 2N-1, ...) and leaves
    the others alone. `early_stop` ends each recomputation once the tensors backward needs exist again.
    `force_recompute_mm_fqns` (torchtitan's `per_op_sac_force_recompute_mm_shapes_by_fqns`, default an MoE's
    router gate): under "op", the matmuls by these linears' weights are always recomputed and do not take a
    turn in the every-other-matmul count (a router's small matmul would otherwise take the turn of a big one).
    `memory_budget`: mode "memory_budget"'s fraction (torchtitan's `activation_checkpoint.memory_budget`).
    """
    if mode not in AC_MODES:
        raise ValueError(
            f"activation checkpoint mode {mode!r} is not one of {AC_MODES}; fix activation_checkpoint.mode"
        )
    if mode == "memory_budget":
        # process-wide, as torchtitan sets it: the partitioner reads it when each compiled block traces
        torch._functorch.config.activation_memory_budget = memory_budget
        return model
    if mode == "none":
        return model
    every = 1 if mode == "full" or selective_option == "op" else int(selective_option)
    if every < 1:
        raise ValueError(
            f"activation_checkpoint.selective_ac_option={selective_option!r}: expected 'op' or an int >= 1"
        )
    blocks = model.layers.values() if isinstance(model.layers, nn.ModuleDict) else model.layers
    for i, block in enumerate(blocks):  # type: ignore[arg-type]
        if (i + 1) % every == 0:
            forced = _weight_shapes(block, force_recompute_mm_fqns)
            checkpoint_module(block, selective=mode == "selective" and selective_option == "op", early_stop=early_stop,
                              forced_recompute_shapes=forced)  # fmt: skip
    return model


def _weight_shapes(block: nn.Module, fqns: Sequence[str]) -> frozenset[tuple[int, ...]]:
    """The (in, out) shapes of the transposed weights of `block`'s linears whose names end with one of `fqns`: the
    right operand of their forward matmul."""
    return frozenset(
        (m.in_features, m.out_features)
        for name, m in block.named_modules()
        if isinstance(m, nn.Linear) and any(name == f or name.endswith("." + f) for f in fqns)
    )


def checkpoint_module(
    module: nn.Module,
    *,
    selective: bool = False,
    early_stop: bool = True,
    forced_recompute_shapes: frozenset[tuple[int, ...]] = frozenset(),
) -> nn.Module:
    """Make `module`'s forward recompute in backward instead of saving its activations (`selective`: op by op,
    the matmuls by right operands of `forced_recompute_shapes` always recomputed)."""
    if module.__dict__.get("_ac_checkpointed", False):
        raise ValueError(f"{type(module).__name__} is already activation-checkpointed; apply apply_ac once")
    forward = module.forward
    # full AC passes no context_fn: torch.compile (torch 2.13) traces a checkpoint only when its
    # context_fn is absent or a constant partial; an explicit noop_context_fn fails to trace
    contexts = partial(_every_other_matmul_contexts, forced_recompute_shapes)
    options: dict[str, Any] = {"context_fn": contexts} if selective else {}
    if not early_stop:  # torch's default is True: pass it only when it differs, as compile traces the default
        options["early_stop"] = False

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)

    module.forward = checkpointed_forward
    module.__dict__["_ac_checkpointed"] = True
    return module


def _every_other_matmul_contexts(forced: frozenset[tuple[int, ...]] = frozenset()) -> tuple[Any, Any]:
    """The contexts of one checkpointed call (forward and its recomputation): `_SAVE_OPS` are kept but every
    second matmul is recomputed, counted per call separately in the forward and in the recomputation, so
    both make the same choice for the same matmul. Halves the matmul activations (a block's largest) for
    the price of recomputing about a third of its matmul FLOPs; torchtitan's selective "op" policy. An `mm`
    whose right operand has a `forced` shape is recomputed and not counted."""
    counts = {False: 0, True: 0}  # matmuls seen, by ctx.is_recompute

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is aten.mm.default and forced and tuple(args[1].shape) in forced:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op in _MATMULS:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    saving, replaying = create_selective_checkpoint_contexts(policy)
    storage = getattr(saving, "storage", None)
    assert storage is not None and getattr(replaying, "storage", None) is storage, "torch's SAC storage moved"
    saving.storage = replaying.storage = defaultdict(_SavedOutputs)
    return saving, replaying


_KEEPING = 0  # > 0 inside saved_outputs_kept()


@contextmanager
def saved_outputs_kept() -> Iterator[None]:
    """A backward inside leaves each selectively checkpointed block's saved outputs for a later backward
    through the same graph: a split backward's I and each of W's per-branch passes. torch's replay hands each
    saved output out once and then refuses ("Trying to backward an extra time"), but every such pass
    recomputes the block again and needs them, as a plain graph kept by retain_graph=True keeps its saved
    tensors; they go with the graph. Outside, the replay releases them as torch's does, so a whole backward's
    peak is unchanged. A module global, not a context variable: on GPU the autograd engine replays on its
    device threads, which do not see the caller's context."""
    global _KEEPING
    _KEEPING += 1
    try:
        yield
    finally:
        _KEEPING -= 1


class _SavedOutputs(dict):
    """One op's saved outputs by call index; the replay's release of a slot is ignored while they are kept."""

    def __setitem__(self, key: Any, value: Any) -> None:
        if _KEEPING and key in self:
            return
        super().__setitem__(key, value)
