"""Llama 3 on one device: the shared layers of models/common (RMSNorm, RoPE with Llama 3.1's scaling,
grouped-query attention, SwiGLU) composed into pre-norm blocks (imports only torch and models.common).

Parallelism is applied from outside (parallelize.py), by module name: the names here (`tok_embeddings`,
`layers.N.attention.wq`, `layers.N.feed_forward.w1`, `norm`, `output`, ...) are the TP plan's, the
checkpoint's and the Hugging Face adapter's keys.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from models.common import (
    FeedForward,
    GroupedQueryAttention,
    RMSNorm,
    apply_rotary_emb,
    causal_attention,
    leading_positions,
    precompute_freqs_cis,
    scale_rope_freqs,
)

from .args import TransformerModelArgs

# the shared layers Llama 3 used to define here, still importable from this module
__all__ = [
    "Attention",
    "FeedForward",
    "RMSNorm",
    "Transformer",
    "TransformerBlock",
    "apply_rotary_emb",
    "causal_attention",
    "leading_positions",
    "precompute_freqs_cis",
    "scale_rope_freqs",
]


class Attention(GroupedQueryAttention):
    """Llama 3's attention: grouped-query, head_dim = dim / n_heads, no QK-norm (models/common/attention.py).

    `positions` and `core_attention` are what context parallelism swaps (models/llama3/parallelize.py:
    apply_cp): the RoPE rows of this rank's tokens, and the attention over a sequence sharded across ranks.
    """

    def __init__(self, args: TransformerModelArgs) -> None:
        n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        super().__init__(args.dim, args.n_heads, n_kv_heads, args.head_dim)


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
