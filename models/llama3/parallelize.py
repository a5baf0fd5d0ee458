"""Llama 3's tensor-parallel plan; everything else about parallelizing it is any decoder's
(models/decoder_parallelize.py), whose names this module re-exports for the code that imports them from here."""

from __future__ import annotations

from functools import partial

from torch import nn

from models.decoder_parallelize import (
    apply_compile,
    apply_cp,
    apply_fsdp,
    data_parallel_mesh,
    parallelize_decoder,
)
from models.decoder_parallelize import apply_tp as apply_decoder_tp
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

__all__ = [
    "apply_compile",
    "apply_cp",
    "apply_fsdp",
    "apply_tp",
    "block_tp_plan",
    "data_parallel_mesh",
    "parallelize_llama",
]


def block_tp_plan(block: nn.Module, tp_mesh: DeviceMesh, *, async_tp: bool = False) -> None:
    """A Llama block under TP/SP: the norms on sequence shards; attention and the MLP all-gather them (S(1) -> R),
    run column-wise then row-wise linears, and reduce-scatter back to S(1); with `async_tp`, the gathers and
    reduce-scatters run as collective matmuls."""
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        # (x, freqs_cis): freqs_cis is a plain replicated tensor and passes through untouched
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward.w3": ColwiseParallel(),
    }
    parallelize_module(block, tp_mesh, async_tp_plan(block, plan) if async_tp else plan)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool = False) -> None:
    """Llama under Megatron-style TP/SP (models/decoder_parallelize.py: apply_tp, with `block_tp_plan`)."""
    apply_decoder_tp(model, tp_mesh, block_tp_plan, loss_parallel=loss_parallel, async_tp=enable_async_tp)


parallelize_llama = partial(parallelize_decoder, block_tp_plan=block_tp_plan)
"""Apply TP -> CP -> AC -> compile -> FSDP / DDP to a Llama (models/decoder_parallelize.py: parallelize_decoder)."""
