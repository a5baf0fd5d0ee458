"""State-dict adapters the trainer checkpoints: the model and optimizer keyed by parameter FQN, and
every rank's RNG state.

`checkpoint.load` fills tensors in place, so each adapter's `state_dict()` hands out the live
tensors (a parameter's DTensor shares its shard; the optimizer's moments are its own tensors) and
`load_state_dict` only applies what is not a tensor.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

logger = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class ModelState:
    """The model's parameters and persistent buffers by FQN (DTensors stay DTensors). `after_load` runs once
    the tensors are filled (e.g. a pipeline rank copying a tied weight into its second stage)."""

    def __init__(self, model: nn.Module, after_load: Callable[[], None] | None = None) -> None:
        self.model, self.after_load = model, after_load

    def state_dict(self) -> dict[str, Any]:
        """A shared parameter (tied embeddings) once, under its first name, as named_parameters()."""
        seen: set[int] = set()
        out = {}
        for k, v in self.model.state_dict(keep_vars=True).items():
            if id(v) not in seen:
                seen.add(id(v))
                out[k] = v.detach()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # filled in place already: the detached tensors share the parameters' storage
        if self.after_load is not None:
            self.after_load()


class OptimizerState:
    """`optimizer.state_dict()` with parameter FQNs in place of indices, so the moments reshard
    with their parameters and survive a change of parallelism. The param groups keep their
    hyperparameters only: which parameters a group holds follows from the model (a pipeline stage
    holds some of them, another layout all), so it is not part of the state."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.names = {id(p): name for name, p in model.named_parameters()}

    def _fqns(self) -> list[str]:
        return [self.names[id(p)] for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        if not self.optimizer.state:
            self._init_state()
        raw = self.optimizer.state_dict()
        fqns = self._fqns()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in raw["param_groups"]]
        return {"state": {fqns[i]: s for i, s in raw["state"].items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.optimizer.param_groups):
            raise ValueError(
                f"the checkpoint's optimizer has {len(groups)} param groups, this one has "
                f"{len(self.optimizer.param_groups)}"
            )
        for target, loaded in zip(self.optimizer.param_groups, groups):
            target.update({k: v for k, v in loaded.items() if k != "params"})

    def _init_state(self) -> None:
        """Create the moments a step would, without changing any parameter (lr 0, zero gradients),
        so a fresh optimizer has tensors for a checkpoint to fill."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr
        for p in params:
            p.grad = None


class RngState:
    """Every rank's CPU (and CUDA) generator state, gathered so each rank resumes its own stream.
    Stored as JSON (base64); on another world size the states cannot be matched to ranks, so the
    current ones are kept, with a warning."""

    def state_dict(self) -> dict[str, Any]:
        mine = {"cpu": _b64(torch.get_rng_state())}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            mine["cuda"] = _b64(torch.cuda.get_rng_state())
        everyone: list[Any] = [mine]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
        return {"per_rank": everyone}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        per_rank = state_dict["per_rank"]
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        if not per_rank or len(per_rank) != world:  # an empty list: a fresh state dict, nothing saved
            if per_rank:
                logger.warning("RNG states were saved by %d ranks, this job has %d: keeping the seeded ones",
                               len(per_rank), world)  # fmt: skip
            return
        torch.set_rng_state(_unb64(per_rank[rank]["cpu"]))
        if "cuda" in per_rank[rank] and torch.cuda.is_available():
            torch.cuda.set_rng_state(_unb64(per_rank[rank]["cuda"]))


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)
