"""A pipeline stage: one model part, where it sits in the pipeline, and the shapes that cross its boundaries.

Boundary shapes and dtypes are given up front (from the model args: a (microbatch, seq, dim) activation),
never found by a warm-up run that would perturb FSDP's state or the RNG. Activations and their gradients
move between the ranks of the pp group with point-to-point sends and receives (`p2p.py`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class BoundaryMeta:
    """The activation that enters (or leaves) a stage: shape and dtype of one microbatch's tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class PipelineStage:
    """Model part `module` as stage `stage_index` of `num_stages`.

    Args:
        module: the part; its forward takes the previous stage's output (the tokens on stage 0) and returns
            its output (the logits on the last stage).
        stage_to_rank: every stage's rank in `group` (the pp group), e.g. looped or V placement.
        input_meta: the activation this stage receives (None on stage 0, which reads the microbatch).
        output_meta: the activation it sends (None on the last stage, which computes the loss).
    """

    module: nn.Module
    stage_index: int
    num_stages: int
    group: InitVar[dist.ProcessGroup]
    stage_to_rank: Mapping[int, int]
    device: torch.device
    input_meta: BoundaryMeta | None
    output_meta: BoundaryMeta | None
    # held weakly, as DeviceMesh holds its groups: a stage that outlives destroy_process_group() (a job stopped by
    # a signal, its frames still alive) must not keep the group into interpreter exit, where gloo can abort
    _group: Callable[[], dist.ProcessGroup | None] = field(init=False, repr=False)

    def __post_init__(self, group: dist.ProcessGroup | None) -> None:
        self._group = weakref.ref(group) if group is not None else lambda: None
        if not 0 <= self.stage_index < self.num_stages:
            raise ValueError(f"stage_index {self.stage_index} is not in [0, {self.num_stages})")
        if (self.input_meta is None) != self.is_first or (self.output_meta is None) != self.is_last:
            raise ValueError(
                f"stage {self.stage_index} of {self.num_stages}: only the first stage has no input_meta and only the "
                f"last no output_meta"
            )

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The pp group the stage sends and receives in."""
        group = self._group()
        if group is None:
            raise RuntimeError(
                f"pipeline stage {self.stage_index}: its process group was destroyed (dist.destroy_process_group()); "
                f"build the stages again in a live group"
            )
        return group

    def peer(self, stage: int) -> int:
        """The global rank that holds `stage`."""
        return dist.get_global_rank(self.process_group, self.stage_to_rank[stage])

    def is_local(self, stage: int) -> bool:
        return self.stage_to_rank[stage] == self.process_group.rank()
