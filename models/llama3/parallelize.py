"""Llama 3's tensor-parallel plan; everything else about parallelizing it is any decoder's
(models/decoder_parallelize.py), whose names this module re-exports for the code that imports them from here."""

from __future__ import annotations

from functools import partial

from torch import nn

from models.decoder_parallelize import (
    apply_block_plan,
    apply_compile,
    apply_cp,
    apply_fsdp,
    attention_tp_plan,
    data_parallel_mesh,
    mlp_tp_plan,
    parallelize_decoder,
)
from models.decoder_parallelize import apply_tp as apply_decoder_tp
from parallelisms.dtensor import DeviceMesh
from parallelisms.tensor_parallel import SequenceParallel

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
    plan = {**attention_tp_plan(), "ffn_norm": SequenceParallel(), **mlp_tp_plan()}
    apply_block_plan(block, tp_mesh, plan, async_tp=async_tp)


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, enable_async_tp: bool = False) -> None:
    """Llama under Megatron-style TP/SP (models/decoder_parallelize.py: apply_tp, with `block_tp_plan`)."""
    apply_decoder_tp(model, tp_mesh, block_tp_plan, loss_parallel=loss_parallel, async_tp=enable_async_tp)


parallelize_llama = partial(parallelize_decoder, block_tp_plan=block_tp_plan)
"""Apply TP -> CP -> AC -> compile -> FSDP / DDP to a Llama (models/decoder_parallelize.py: parallelize_decoder)."""
