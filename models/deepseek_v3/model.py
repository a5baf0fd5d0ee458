"""DeepSeek-V3 on one device: multi-head latent attention (MLA) and the shared MoE layer composed into pre-norm
blocks on the common decoder frame (imports only torch and models.common).

Parallelism is applied from outside, by module name: the names here (`layers.N.attention.wkv_a`,
`layers.N.moe.experts.w1`, ...) are torchtitan v0.2's, so TP plans, checkpoints and the HF adapter use them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from models.common.attention import causal_attention, leading_positions
from models.common.decoder import Decoder, PreNormBlock, depth_init_std
from models.common.documents import block_causal_attention
from models.common.feed_forward import FeedForward
from models.common.moe import MoE
from models.common.rms_norm import RMSNorm
from models.common.rope import apply_rotary_emb, rope_frequencies, rotary_table, yarn_mscale, yarn_scale_freqs

from .args import DeepSeekV3ModelArgs


def latent_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`causal_attention` of (B, H, T, Dqk) queries and keys over (B, H, T, Dv) values, whose head size may differ
    (MLA: 192 and 128): the CPU split path of `causal_attention` (257..512 tokens) runs a flash kernel that needs
    one head size, so unequal ones go to SDPA whole."""
    if v.shape[-1] != q.shape[-1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return causal_attention(q, k, v)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


class Attention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434 §2.1).

    Keys and values come from one compressed latent: wkv_a projects x to kv_lora_rank latent channels plus
    qk_rope_head_dim rotary key channels (`k_pe`, one head shared by all heads); the latent is RMS-normed and wkv_b
    expands it into each head's non-rotary key and value. Queries are full rank (`wq`) or low rank (wq_a, q_norm,
    wq_b) when q_lora_rank > 0. Only the last qk_rope_head_dim channels of each query/key head are rotated.

    Like models/common/attention.py, the local head count is inferred from the projection outputs (`view(..., -1,
    head_dim)`), so tensor-parallel sharding of wq / wq_b, wkv_b (by column) and wo (by row) works unchanged, and
    context parallelism swaps `positions` (the RoPE rows of this rank's tokens) and `core_attention` (causal attention
    over (B, H, T, Dh) with the default 1 / sqrt(q.shape[-1]) scale). YaRN's softmax correction mscale^2 is folded
    into the queries before `core_attention`, so that any implementation of it computes DeepSeek's scores.
    """

    def __init__(self, args: DeepSeekV3ModelArgs) -> None:
        super().__init__()
        self.qk_nope_head_dim, self.qk_rope_head_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = args.qk_head_dim, args.v_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        heads = args.n_heads
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.q_norm: RMSNorm | None = None
        self.wq_b: nn.Linear | None = None
        if args.q_lora_rank == 0:
            self.wq = nn.Linear(args.dim, heads * self.qk_head_dim, bias=False)
        else:
            self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(args.q_lora_rank, eps=args.norm_eps)
            self.wq_b = nn.Linear(args.q_lora_rank, heads * self.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, args.kv_lora_rank + args.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(args.kv_lora_rank, eps=args.norm_eps)
        self.wkv_b = nn.Linear(args.kv_lora_rank, heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.wo = nn.Linear(heads * args.v_head_dim, args.dim, bias=False)
        # DeepSeek's softmax scale is qk_head_dim^-1/2 * mscale^2 under YaRN: the factor on top of the default
        self.softmax_scale_correction = yarn_mscale(args.rope_factor, args.mscale) ** 2 if args.yarn_enabled else 1.0
        self.positions: Callable[[int], slice | torch.Tensor] = leading_positions
        self.core_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = (
            latent_causal_attention
        )
        # block-causal attention over document ids (models/common/documents.py); context parallelism swaps it too
        self.document_attention: Callable[..., torch.Tensor] = partial(
            block_causal_attention, causal=latent_causal_attention, use_flex=args.use_flex_attn
        )
        # `k_pe` is one rotary key head shared by every query head. Under tensor parallelism a rank holds some of
        # the heads, so the gradient reaching `k_pe` is a partial sum over the ranks: the TP plan sets this hook to
        # complete it (models/deepseek_v3/parallelize.py); on one device it is the identity
        self.shared_key: Callable[[torch.Tensor], torch.Tensor] = _same

    def init_weights(self, init_std: float) -> None:
        """The input projections ~ N(0, 0.02), wo ~ N(0, init_std), cut at [-2, 2]; the latent norms to ones
        (torchtitan v0.2's)."""
        for linear in (self.wkv_a, self.wkv_b, self.wq_a, self.wq_b, self.wq):
            if linear is not None:
                nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)
        for norm in (self.kv_norm, self.q_norm):
            if norm is not None:
                norm.reset_parameters()

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, H * Dqk), through the low-rank path when there is one."""
        if self.wq is not None:
            return self.wq(x)
        assert self.wq_a is not None and self.q_norm is not None and self.wq_b is not None
        return self.wq_b(self.q_norm(self.wq_a(x)))

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, D) -> (B, T, D); `freqs_cis` is the whole rotary table, of which `positions` picks the rows;
        with `documents` (B, T) document ids, attention stays inside each document (block-causal)."""
        bs, seqlen, _ = x.shape
        nope, rope = self.qk_nope_head_dim, self.qk_rope_head_dim
        # -1: the local head count, n_heads / tp under tensor parallelism
        q = self._queries(x).view(bs, seqlen, -1, self.qk_head_dim)  # (B, T, H, Dqk)
        q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
        kv = self.wkv_a(x)  # (B, T, Dc + Dr): the latent and the shared rotary key
        latent, k_pe = torch.split(kv, [self.kv_lora_rank, rope], dim=-1)
        k_pe = self.shared_key(k_pe)
        q_pe, k_pe = apply_rotary_emb(q_pe, k_pe.unsqueeze(2), freqs_cis[self.positions(seqlen)])  # k_pe (B, T, 1, Dr)
        kv = self.wkv_b(self.kv_norm(latent)).view(bs, seqlen, -1, nope + self.v_head_dim)  # (B, T, H, Dn + Dv)
        k_nope, v = torch.split(kv, [nope, self.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)  # (B, T, H, Dqk)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)  # (B, T, H, Dqk)
        if self.softmax_scale_correction != 1.0:
            q = q * self.softmax_scale_correction
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, Dqk | Dv)
        out = self.core_attention(q, k, v) if documents is None else self.document_attention(q, k, v, documents)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)  # (B, T, H * Dv)
        return self.wo(out)


