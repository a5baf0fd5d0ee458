"""CommDebugMode: count the collectives (and their bytes) issued while it is active.

It is a TorchDispatchMode, so it sees every c10d collective that reaches the dispatcher: ours (the
DTensor core and fsdp call `torch.distributed`), direct c10d calls, and torch's functional
collectives. Keys follow torch's CommDebugMode: `torch.ops.c10d_functional.all_reduce`,
`.all_gather_into_tensor`, `.reduce_scatter_tensor`, `.all_to_all_single`, `.broadcast`; ops with
no functional twin (scatter, gather, reduce, and point-to-point send / recv_) keep their c10d key.

Bytes are the payload this rank hands to the collective: the input buffer for all_reduce,
all_gather, reduce_scatter and all_to_all, the tensor for broadcast, and the chunks for scatter.
They do not depend on the algorithm the backend picks, so two implementations compare fairly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.distributed._functional_collectives  # registers the c10d_functional keys
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle
from torch.utils.module_tracker import ModuleTracker

_py = torch.ops.c10d_functional
_native = torch.ops._c10d_functional
_c10d = torch.ops.c10d

# op packet -> (key it is counted under, index of the argument whose bytes are the payload)
_COLLECTIVES: dict[Any, tuple[Any, int]] = {
    _native.all_reduce: (_py.all_reduce, 0),
    _native.all_reduce_coalesced: (_py.all_reduce_coalesced, 0),
    _native.all_gather_into_tensor: (_py.all_gather_into_tensor, 0),
    _native.all_gather_into_tensor_coalesced: (_py.all_gather_into_tensor_coalesced, 0),
    _native.reduce_scatter_tensor: (_py.reduce_scatter_tensor, 0),
    _native.reduce_scatter_tensor_coalesced: (_py.reduce_scatter_tensor_coalesced, 0),
    _native.all_to_all_single: (_py.all_to_all_single, 0),
    _native.broadcast: (_py.broadcast, 0),
    torch.ops._c10d_functional_autograd.all_to_all_single: (_py.all_to_all_single, 0),
    _c10d.allreduce_: (_py.all_reduce, 0),
    _c10d.allreduce_coalesced_: (_py.all_reduce_coalesced, 0),
    _c10d._allgather_base_: (_py.all_gather_into_tensor, 1),
    _c10d.allgather_: (_py.all_gather_into_tensor, 1),
    _c10d.allgather_into_tensor_coalesced_: (_py.all_gather_into_tensor_coalesced, 1),
    _c10d._reduce_scatter_base_: (_py.reduce_scatter_tensor, 1),
    _c10d.reduce_scatter_: (_py.reduce_scatter_tensor, 1),
    _c10d.reduce_scatter_tensor_coalesced_: (_py.reduce_scatter_tensor_coalesced, 1),
    _c10d.alltoall_base_: (_py.all_to_all_single, 1),
    _c10d.alltoall_: (_py.all_to_all_single, 1),
    _c10d.broadcast_: (_py.broadcast, 0),
    _c10d.scatter_: (_c10d.scatter_, 1),
    _c10d.gather_: (_c10d.gather_, 1),
    _c10d.reduce_: (_c10d.reduce_, 0),
    _c10d.send: (_c10d.send, 0),  # point-to-point (pipeline stages, ring attention): counted per send / recv
    _c10d.recv_: (_c10d.recv_, 0),
}


_COUNTED_AS: ContextVar[Any] = ContextVar("comm_debug_counted_as", default=None)


@contextmanager
def counted_as(key: Any) -> Iterator[None]:
    """Count the collectives issued inside as `key`: a backend's own way of running a collective (gloo's
    reduce_scatter as an all_to_all and a local sum, collectives.py) counts as the collective asked for."""
    token = _COUNTED_AS.set(key)
    try:
        yield
    finally:
        _COUNTED_AS.reset(token)


def counted_collective(func: Any, args: tuple) -> tuple[Any, int] | None:
    """(the key a collective op counts under, its payload bytes), or None for an op that is no collective."""
    entry = _COLLECTIVES.get(func._overloadpacket)
    if entry is None:
        return None
    key, payload = entry
    return _COUNTED_AS.get() or key, _nbytes(args[payload]) if payload < len(args) else 0


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        local = getattr(value, "_local_tensor", value)
        return local.numel() * local.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__  # what tensors without a subclass dispatch have


def _defers_to_subclass(t: type) -> bool:
    """A wrapper subclass (our DTensor, torch's) whose ops decompose into collectives on inner
    tensors. FakeTensor is not one: it defers to active modes itself (torch's DTensor runs its
    sharding propagation on fake tensors), so deferring to it would leave the op unhandled."""
    return getattr(t, "__torch_dispatch__", _PLAIN_DISPATCH) is not _PLAIN_DISPATCH and not issubclass(t, FakeTensor)


class _ModuleTracker(ModuleTracker):
    """torch.utils' ModuleTracker, leaving a module only after the module's own forward hooks ran.

    Its global forward hook runs before a module's own hooks, so a collective issued by a TP
    style's output hook (RowwiseParallel's reduction) would count for the parent. A per-module
    hook, registered on first entry and so after the styles' hooks, leaves it instead.

    As torch's CommDebugMode tracker, each forward (not a recomputation in backward) also records, by module
    name: its type and depth (`module_helper_dict`, with "Global" at depth 0), its own parameters
    (`module_parameters_dict`: name -> tensor) and a DTensor parameter's placements (`sharding_dict`, keyed
    "<module>.<parameter>").
    """

    def __init__(self) -> None:
        super().__init__()
        self._post_hooks: dict[int, RemovableHandle] = {}
        self.module_helper_dict: dict[str, dict[str, Any]] = {}
        self.module_parameters_dict: dict[str, dict[str, torch.Tensor]] = {}
        self.sharding_dict: dict[str, tuple] = {}

    def _record(self, name: str, mod: nn.Module) -> None:
        helper = self.module_helper_dict.setdefault(name, {})
        helper["module_type"] = str(type(mod)).replace("<", "").replace(">", "")
        helper["depth"] = len(self.parents) - 1
        for param_name, param in mod.named_parameters(recurse=False):
            self.module_parameters_dict.setdefault(name, {})[param_name] = param.data
            placements = getattr(param.data, "placements", None)
            if placements is not None:  # a DTensor (ours or torch's)
                self.sharding_dict[f"{name}.{param_name}"] = placements
                helper.setdefault("parameters", {})[param_name] = str(placements)

    def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
        """torch's, except that a module whose inputs include a leaf leaves on the first input gradient
        (mode "any"): torch's "all" mode asks the engine about each input's node, which fails for a leaf
        under `autograd.grad` (a pipeline stage's input in a split backward)."""
        name = self._get_mod_name(mod)
        self._get_append_fn(name, False)()
        if not self.is_bw:  # a recomputation under activation checkpointing records nothing
            self._record(name, mod)
        tensors = [a for a in tree_flatten(input)[0] if isinstance(a, torch.Tensor) and a.requires_grad]
        if tensors:
            pop = self._get_pop_fn(name, True)
            leaf = any(t.grad_fn is None for t in tensors)
            self._hooks.append(register_multi_grad_hook(tensors, pop, mode="any" if leaf else "all"))
        if id(mod) not in self._post_hooks:
            self._post_hooks[id(mod)] = mod.register_forward_hook(self._fw_post_hook)

    def __enter__(self) -> _ModuleTracker:
        for record in (self.module_helper_dict, self.module_parameters_dict, self.sharding_dict):
            record.clear()
        self.module_helper_dict["Global"] = {"depth": 0}
        self._fw_pre_handle = register_module_forward_pre_hook(self._fw_pre_hook)
        return self

    def __exit__(self, *args: Any) -> None:
        self._fw_pre_handle.remove()
        for handle in (*self._post_hooks.values(), *self._hooks):
            handle.remove()
        self._post_hooks.clear()
        self._hooks.clear()


class CommDebugMode(TorchDispatchMode):
    """Context manager counting collectives by kind, with the bytes each rank sent.

    `comm_module_counts` attributes every collective to the module running it and to each of its
    parents, in forward or backward, as torch's: `{"Global": {"forward": {key: n}, "backward": ...},
    "Transformer.layers.0": ...}` (module names as torch.utils.module_tracker names them).
    """

    def __init__(self) -> None:
        super().__init__()
        self.comm_counts: defaultdict[Any, int] = defaultdict(int)
        self.comm_bytes: defaultdict[Any, int] = defaultdict(int)
        self.comm_module_counts: dict[str, dict[str, defaultdict[Any, int]]] = {}
        self._modules = _ModuleTracker()

    def __enter__(self) -> CommDebugMode:
        self.comm_counts.clear()
        self.comm_bytes.clear()
        self.comm_module_counts.clear()
        self._module_counts("Global")
        self._modules.__enter__()
        super().__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        self._modules.__exit__(*args)

    def get_total_counts(self) -> int:
        return sum(self.comm_counts.values())

    @property
    def advanced_module_tracker(self) -> _ModuleTracker:
        """The module tracker (torch's name): `module_helper_dict`, `module_parameters_dict`, `sharding_dict`."""
        return self._modules

    def get_parameter_info(self) -> dict[str, dict[str, torch.Tensor]]:
        """{module name: {parameter name: tensor}} of every module run forward inside the mode, as torch's."""
        return self._modules.module_parameters_dict

    def get_sharding_info(self) -> dict[str, tuple]:
        """{"<module>.<parameter>": placements} of those modules' DTensor parameters, as torch's."""
        return self._modules.sharding_dict

    def print_sharding_info(self) -> None:
        for key, value in self.get_sharding_info().items():
            print(f"{key}: {value}")

    def get_comm_counts(self) -> defaultdict[Any, int]:
        """Collectives by key; a collective never issued reads 0 (a defaultdict, as torch's)."""
        return self.comm_counts

    def get_comm_bytes(self) -> defaultdict[Any, int]:
        """Bytes this rank handed to collectives, by the keys of get_comm_counts."""
        return self.comm_bytes

    def _module_counts(self, name: str) -> dict[str, defaultdict[Any, int]]:
        counts = self.comm_module_counts.get(name)
        if counts is None:
            counts = self.comm_module_counts[name] = {"forward": defaultdict(int), "backward": defaultdict(int)}
        return counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(_defers_to_subclass(t) for t in types):
            # A DTensor op (ours or torch's): let the subclass run with this mode still active, so
            # the collectives it issues on local tensors come back here and are counted. Handling
            # it here would pop the mode and hide them (torch's CommDebugMode does the same).
            return NotImplemented
        counted = counted_collective(func, args)
        if counted is not None:
            key, nbytes = counted
            self.comm_counts[key] += 1
            self.comm_bytes[key] += nbytes
            phase = "backward" if self._modules.is_bw else "forward"
            for name in self._modules.parents | {"Global"}:
                self._module_counts(name)[phase][key] += 1
        return func(*args, **(kwargs or {}))
