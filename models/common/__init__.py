"""Single-device layers shared by the model families (imports only torch; never `parallelisms`).

One file per idea: rms_norm.py (RMSNorm, fused CPU backward), rope.py (rotary tables, Llama 3.1 scaling,
`apply_rotary_emb`), attention.py (grouped-query attention, optional QK-norm), split_causal.py (the CPU
causal-attention kernel path it takes at 257..512 tokens), feed_forward.py (SwiGLU). A family's model.py
composes them (docs/architecture.md §8).
"""

from .attention import GroupedQueryAttention, causal_attention, leading_positions
from .feed_forward import FeedForward
from .rms_norm import RMSNorm
from .rope import (
    Llama3RoPEScaling,
    apply_rotary_emb,
    precompute_freqs_cis,
    rope_frequencies,
    rotary_table,
    scale_rope_freqs,
)

__all__ = [
    "FeedForward",
    "GroupedQueryAttention",
    "Llama3RoPEScaling",
    "RMSNorm",
    "apply_rotary_emb",
    "causal_attention",
    "leading_positions",
    "precompute_freqs_cis",
    "rope_frequencies",
    "rotary_table",
    "scale_rope_freqs",
]
