"""MixedPrecisionPolicy: the dtypes fully_shard computes, communicates and returns in."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Mirrors torch's fully_shard MixedPrecisionPolicy.

    Attributes:
        param_dtype: dtype of the unsharded parameters (the all-gather runs in it); None keeps
            the sharded parameters' dtype.
        reduce_dtype: dtype of the gradient reduce-scatter; None uses the gradients' dtype
            (which is `param_dtype` when that is set).
        output_dtype: floating outputs of the module's forward are cast to it; None leaves them.
        cast_forward_inputs: cast floating forward inputs to `param_dtype` (when it is set).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
