"""torch.distributed.pipelining's own schedules, built without a process group, as meshtrain Actions.

The multi-stage schedules compute ``pipeline_order`` (and its lowering ``pipeline_order_with_comms``) in their
constructors from a few stage attributes, so plain namespaces stand in for the stages. The single-stage ones
(GPipe, 1F1B) run a hand-written loop whose ``pipeline_order`` is only a picture; :func:`torch_runtime_order` runs
that loop on a stage that records what it is asked to compute. :func:`torch_runtime` builds a torch schedule over
real stages, to run it on a process group next to ours.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import schedules as torch_schedules

from parallelisms.pipeline_parallel import Action, ActionKind, Schedule

TORCH_CLASSES: dict[str, Any] = {
    "GPipe": torch_schedules.ScheduleGPipe,
    "1F1B": torch_schedules.Schedule1F1B,
    "Interleaved1F1B": torch_schedules.ScheduleInterleaved1F1B,
    "LoopedBFS": torch_schedules.ScheduleLoopedBFS,
    "InterleavedZeroBubble": torch_schedules.ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": torch_schedules.ScheduleZBVZeroBubble,
    "DualPipeV": torch_schedules.ScheduleDualPipeV,
}


def from_torch(actions: list[Any]) -> list[Action | None]:
    """torch's actions as ours; an ``OVERLAP_F_B`` (DualPipeV) becomes its forward and then its backward, the
    order torch's runtime runs them in without an overlap callback."""
    ours: list[Action | None] = []
    for a in actions:
        if a is not None and a.computation_type.value == "OVERLAP_F_B":
            ours += from_torch(list(a.sub_actions))
        else:
            kind = None if a is None else ActionKind(a.computation_type.value)
            ours.append(None if a is None else Action(a.stage_index, kind, a.microbatch_index))
    return ours


def _stub_stages(pp: int, stages_per_rank: int) -> list[types.SimpleNamespace]:
    # Only what the constructors read; the rank is irrelevant, every rank's order is generated.
    return [
        types.SimpleNamespace(
            num_stages=pp * stages_per_rank, group_size=pp, group_rank=0, stage_index=i * pp, submod=None
        )
        for i in range(stages_per_rank)
    ]


def build_torch_schedule(
    name: str, pp: int, stages_per_rank: int, num_microbatches: int, defer_pp_recv: bool = False
) -> Any:
    """A fresh torch schedule object (for tests that mutate it, such as ``_load_csv``)."""
    cls = TORCH_CLASSES[name]
    stages = _stub_stages(pp, stages_per_rank)
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        return cls(stages[0], num_microbatches)
    if defer_pp_recv:
        return cls(stages, num_microbatches, defer_pp_recv=True)
    return cls(stages, num_microbatches)


@functools.cache
def torch_schedule(name: str, pp: int, stages_per_rank: int, num_microbatches: int) -> Any:
    """The torch schedule, built once per arguments; do not mutate it."""
    return build_torch_schedule(name, pp, stages_per_rank, num_microbatches)


def torch_pipeline_order(name: str, pp: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    order = torch_schedule(name, pp, stages_per_rank, num_microbatches).pipeline_order
    return {rank: from_torch(actions) for rank, actions in order.items()}


def torch_lowered_order(name: str, pp: int, stages_per_rank: int, num_microbatches: int) -> Schedule:
    order = torch_schedule(name, pp, stages_per_rank, num_microbatches).pipeline_order_with_comms
    return {rank: from_torch(actions) for rank, actions in order.items()}


class _RecordingStage:
    """A stage that computes nothing and records the calls a single-stage schedule's loop makes."""

    def __init__(self, pp: int, rank: int) -> None:
        self.num_stages, self.stage_index, self.group_size, self.group_rank = pp, rank, pp, rank
        self.is_first, self.is_last = rank == 0, rank == pp - 1
        self.device, self.submod, self.calls = "cpu", None, []

    def forward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.calls.append(Action(self.stage_index, ActionKind.F, mb))

    def backward_one_chunk(self, mb: int, *args: Any, **kwargs: Any) -> None:
        self.calls.append(Action(self.stage_index, ActionKind.B, mb))

    def perform_reduce_grad(self, *args: Any) -> None:
        self.calls.append(Action(self.stage_index, ActionKind.REDUCE_GRAD))

    def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _get_init_p2p_neighbors_ops(self) -> list[Any]:
        return []

    def get_fwd_recv_ops(self, mb: int) -> list[Any]:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops


def torch_runtime_order(name: str, pp: int, num_microbatches: int) -> Schedule:
    """What torch's GPipe / 1F1B ``_step_microbatches`` computes on each rank, in order."""
    order: Schedule = {}
    for rank in range(pp):
        stage = _RecordingStage(pp, rank)
        TORCH_CLASSES[name](stage, num_microbatches)._step_microbatches()
        order[rank] = list(stage.calls)
    return order


def torch_runtime(
    name: str,
    parts: Mapping[int, nn.Module],
    num_stages: int,
    num_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
) -> Any:
    """torch.distributed.pipelining running schedule `name` for real over `parts` (this rank's stage modules, by
    stage index, in the placement the schedule expects) in `group` (the default group if None).

    ``scale_grads=False``: the gradients are the sum over microbatches of each microbatch's ``loss_fn``, as in
    our runtime; the stages infer their boundary shapes on the first ``step`` (a collective of the group)."""
    stages = [TorchStage(part, s, num_stages, torch.device(device), group=group) for s, part in sorted(parts.items())]
    cls = TORCH_CLASSES[name]
    if issubclass(cls, torch_schedules.PipelineScheduleSingle):
        (stage,) = stages
        return cls(stage, num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, num_microbatches, loss_fn=loss_fn, scale_grads=False)
