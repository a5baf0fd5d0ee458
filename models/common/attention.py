"""Causal grouped-query self-attention with rotary embeddings, optionally QK-normed (imports only torch).

Parallelism is applied from outside. To let tensor-parallel sharding of the projections work unchanged,
attention never uses the configured head counts to reshape: it infers the local head count from the
projection outputs (`view(B, T, -1, head_dim)`), so a rank holding n_heads / tp query heads and
n_kv_heads / tp key/value heads runs the same code. Context parallelism swaps two attributes instead of
subclassing: `positions` (the RoPE rows of this rank's tokens) and `core_attention` (the attention over a
sequence sharded across ranks); models/decoder_parallelize.py: apply_cp.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .documents import block_causal_attention
from .rms_norm import RMSNorm
from .rope import apply_rotary_emb
from .split_causal import split_causal_attention, splits_causal_square


def leading_positions(seqlen: int) -> slice:
    """The RoPE rows of a whole sequence on one device: positions 0 .. seqlen-1."""
    return slice(0, seqlen)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of (B, H, T, Dh) queries over (B, Hkv, T, Dh) keys and values (on the CPU at 257..512
    tokens through the halves of the causal square, which torch's CPU kernel computes whole: split_causal.py)."""
    if splits_causal_square(q, k):
        return split_causal_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class GroupedQueryAttention(nn.Module):
    """Causal grouped-query self-attention (Ainslie et al. 2023) with rotary embeddings.

    `n_heads` query heads share `n_kv_heads` key/value heads, n_heads / n_kv_heads each; `head_dim` is free
    of `dim` (Qwen3 uses 128 at every width). With `qk_norm` (Qwen3; Dehghani et al. 2023), queries and keys
    are RMS-normed per head, over head_dim with one weight shared by the heads, before RoPE: modules `q_norm`
    and `k_norm`, absent otherwise.

    `project(x)` applies the `input_projections` to x: one call, which async tensor parallelism replaces with
    one ring over all three (parallelisms/tensor_parallel/async_styles.py).
    """

    input_projections = ("wq", "wk", "wv")

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        use_flex_attn: bool = False,
    ) -> None:
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads({n_heads}) must be divisible by n_kv_heads({n_kv_heads})")
        self.head_dim = head_dim
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=norm_eps) if qk_norm else None
        self.positions: Callable[[int], slice | torch.Tensor] = leading_positions
        self.core_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = causal_attention
        # block-causal attention over document ids (models/common/documents.py); context parallelism swaps it too
        self.document_attention: Callable[..., torch.Tensor] = partial(
            block_causal_attention, causal=causal_attention, use_flex=use_flex_attn
        )

    def init_weights(self, init_std: float) -> None:
        """wq, wk, wv ~ N(0, 0.02) and wo ~ N(0, init_std), cut at [-2, 2]; the QK norms to ones."""
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.wq(x), self.wk(x), self.wv(x)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); `freqs_cis` is the whole rotary table, of which `positions` picks the rows;
        with `documents` (B, T) document ids, attention stays inside each document (block-causal)."""
        bs, seqlen, _ = x.shape
        # -1: the local head count, n_heads / tp under tensor parallelism
        xq, xk, xv = (t.view(bs, seqlen, -1, self.head_dim) for t in self.project(x))  # (B, T, H|Hkv, Dh)
        if self.q_norm is not None and self.k_norm is not None:
            xq, xk = self.q_norm(xq), self.k_norm(xk)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis[self.positions(seqlen)])
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))  # (B, H|Hkv, T, Dh)
        # (B, H, T, Dh)
        out = self.core_attention(xq, xk, xv) if documents is None else self.document_attention(xq, xk, xv, documents)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)  # (B, T, H*Dh)
        return self.wo(out)
