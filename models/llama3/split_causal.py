"""Causal attention on the CPU for 257..512 tokens, computed through blocks of the causal square.

torch 2.13's CPU flash kernel walks the keys in blocks of 512 and masks inside a block, so a causal square of
up to 512 tokens costs it as much as the full square (forward + backward of (4, 16, 512, 16) fp32: 46 ms causal,
45 ms full on 2 threads). Cut at T/2, the square is two causal squares of T/2 (one batched kernel call, the
halves stacked on the batch dim) and one full block: the second half's queries over the first half's keys.
That is 3/4 of the kernel's work; halving the diagonal blocks again (`split_levels`) approaches 1/2. The
results for a row merge by their log-sum-exp; the backward runs the kernel's own backward on each block given
the merged output and log-sum-exp, which is exact per block: ring attention's block kernels and merge
(parallelisms/context_parallel), run on blocks of one sequence.
Beyond 512 tokens the kernel skips whole masked key blocks itself and the split stops paying (measured at
1,024 - 8,192), so `causal_attention` splits only in the range it measured.
"""

from __future__ import annotations

from typing import Any

import torch

from parallelisms.context_parallel.kernels import block_backward, block_forward
from parallelisms.context_parallel.merge import merge_into

KERNEL_KEY_BLOCK = 512  # the CPU flash kernel's key block at >= 512 keys (ATen's FlashAttentionKernel.cpp)


def splits_causal_square(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `causal_attention` takes the split for these (B, H, T, Dh) queries and (B, Hkv, T, Dh) keys:
    plain CPU tensors (not DTensors, fake or traced ones) of a float type, a self-attention square of an even
    length in (KERNEL_KEY_BLOCK / 2, KERNEL_KEY_BLOCK], outside torch.compile (which traces SDPA whole)."""
    length = q.shape[-2]
    return (
        type(q) is torch.Tensor
        and type(k) is torch.Tensor
        and q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and k.shape[-2] == length
        and length % 2 == 0
        and KERNEL_KEY_BLOCK // 2 < length <= KERNEL_KEY_BLOCK
        and not torch.compiler.is_compiling()
    )


def split_levels(length: int, threads: int) -> int:
    """How many times to halve: the diagonal blocks are length / 2**levels. Measured forward + backward at
    (4, 16 | 8, 512, 16) fp32, as a share of SDPA's time: on 2 threads one halving 0.70-0.74x, two 0.74-0.76x,
    three 0.76-0.79x; on one thread one 0.73x, two 0.66-0.67x, three 0.64-0.68x. More, smaller kernel calls
    cost less work but spread worse over threads."""
    levels = 1 if threads > 1 else 2
    while levels > 1 and length % 2**levels:
        levels -= 1
    return levels


def split_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of (B, H, T, Dh) queries over (B, Hkv, T, Dh) keys and values, as SDPA's
    `is_causal=True, enable_gqa=True`, through blocks of the causal square (module docstring)."""
    return _SplitCausal.apply(q, k, v, split_levels(q.shape[-2], torch.get_num_threads()))


EVERY, ODD, EVEN = slice(None), slice(1, None, 2), slice(0, None, 2)


def _blocks(x: torch.Tensor, n: int, which: slice) -> torch.Tensor:
    """(B, H, T, Dh) cut into n blocks of T / n along T, `which` of them stacked on the batch dim:
    (B * len(which), H, T / n, Dh). A view when x's memory is (B, T, H, Dh), as the model's q, k, v and every
    buffer `_unblock` makes are (the batch and block dims then merge), so writing into it writes into x."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, n, t // n, h, d)[:, which].flatten(0, 1).transpose(1, 2)


def _unblock(blocks: torch.Tensor, b: int) -> torch.Tensor:
    """Every block back in sequence order: (B * n, H, S, Dh) -> (B, H, n * S, Dh) with (B, T, H, Dh) memory."""
    bn, h, s, d = blocks.shape
    return blocks.transpose(1, 2).reshape(b, bn // b * s, h, d).contiguous().transpose(1, 2)


def _lse_blocks(lse: torch.Tensor, n: int, which: slice) -> torch.Tensor:
    """The log-sum-exp rows of `_blocks(x, n, which)`: (B, H, T) -> (B * len(which), H, T / n), a copy."""
    b, h, t = lse.shape
    return lse.view(b, h, n, t // n)[:, :, which].transpose(1, 2).reshape(-1, h, t // n)


def _set_lse_blocks(lse: torch.Tensor, n: int, which: slice, blocks: torch.Tensor) -> None:
    b, h, t = lse.shape
    lse.view(b, h, n, t // n)[:, :, which].copy_(blocks.view(b, -1, h, t // n).transpose(1, 2))


class _SplitCausal(torch.autograd.Function):
    """Level 0: the causal diagonal blocks (one call); level l = 1..levels: the full block of each odd
    block's queries (of size T / 2**l) over the even block before it (one call), merged into those rows."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, levels: int) -> torch.Tensor:
        b, n, scale = q.shape[0], 2**levels, q.shape[-1] ** -0.5
        q_n, k_n, v_n = (_blocks(t, n, EVERY) for t in (q, k, v))
        diagonal, diagonal_lse = block_forward(q_n, k_n, v_n, causal=True, scale=scale, kernel="flash")
        out = _unblock(diagonal, b).float()  # a fresh fp32 buffer, merged into in place
        lse = _unblock(diagonal_lse.unsqueeze(-1), b).squeeze(-1).contiguous()  # (B, H, T) fp32
        for level in range(1, levels + 1):
            m = 2**level
            k_m, v_m = (_blocks(t, m, EVEN) for t in (k, v))
            below, below_lse = block_forward(_blocks(q, m, ODD), k_m, v_m, causal=False, scale=scale, kernel="flash")
            acc_lse = _lse_blocks(lse, m, ODD)
            merge_into(_blocks(out, m, ODD), acc_lse, below, below_lse)  # the rows' view of `out`, in place
            _set_lse_blocks(lse, m, ODD, acc_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.levels, ctx.scale = levels, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        b, n, scale = q.shape[0], 2**ctx.levels, ctx.scale
        g_n, q_n, k_n, v_n, o_n = (_blocks(t, n, EVERY) for t in (grad, q, k, v, out))
        grads = block_backward(g_n, q_n, k_n, v_n, o_n, _lse_blocks(lse, n, EVERY), causal=True, scale=scale,
                               kernel="flash")  # fmt: skip
        dq, dk, dv = (_unblock(g, b) for g in grads)
        for level in range(1, ctx.levels + 1):
            m = 2**level
            g_m, q_m, o_m = (_blocks(t, m, ODD) for t in (grad, q, out))  # the rows: odd blocks
            k_m, v_m = (_blocks(t, m, EVEN) for t in (k, v))  # their keys: the even block before each
            gq, gk, gv = block_backward(g_m, q_m, k_m, v_m, o_m, _lse_blocks(lse, m, ODD), causal=False, scale=scale,
                                        kernel="flash")  # fmt: skip
            _blocks(dq, m, ODD).add_(gq)
            _blocks(dk, m, EVEN).add_(gk)
            _blocks(dv, m, EVEN).add_(gv)
        return dq, dk, dv, None
