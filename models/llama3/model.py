"""Llama 3 on one device: the shared layers of models/common (RMSNorm, RoPE with Llama 3.1's scaling,
grouped-query attention, SwiGLU) composed into pre-norm blocks (imports only torch and models.common).

Parallelism is applied from outside (parallelize.py), by module name: the names here (`tok_embeddings`,
`layers.N.attention.wq`, `layers.N.feed_forward.w1`, `norm`, `output`, ...) are the TP plan's, the
checkpoint's and the Hugging Face adapter's keys.
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.attention import GroupedQueryAttention, causal_attention, leading_positions
from models.common.decoder import Decoder
from models.common.feed_forward import FeedForward
from models.common.rms_norm import RMSNorm
from models.common.rope import apply_rotary_emb, precompute_freqs_cis, scale_rope_freqs

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

    `positions` and `core_attention` are what context parallelism swaps (models/decoder_parallelize.py:
    apply_cp): the RoPE rows of this rank's tokens, and the attention over a sequence sharded across ranks.
    """

    def __init__(self, args: TransformerModelArgs) -> None:
        n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        super().__init__(args.dim, args.n_heads, n_kv_heads, args.head_dim, use_flex_attn=args.use_flex_attn)


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

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, documents=documents)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(Decoder):
    """Llama 3 decoder: tokens (B, T) -> logits (B, T, vocab_size) (the frame: models/common/decoder.py)."""

    def __init__(self, args: TransformerModelArgs) -> None:
        super().__init__(args, [TransformerBlock(i, args) for i in range(args.n_layers)])

    def rotary_table(self) -> torch.Tensor:
        args = self.model_args
        return precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta, args.rope_scaling)
