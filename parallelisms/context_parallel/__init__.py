"""Context parallelism: the sequence sharded over a `cp` mesh dim, attention as ring attention.

`SequenceSharding` cuts every sequence (inputs, labels, RoPE positions) into this rank's share, head-tail
load-balanced for causal attention; `RingAttention` replaces `F.scaled_dot_product_attention` on those
shards. The decoders' wiring is `models/decoder_parallelize.py: apply_cp`.
"""

from .blocks import Block, Half, attention_block, block_pairs, ring_sources
from .kernels import Kernel, block_backward, block_forward
from .merge import merge_into
from .ring_attention import ROTATE_METHODS, RingAttention, RotateMethod
from .sequence import SequenceSharding, causal_pairs, inverse_permutation, permutation, rank_positions

__all__ = [
    "ROTATE_METHODS",
    "Block",
    "Half",
    "Kernel",
    "RingAttention",
    "RotateMethod",
    "SequenceSharding",
    "attention_block",
    "block_backward",
    "block_forward",
    "block_pairs",
    "causal_pairs",
    "inverse_permutation",
    "merge_into",
    "permutation",
    "rank_positions",
    "ring_sources",
]
