"""Sharding rules, one module per op family; importing this package registers them all."""

from . import (  # noqa: F401  (importing registers the rules)
    attention,
    convolution,
    embedding,
    fft,
    foreach,
    indexing,
    linalg,
    matmul,
    nll_loss,
    norms,
    pointwise,
    pooling,
    random,
    reductions,
    tensor_ops,
    upsample,
    views,
)
from .registry import RULES, OpCall, Sharding, register, rule_file_for  # noqa: F401
