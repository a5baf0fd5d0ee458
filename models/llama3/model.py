"""Llama 3 on one device: RMSNorm, RoPE, grouped-query attention, SwiGLU (imports only torch, split_causal.py and
rms_norm.py, which import only torch).

Parallelism is applied from outside (parallelize.py). To let tensor-parallel sharding of the
projections work unchanged, attention never uses the configured head counts to reshape: it infers
the local head count from the projection outputs (`view(B, T, -1, head_dim)`), so a rank holding
n_heads / tp query heads and n_kv_heads / tp key/value heads runs the same code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from .args import RoPEScalingArgs, TransformerModelArgs
from .rms_norm import RMSNorm
from .split_causal import split_causal_attention, splits_causal_square


def precompute_freqs_cis(
    head_dim: int, end: int, theta: float = 10000.0, scaling: RoPEScalingArgs | None = None
) -> torch.Tensor:
    """RoPE rotations e^{i m theta_j} for positions m < end (Su et al. 2021): (end, head_dim/2) complex64.
    With `scaling`, the frequencies are first rescaled as Llama 3.1 does (`scale_rope_freqs`)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    if scaling is not None:
        freqs = scale_rope_freqs(freqs, scaling)
    angles = torch.outer(torch.arange(end, device=freqs.device).float(), freqs)  # (end, Dh/2)
    return torch.polar(torch.ones_like(angles), angles)


def scale_rope_freqs(freqs: torch.Tensor, scaling: RoPEScalingArgs) -> torch.Tensor:
    """Llama 3.1's long-context RoPE (Meta's llama-models `apply_scaling`; HF rope type "llama3").

    With L = original_max_position_embeddings and wavelength w = 2 pi / f: frequencies with
    w < L / high_freq_factor (many turns within the original context) are kept, those with
    w > L / low_freq_factor are divided by scaling_factor, and in between f is interpolated as
    (1 - s) f / scaling_factor + s f with s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor).
    """
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / freqs
    high_freq_wavelen = context / scaling.high_freq_factor
    low_freq_wavelen = context / scaling.low_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, freqs / scaling.scaling_factor, freqs)
    smooth = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.scaling_factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate consecutive pairs of xq / xk channels, (B, T, H, Dh), by position (complex multiply)."""
    seqlen = xq.shape[1]
    freqs = freqs_cis[:seqlen].view(1, seqlen, 1, -1)  # (1, T, 1, Dh/2)
    xq_c = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))  # (B, T, H, Dh/2)
    xk_c = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))  # (B, T, Hkv, Dh/2)
    xq_out = torch.view_as_real(xq_c * freqs).flatten(3)  # (B, T, H, Dh)
    xk_out = torch.view_as_real(xk_c * freqs).flatten(3)  # (B, T, Hkv, Dh)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def leading_positions(seqlen: int) -> slice:
    """The RoPE rows of a whole sequence on one device: positions 0 .. seqlen-1."""
    return slice(0, seqlen)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA of (B, H, T, Dh) queries over (B, Hkv, T, Dh) keys and values (on the CPU at 257..512
    tokens through the halves of the causal square, which torch's CPU kernel computes whole: split_causal.py)."""
    if splits_causal_square(q, k):
        return split_causal_attention(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings.

    `positions` and `core_attention` are what context parallelism swaps (models/llama3/parallelize.py:
    apply_cp): the RoPE rows of this rank's tokens, and the attention over a sequence sharded across ranks.
    """

    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.positions: Callable[[int], slice | torch.Tensor] = leading_positions
        self.core_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = causal_attention

    def init_weights(self, init_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1: the local head count, n_heads / tp under tensor parallelism
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # (B, T, H, Dh)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)  # (B, T, Hkv, Dh)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)  # (B, T, Hkv, Dh)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis[self.positions(seqlen)])
        xq, xk, xv = (t.transpose(1, 2) for t in (xq, xk, xv))  # (B, H|Hkv, T, Dh)
        out = self.core_attention(xq, xk, xv)  # (B, H, T, Dh)
        out = out.transpose(1, 2).contiguous().view(bs, seqlen, -1)  # (B, T, H*Dh)
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer 2020): w2(silu(w1 x) * w3 x), `hidden_dim` wide (TransformerModelArgs.ffn_hidden_dim)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then h + feed_forward(norm(h))."""

    def __init__(self, layer_id: int, args: TransformerModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        # residual-branch outputs scaled down with depth (GPT-2 / torchtitan's depth_init)
        layers = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * layers) ** 0.5

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama 3 decoder: tokens (B, T) -> logits (B, T, vocab_size)."""

    freqs_cis: torch.Tensor

    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__()
        self.model_args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # a ModuleDict keyed "0".."n-1" keeps FQNs stable when blocks are removed (pipeline stages)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)  # tied by init_weights when args say so
        # derived from args, so not saved in checkpoints
        self.register_buffer("freqs_cis", self._precompute_freqs_cis(), persistent=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """Make the output projection use the embedding's weight (again, after a parallelization
        that distributed them one by one: both are (vocab, dim), split on vocab under TP)."""
        if self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def _precompute_freqs_cis(self) -> torch.Tensor:
        args = self.model_args
        return precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """(Re)initialize every parameter and buffer, e.g. after building the model on meta."""
        if self.model_args.tie_word_embeddings:  # to_empty gives plain tied parameters one copy per module
            self.tie_weights()
        with torch.device(buffer_device or self.freqs_cis.device):
            self.freqs_cis = self._precompute_freqs_cis()
        # A pipeline part (models/llama3/pipeline_split.py) lacks some modules; their meta stand-ins run their fills
        # (writing nothing), so every part draws the random stream exactly as the whole model does.
        args, absent = self.model_args, self.__dict__.get("pipeline_absent", {})
        embedding = self.tok_embeddings or absent["tok_embeddings"]
        if not args.tie_word_embeddings:  # tied: the output's init below (N(0, 1) logits would be huge)
            nn.init.normal_(cast(torch.Tensor, embedding.weight))
        for i in range(args.n_layers):
            layer = self.layers[str(i)] if str(i) in self.layers else absent[f"layers.{i}"]
            layer.init_weights()  # type: ignore[operator]
        if self.norm is not None:
            self.norm.reset_parameters()
        # tied: the output's init fills the embedding (a first pipeline stage holds only the embedding)
        output = self.output or (self.tok_embeddings if args.tie_word_embeddings else None) or absent["output"]
        std = args.dim**-0.5
        cutoff = 3.0
        nn.init.trunc_normal_(cast(torch.Tensor, output.weight), mean=0.0, std=std, a=-cutoff * std, b=cutoff * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V) of tokens (B, T); a pipeline part without the embedding takes the previous
        stage's hidden states (B, T, D) instead, and one without the output returns its own."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, D)  S(1) under SP
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h  # (B, T, V)   S(-1) under loss parallelism
