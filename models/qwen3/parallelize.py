"""Qwen3's tensor-parallel plan; everything else about parallelizing it is any decoder's
(models/decoder_parallelize.py).

A block is Llama's plan plus the QK norms, which normalize each head over head_dim: under TP a rank holds whole
heads, so the norms run on the local heads as sequence-parallel norms over the heads dim (their weight replicated,
its gradient summed over the ranks, as torchtitan's `SequenceParallel(sequence_dim=2)`); an MoE block shards its
experts (models/decoder_parallelize.py: apply_moe_tp).
"""

from __future__ import annotations

from functools import partial

from torch import nn

from models.decoder_parallelize import (
    apply_block_plan,
    apply_moe_tp,
    attention_tp_plan,
    mlp_tp_plan,
    parallelize_decoder,
)
from parallelisms.dtensor import DeviceMesh
from parallelisms.tensor_parallel import (
    SequenceParallel,
)


def block_tp_plan(block: nn.Module, tp_mesh: DeviceMesh, *, async_tp: bool = False) -> None:
    """A Qwen3 block under TP/SP (see the module docstring); with `async_tp`, its gathers and reduce-scatters run
    as collective matmuls."""
    plan = {**attention_tp_plan(), "ffn_norm": SequenceParallel()}
    if block.get_submodule("attention").q_norm is not None:
        plan |= {
            "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        }
    moe = getattr(block, "moe_enabled", False)
    apply_block_plan(block, tp_mesh, plan if moe else plan | mlp_tp_plan(), async_tp=async_tp)
    if moe:
        apply_moe_tp(block, tp_mesh)


parallelize_qwen3 = partial(parallelize_decoder, block_tp_plan=block_tp_plan)
"""Apply TP -> CP -> AC -> compile -> FSDP / DDP to a Qwen3 (models/decoder_parallelize.py: parallelize_decoder)."""
