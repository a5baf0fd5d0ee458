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

from models.decoder_parallelize import apply_moe_tp, parallelize_decoder
from parallelisms.dtensor import DeviceMesh, Replicate, Shard
from parallelisms.tensor_parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from parallelisms.tensor_parallel.async_styles import async_tp_plan


def block_tp_plan(block: nn.Module, tp_mesh: DeviceMesh, *, async_tp: bool = False) -> None:
    """A Qwen3 block under TP/SP (see the module docstring); with `async_tp`, its gathers and reduce-scatters run
    as collective matmuls."""
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        # (x, freqs_cis): freqs_cis is a plain replicated tensor and passes through untouched
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if block.get_submodule("attention").q_norm is not None:
        plan |= {
            "attention.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attention.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
        }
    if getattr(block, "moe_enabled", False):
        parallelize_module(block, tp_mesh, async_tp_plan(block, plan) if async_tp else plan)
        apply_moe_tp(block, tp_mesh)
        return
    plan |= {
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    parallelize_module(block, tp_mesh, async_tp_plan(block, plan) if async_tp else plan)


parallelize_qwen3 = partial(parallelize_decoder, block_tp_plan=block_tp_plan)
"""Apply TP -> CP -> AC -> compile -> FSDP / DDP to a Qwen3 (models/decoder_parallelize.py: parallelize_decoder)."""
