"""Causal attention on the CPU for 257..512 tokens, computed as the halves of the causal square.

torch 2.13's CPU flash kernel walks the keys in blocks of 512 and masks inside a block, so a causal square of
up to 512 tokens costs it as much as the full square (forward + backward of (4, 16, 512, 16) fp32: 46 ms causal,
45 ms full on 2 threads). Cut at T/2, the square is two causal squares of T/2 (one batched kernel call, the
halves stacked on the batch dim) and one full block: the second half's queries over the first half's keys.
That is 3/4 of the kernel's work (measured 0.70x of SDPA's time at 512 tokens, 1 and 2 threads). The two
results for the second half merge by their log-sum-exp; the backward runs the kernel's own backward on each
block given the merged output and log-sum-exp, which is exact per block (as ring attention's blocks).
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


def split_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of (B, H, T, Dh) queries over (B, Hkv, T, Dh) keys and values, as SDPA's
    `is_causal=True, enable_gqa=True`, through the halves of the causal square (module docstring)."""
    return _SplitCausal.apply(q, k, v)


def _halves(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, Dh) -> (2B, H, T/2, Dh): the two halves of the sequence stacked on the batch dim (a view when
    x is a transposed (B, T, H, Dh) tensor, as the model's q, k and v are)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(2 * b, t // 2, h, d).transpose(1, 2)


def _whole(halves: torch.Tensor) -> torch.Tensor:
    """The inverse of `_halves`: (2B, H, T/2, Dh) -> (B, H, T, Dh), memory (B, T, H, Dh)."""
    b2, h, s, d = halves.shape
    return halves.transpose(1, 2).reshape(b2 // 2, 2 * s, h, d).transpose(1, 2)


def _second(x: torch.Tensor) -> torch.Tensor:
    return x[..., x.shape[-2] // 2 :, :]


def _first(x: torch.Tensor) -> torch.Tensor:
    return x[..., : x.shape[-2] // 2, :]


class _SplitCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, h, t, _ = q.shape
        diagonal, diagonal_lse = _flash(_halves(q), _halves(k), _halves(v), 0.0, True)  # (2B, H, T/2, Dh)
        below, below_lse = _flash(_second(q), _first(k), _first(v), 0.0, False)  # (B, H, T/2, Dh)
        out = _whole(diagonal).float()  # a fresh tensor (the kernel's output), merged into in place
        lse = diagonal_lse.reshape(b, 2, h, t // 2).transpose(1, 2).reshape(b, h, t)  # (B, H, T) fp32
        # the second half's rows: the mix of their diagonal block and the block below it (log-sum-exp weights)
        lse_2, out_2 = lse[..., t // 2 :], _second(out)
        merged = torch.logaddexp(lse_2, below_lse)
        out_2.mul_(torch.exp(lse_2 - merged).unsqueeze(-1)).add_(below * torch.exp(below_lse - merged).unsqueeze(-1))
        lse_2.copy_(merged)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, out, lse = ctx.saved_tensors
        b, h, t, _ = q.shape
        lse_halves = lse.view(b, h, 2, t // 2).transpose(1, 2).reshape(2 * b, h, t // 2)
        dq, dk, dv = _flash_backward(_halves(grad), _halves(q), _halves(k), _halves(v), _halves(out), lse_halves,
                                     0.0, True)  # fmt: skip
        dq, dk, dv = _whole(dq), _whole(dk), _whole(dv)
        lse_2 = lse[..., t // 2 :].contiguous()
        dq_2, dk_1, dv_1 = _flash_backward(_second(grad), _second(q), _first(k), _first(v), _second(out), lse_2,
                                           0.0, False)  # fmt: skip
        _second(dq).add_(dq_2)
        _first(dk).add_(dk_1)
        _first(dv).add_(dv_1)
        return dq, dk, dv