def transformer_block(layer_id: int, args: DeepSeekV3ModelArgs) -> PreNormBlock:
    """DeepSeek-V3's block: latent attention, then the dense SwiGLU `feed_forward` in the first n_dense_layers
    blocks and the mixture of experts `moe` after them."""
    moe = layer_id >= args.n_dense_layers
    ffn = MoE(args.moe_layer_args, args.dim, args.moe_inter_dim) if moe else FeedForward(args.dim, args.inter_dim)
    return PreNormBlock(Attention(args), ffn, args.dim, args.norm_eps, depth_init_std(layer_id, args.n_layers))


class DeepSeekV3Model(Decoder):
    """DeepSeek-V3 decoder: tokens (B, T) -> logits (B, T, vocab_size) (the frame: models/common/decoder.py)."""

    def __init__(self, args: DeepSeekV3ModelArgs) -> None:
        super().__init__(args, [transformer_block(i, args) for i in range(args.n_layers)])

    def rotary_table(self) -> torch.Tensor:
        """The rotations of the qk_rope_head_dim rotary channels, YaRN-scaled beyond the original context."""
        args: DeepSeekV3ModelArgs = self.model_args
        freqs = rope_frequencies(args.qk_rope_head_dim, args.rope_theta)
        if args.yarn_enabled:
            freqs = yarn_scale_freqs(
                freqs,
                dim=args.qk_rope_head_dim,
                theta=args.rope_theta,
                factor=args.rope_factor,
                original_seq_len=args.original_seq_len,
                beta_fast=args.beta_fast,
                beta_slow=args.beta_slow,
            )
        return rotary_table(freqs, args.max_seq_len)
