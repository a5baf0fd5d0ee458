"""Qwen3 on one device, dense and MoE: the shared layers of models/common (RMSNorm, RoPE, grouped-query attention
with QK-norm, SwiGLU, the MoE layer) composed into pre-norm blocks (imports only torch and models.common).

Parallelism is applied from outside, by module name: the names here (`tok_embeddings`, `layers.N.attention.wq`,
`layers.N.attention.q_norm`, `layers.N.feed_forward.w1`, `layers.N.moe.experts.w1`, `norm`, `output`, ...) are
torchtitan's, and the plans', the checkpoint's and the Hugging Face adapter's keys.

Rotary layout: our RoPE rotates consecutive channel pairs (models/common/rope.py); Qwen3's own code (HF's and
torchtitan's) rotates channel j with j + head_dim / 2. Both are the same model up to a fixed permutation of each
head's channels, which the HF adapter applies to the rows of wq / wk and to the QK-norm weights.
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.attention import GroupedQueryAttention
from models.common.decoder import Decoder
from models.common.feed_forward import FeedForward
from models.common.moe import MoE
from models.common.rms_norm import RMSNorm
from models.common.rope import precompute_freqs_cis

from .args import Qwen3ModelArgs


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)), then h + ffn(norm(h)), where the FFN is a dense SwiGLU
    (`feed_forward`) or, with `moe_enabled`, a mixture of experts (`moe`)."""

    def __init__(self, layer_id: int, args: Qwen3ModelArgs) -> None:
        super().__init__()
        self.attention = GroupedQueryAttention(
            args.dim, args.n_heads, args.n_kv_heads, args.head_dim, qk_norm=args.qk_norm, norm_eps=args.norm_eps
        )
        self.moe_enabled = args.moe_enabled
        self.feed_forward: FeedForward | None = None
        self.moe: MoE | None = None
        if args.moe_enabled:
            self.moe = MoE(args.moe_args, args.dim, args.moe_inter_dim)
        else:
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        # residual-branch outputs scaled down with depth (GPT-2 / torchtitan's depth_init)
        layers = layer_id + 1 if args.depth_init else args.n_layers
        self.weight_init_std = 0.02 / (2 * layers) ** 0.5

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """torchtitan's: norms to ones, then attention and the FFN (or the MoE and its buffers) at this depth's std."""
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        if self.moe is not None:
            self.moe.init_weights(self.weight_init_std, buffer_device)
        elif self.feed_forward is not None:
            self.feed_forward.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, D)."""
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        ffn = self.moe if self.moe is not None else self.feed_forward
        assert ffn is not None  # exactly one of them is built
        return h + ffn(self.ffn_norm(h))


class Qwen3Model(Decoder):
    """Qwen3 decoder: tokens (B, T) -> logits (B, T, vocab_size) (the frame: models/common/decoder.py)."""

    def __init__(self, args: Qwen3ModelArgs) -> None:
        super().__init__(args, [TransformerBlock(i, args) for i in range(args.n_layers)])

    def rotary_table(self) -> torch.Tensor:
        """Plain RoPE over whole heads at `rope_theta`: (max_seq_len, head_dim / 2) complex64."""
        args: Qwen3ModelArgs = self.model_args
        return precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta)
