"""Random ops (placeholder until the random-op issue): detection only."""

from __future__ import annotations

from typing import Any

import torch
from torch._ops import OpOverload


def is_random(op: OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags


def run_seeded(op: OpOverload, args: list, kwargs: dict, output_specs: tuple) -> Any:
    raise NotImplementedError(f"{op}: random ops on DTensor are not supported yet")
