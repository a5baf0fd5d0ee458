"""Llama 3 model arguments and the named flavors (shapes as torchtitan's llama3 flavors)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from models.common.mask_types import check_mask_type


@dataclass(frozen=True, kw_only=True)
class RoPEScalingArgs:
    """Llama 3.1's RoPE frequency scaling (Hugging Face's rope type "llama3"): for long context,
    wavelengths beyond `original_max_position_embeddings / low_freq_factor` are stretched by
    `scaling_factor`, those below `original_max_position_embeddings / high_freq_factor` are kept,
    and the band between is interpolated smoothly. Defaults are Llama 3.1's."""

    scaling_factor: float = 8.0
    """How much the low frequencies are slowed down (context extension factor)."""
    low_freq_factor: float = 1.0
    """original_max_position_embeddings / low_freq_factor: the wavelength above which frequencies are scaled."""
    high_freq_factor: float = 4.0
    """original_max_position_embeddings / high_freq_factor: the wavelength below which they are kept."""
    original_max_position_embeddings: int = 8192
    """Context length the model was pre-trained with before the extension."""

    def __post_init__(self) -> None:
        if self.scaling_factor <= 0:
            raise ValueError(f"rope scaling_factor({self.scaling_factor}) must be > 0")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"rope scaling needs 0 < low_freq_factor({self.low_freq_factor}) < high_freq_factor"
                f"({self.high_freq_factor}): the band between them is interpolated"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(f"original_max_position_embeddings({self.original_max_position_embeddings}) must be > 0")


@dataclass(kw_only=True)
class TransformerModelArgs:
    """Shape and numerics of a Llama 3 transformer."""

    dim: int = 4096
    """Model (residual stream) width."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads; head_dim = dim // n_heads."""
    n_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head)."""
    vocab_size: int = 128256
    """Vocabulary size (the Llama 3 tokenizer's by default; the trainer sets it from its tokenizer)."""
    multiple_of: int = 256
    """The SwiGLU hidden width is rounded up to a multiple of this."""
    ffn_dim_multiplier: float | None = None
    """Scales the SwiGLU hidden width (8/3 * dim) before rounding."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: RoPEScalingArgs | None = None
    """Llama 3.1 RoPE frequency scaling; None (the default) is plain RoPE."""
    max_seq_len: int = 2048
    """Longest sequence the precomputed rotary table covers (the trainer sets it to training.seq_len)."""
    tie_word_embeddings: bool = False
    """The output projection is the token embedding's weight (Llama 3.2 1B/3B): one (vocab, dim)
    parameter, used twice. Hugging Face's name."""
    depth_init: bool = True
    """Scale each block's output-projection init std by its depth (True) or by n_layers (False)."""
    attn_mask_type: str = "causal"
    """"causal", or "block_causal": attention stays inside the documents packed into a row, each ending at its
    EOS token (models/common/documents.py), as Llama 3 was pre-trained. torchtitan's name."""
    use_flex_attn: bool = False
    """Block-causal attention through FlexAttention where torch runs it forward and backward (CUDA); elsewhere
    the per-document SDPA kernel. torchtitan's name."""
    eos_id: int | None = None
    """The end-of-document token of block-causal masking (the trainer sets it from its tokenizer)."""

    def __post_init__(self) -> None:
        check_mask_type(self.attn_mask_type)
        n_kv_heads = self.n_heads if self.n_kv_heads is None else self.n_kv_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim({self.dim}) must be divisible by n_heads({self.n_heads})")
        if self.n_heads % n_kv_heads:
            raise ValueError(f"n_heads({self.n_heads}) must be divisible by n_kv_heads({n_kv_heads})")

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> TransformerModelArgs:
        """The args of a Hugging Face Llama `config.json` (models/llama3/hf_adapter.py: args_from_hf_config):
        a published flavor's own fields when the shape is one, ValueError naming what our model lacks."""
        # imported here: hf_adapter imports this module (and torch, which the pre-flight's flavors must not)
        from .hf_adapter import args_from_hf_config

        return args_from_hf_config(config)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """The SwiGLU width: 2/3 of a 4 * dim GELU MLP's (the same parameter count), times ffn_dim_multiplier,
        rounded up to a multiple of multiple_of."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def parameter_count(self) -> int:
        """The model's parameters, counted from its shapes (no torch needed: the pre-flight's memory floor)."""
        return sum(math.prod(shape) for shape in parameter_shapes(self).values())


def parameter_shapes(args: TransformerModelArgs, *, output: bool | None = None) -> dict[str, tuple[int, ...]]:
    """Our FQN -> shape of every parameter of `Transformer(args)`, in Hugging Face's file order (blocks in
    number order); without `output` when the output projection is tied to the embedding (by default when
    `args.tie_word_embeddings`)."""
    output = not args.tie_word_embeddings if output is None else output
    n_kv = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
    q, kv, ffn = args.n_heads * args.head_dim, n_kv * args.head_dim, args.ffn_hidden_dim
    block = {
        "attention.wq.weight": (q, args.dim),
        "attention.wk.weight": (kv, args.dim),
        "attention.wv.weight": (kv, args.dim),
        "attention.wo.weight": (args.dim, q),
        "feed_forward.w1.weight": (ffn, args.dim),
        "feed_forward.w3.weight": (ffn, args.dim),
        "feed_forward.w2.weight": (args.dim, ffn),
        "attention_norm.weight": (args.dim,),
        "ffn_norm.weight": (args.dim,),
    }
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in block.items()})
    shapes["norm.weight"] = (args.dim,)
    if output:
        shapes["output.weight"] = (args.vocab_size, args.dim)
    return shapes


# Llama 3.1's RoPE scaling (x8 for 128K context): torchtitan's 8B/70B/405B use it too, and Llama 3.1
# weights (and `convert from-hf` of them) compute the published logits only with it
_LLAMA_3_1_ROPE = RoPEScalingArgs()

# fmt: off
llama3_configs: dict[str, TransformerModelArgs] = {
    "debugmodel": TransformerModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=500000),
    "debugmodel_flex_attn": TransformerModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=500000,
                                                 use_flex_attn=True, attn_mask_type="block_causal"),
    # Llama 3.2 1B: tied embeddings, RoPE scaled x32 (its config.json's factor)
    "1B": TransformerModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
                               rope_theta=500000, rope_scaling=RoPEScalingArgs(scaling_factor=32.0),
                               tie_word_embeddings=True),
    "8B": TransformerModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                               multiple_of=1024, rope_theta=500000, rope_scaling=_LLAMA_3_1_ROPE),
    "70B": TransformerModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                                multiple_of=4096, rope_theta=500000, rope_scaling=_LLAMA_3_1_ROPE),
    "405B": TransformerModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                                 multiple_of=4096, rope_theta=500000, rope_scaling=_LLAMA_3_1_ROPE),
}
# fmt: on
