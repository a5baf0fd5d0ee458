"""DeepSeek-V3's tensor-parallel plan; everything else about parallelizing it is any decoder's
(models/decoder_parallelize.py).

Latent attention under TP: each rank holds n_heads / tp heads. The queries (wq, or wq_b after the replicated
low-rank wq_a and q_norm) and the latent's expansion wkv_b are column-parallel by head, wo row-parallel. What comes
before the per-head expansions is replicated: every rank computes the latent and the rotary key `k_pe` whole
(wkv_a, kv_norm, wq_a, q_norm as `NoParallel`). The attention runs on local tensors: a column-parallel linear
completes its input's gradient (an all-reduce), and `k_pe`, which every head reads, has its gradient completed by
the attention's `shared_key` hook (`partial_grad`). So every replicated weight and the block's input get whole
gradients. Dense blocks shard their SwiGLU as Llama's; MoE blocks as models/decoder_parallelize.py: apply_moe_tp.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from models.decoder_parallelize import apply_block_plan, apply_moe_tp, mlp_tp_plan, parallelize_decoder
from parallelisms.dtensor import DeviceMesh, Replicate, Shard
from parallelisms.tensor_parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)
from parallelisms.tensor_parallel.moe_styles import NoParallel, partial_grad


def block_tp_plan(block: nn.Module, tp_mesh: DeviceMesh, *, async_tp: bool = False) -> None:
    """A DeepSeek-V3 block under TP/SP (see the module docstring). With `async_tp`, wo and the dense MLP run their
    collectives as collective matmuls; the attention's input, which feeds replicated low-rank projections
    (NoParallel) besides the column-parallel ones, is gathered at once."""
    attention: Any = block.get_submodule("attention")  # its `shared_key` hook is a plain attribute
    plan: dict[str, ParallelStyle] = {
        "attention_norm": SequenceParallel(),
        # (x, freqs_cis): x all-gathered and handed on as a local tensor
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None), use_local_output=True
        ),
        "attention.wkv_a": NoParallel(),
        "attention.kv_norm": NoParallel(),
        "attention.wkv_b": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
    }
    if attention.wq is not None:
        plan["attention.wq"] = ColwiseParallel()
    else:
        plan |= {"attention.wq_a": NoParallel(), "attention.q_norm": NoParallel(), "attention.wq_b": ColwiseParallel()}
    apply_block_plan(block, tp_mesh, plan, async_tp=async_tp)
    attention.shared_key = partial(partial_grad, mesh=tp_mesh)
    if block.moe_enabled:
        apply_moe_tp(block, tp_mesh)
        return
    apply_block_plan(block, tp_mesh, mlp_tp_plan(), async_tp=async_tp)


parallelize_deepseek_v3 = partial(parallelize_decoder, block_tp_plan=block_tp_plan)
"""Apply TP -> CP -> AC -> compile -> FSDP / DDP to a DeepSeek-V3 (models/decoder_parallelize.py)."""
