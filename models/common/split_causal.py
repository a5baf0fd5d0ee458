"""Causal attention on the CPU for 257..512 tokens, computed through blocks of the causal square.

torch 2.13's CPU flash kernel walks the keys in blocks of 512 and masks inside a block, so a causal square of
up to 512 tokens costs it as much as the full square (forward + backward of (4, 16, 512, 16) fp32: 46 ms causal,
45 ms full on 2 threads). Cut at T/2, the square is two causal squares of T/2 (one batched kernel call, the
halves stacked on the batch dim) and one full block: the second half's queries over the first half's keys.
That is 3/4 of the kernel's work; halving the diagonal blocks again (`split_levels`) approaches 1/2. The
results for a row merge by their log-sum-exp; the backward runs the kernel's own backward on each block given
the merged output and log-sum-exp, which is exact per block. These are ring attention's block kernels and
merge (parallelisms/context_parallel: kernels.py, merge.py) written again for the CPU case on purpose: model
code never imports parallelisms (docs/architecture.md §1), and the merge here works on views of the rows' blocks.
Beyond 512 tokens the kernel skips whole masked key blocks itself and the split stops paying (measured at
1,024 - 8,192), so `causal_attention` splits only in the range it measured.
"""

from __future__ import annotations

from typing import Any

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

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
        b, n = q.shape[0], 2**levels
        diagonal, diagonal_lse = _flash(_blocks(q, n, EVERY), _blocks(k, n, EVERY), _blocks(v, n, EVERY), 0.0, True)
        out = _unblock(diagonal, b).float()  # a fresh fp32 buffer, merged into in place
        lse = _unblock(diagonal_lse.unsqueeze(-1), b).squeeze(-1).contiguous()  # (B, H, T) fp32
        for level in range(1, levels + 1):
            m = 2**level
            below, below_lse = _flash(_blocks(q, m, ODD), _blocks(k, m, EVEN), _blocks(v, m, EVEN), 0.0, False)
            acc_lse = _lse_blocks(lse, m, ODD)
            merged = torch.logaddexp(acc_lse, below_lse)
            acc = _blocks(out, m, ODD)  # a view: the merge writes into `out`
            acc.mul_(torch.exp(acc_lse - merged).unsqueeze(-1))
            acc.add_(below * torch.exp(below_lse - merged).unsqueeze(-1))
            _set_lse_blocks(lse, m, ODD, merged)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.levels = levels
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        b, n = q.shape[0], 2**ctx.levels
        every = (_blocks(t, n, EVERY) for t in (grad, q, k, v, out))
        dq, dk, dv = (_unblock(g, b) for g in _flash_backward(*every, _lse_blocks(lse, n, EVERY), 0.0, True))
        for level in range(1, ctx.levels + 1):
            m = 2**level
            rows, cols = (_blocks(t, m, ODD) for t in (grad, q)), (_blocks(t, m, EVEN) for t in (k, v))
            gq, gk, gv = _flash_backward(*rows, *cols, _blocks(out, m, ODD), _lse_blocks(lse, m, ODD), 0.0, False)
            _blocks(dq, m, ODD).add_(gq)
            _blocks(dk, m, EVEN).add_(gk)
            _blocks(dv, m, EVEN).add_(gv)
        return dq, dk, dv, None
