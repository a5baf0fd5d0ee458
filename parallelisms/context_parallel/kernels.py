"""The local block kernel: attention of some queries against one K/V block, returning the block's output
and its log-sum-exp (the row normalizer), and the matching backward given the *merged* output and
log-sum-exp. With those two, a block's backward is exact on its own: P = exp(q k^T * scale - lse) is the
block's slice of the global softmax, and D = rowsum(dout * out) its global correction term.

"flash": SDPA's flash kernels, which return the log-sum-exp (CPU: fp32/bf16/fp16, any head dim, grouped
K/V heads; CUDA: fp16/bf16, head dim <= 256 and a multiple of 8, K/V heads repeated to the query heads).
"math": the same computation in fp32 torch ops, exact, for everything else. "auto" picks flash where it
applies. A block under a document `mask` (block-causal attention) runs "math": the flash kernels take none.
A query the mask hides every key of gets out 0 and lse -inf, which the merge ignores.
"""

from __future__ import annotations

from typing import Literal

import torch

Kernel = Literal["auto", "flash", "math"]


def choose_kernel(kernel: Kernel, q: torch.Tensor) -> Literal["flash", "math"]:
    """The kernel "auto" means for these queries: flash where it takes their device, dtype and head dim."""
    if kernel != "auto":
        return kernel
    if q.device.type == "cpu":
        return "flash" if q.dtype in (torch.float32, torch.bfloat16, torch.float16) else "math"
    head_dim = q.shape[-1]
    half = q.dtype in (torch.float16, torch.bfloat16)
    ok = q.device.type == "cuda" and half and head_dim <= 256 and head_dim % 8 == 0
    return "flash" if ok else "math"


def block_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kernel: Literal["flash", "math"],
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Lq, Dh) in q's dtype, lse (B, H, Lq) fp32) of q (B, H, Lq, Dh) against k, v (B, Hkv, Lk, Dh);
    `mask` (B, 1, Lq, Lk) bool: the pairs that may attend (documents)."""
    if kernel == "math" or mask is not None:
        return _math_forward(q, k, v, causal=causal, scale=scale, mask=mask)
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    kernel: Literal["flash", "math"],
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block's (dq, dk, dv), shaped like q, k, v, given the merged `out` and `lse` of these queries."""
    if kernel == "math" or mask is not None:
        return _math_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, mask=mask)
    if q.device.type == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return grads[0], grads[1], grads[2]
    n_kv = k.shape[1]
    kr, vr = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    lq, lk = q.shape[2], k.shape[2]
    unused = torch.empty(0, device=q.device, dtype=torch.int64)  # the RNG state: no dropout
    # no cumulative sequence lengths: defined ones would select the variable-length (packed) kernel
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, kr, vr, out, lse, None, None, lq, lk, 0.0, causal, unused, unused, scale=scale
    )
    return dq, _sum_kv(dk.float(), n_kv), _sum_kv(dv.float(), n_kv)  # the query groups summed in fp32


def _repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Grouped-query K/V (B, Hkv, L, Dh) -> one K/V head per query head (B, H, L, Dh)."""
    groups = n_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_kv(grad: torch.Tensor, n_kv: int) -> torch.Tensor:
    """The gradient of `_repeat_kv`: (B, H, L, Dh) summed over each K/V head's query group."""
    b, h, length, dh = grad.shape
    return grad if h == n_kv else grad.view(b, n_kv, h // n_kv, length, dh).sum(2)


def _scores(
    q: torch.Tensor, k: torch.Tensor, *, causal: bool, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 q k^T * scale, (B, H, Lq, Lk); the causal square masks keys after each query with -inf, and `mask`
    (allowed pairs) every other pair."""
    s = torch.matmul(q.float(), _repeat_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
    if causal:
        lq, lk = s.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def _math_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    s = _scores(q, k, causal=causal, scale=scale, mask=mask)
    lse = torch.logsumexp(s, dim=-1)
    # a query that sees no key here: lse -inf, out 0 (not exp(-inf + inf) = nan)
    finite = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.matmul(torch.exp(s - finite.unsqueeze(-1)), _repeat_kv(v, q.shape[1]).float())
    return out.to(q.dtype), lse


def _math_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_kv = k.shape[1]
    # the global softmax's block (every query sees at least itself: the merged lse is finite)
    p = torch.exp(_scores(q, k, causal=causal, scale=scale, mask=mask) - lse.unsqueeze(-1))
    do = dout.float()
    dv = torch.matmul(p.transpose(-1, -2), do)
    dp = torch.matmul(do, _repeat_kv(v, q.shape[1]).float().transpose(-1, -2))
    ds = p * (dp - (do * out.float()).sum(-1, keepdim=True))
    dq = torch.matmul(ds, _repeat_kv(k, q.shape[1]).float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    return dq, _sum_kv(dk, n_kv), _sum_kv(dv, n_kv)
