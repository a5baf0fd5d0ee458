"""Tensor and sequence parallelism on meshtrain's DTensor; names and defaults mirror torch's tensor parallel API."""

from .input_reshard import input_reshard
from .loss_parallel_context import loss_parallel
from .plan import parallelize_module
from .style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "input_reshard",
    "loss_parallel",
    "parallelize_module",
]
