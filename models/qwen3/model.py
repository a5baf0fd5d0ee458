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

from models.common.attention import GroupedQueryAttention
from models.common.decoder import Decoder, PreNormBlock, depth_init_std
from models.common.feed_forward import FeedForward
from models.common.moe import MoE
from models.common.rope import precompute_freqs_cis

from .args import Qwen3ModelArgs


def transformer_block(layer_id: int, args: Qwen3ModelArgs) -> PreNormBlock:
    """Qwen3's block: grouped-query attention with QK-norm, then a dense SwiGLU or, with `moe_enabled`, an MoE."""
    attention = GroupedQueryAttention(
        args.dim, args.n_heads, args.n_kv_heads, args.head_dim, qk_norm=args.qk_norm, norm_eps=args.norm_eps,
        use_flex_attn=args.use_flex_attn,
    )  # fmt: skip
    ffn = (
        MoE(args.moe_args, args.dim, args.moe_inter_dim) if args.moe_enabled else FeedForward(args.dim, args.hidden_dim)
    )
    init_std = depth_init_std(layer_id, args.n_layers, args.depth_init)
    return PreNormBlock(attention, ffn, args.dim, args.norm_eps, init_std)


class Qwen3Model(Decoder):
    """Qwen3 decoder: tokens (B, T) -> logits (B, T, vocab_size) (the frame: models/common/decoder.py)."""

    def __init__(self, args: Qwen3ModelArgs) -> None:
        super().__init__(args, [transformer_block(i, args) for i in range(args.n_layers)])

    def rotary_table(self) -> torch.Tensor:
        """Plain RoPE over whole heads at `rope_theta`: (max_seq_len, head_dim / 2) complex64."""
        args: Qwen3ModelArgs = self.model_args
        return precompute_freqs_cis(args.head_dim, args.max_seq_len, args.rope_theta)
