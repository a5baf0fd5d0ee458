"""fully_shard's state machine: the legal sequence over training steps, and misuse that fails with a sentence.

Every training-state transition goes through `FSDPState._advance(event, expected, to)`; the programs
here wrap it on each module's state to record (module, event, from, to), and read each group's
sharded state at hooks inside and after its forward and backward.
"""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from parallelisms.dtensor import DeviceMesh, dispatch
from parallelisms.dtensor.debug import CommDebugMode
from parallelisms.fsdp import fully_shard
from parallelisms.fsdp.group import ShardedState
from parallelisms.fsdp.state import FSDPState
from tests.dtensor.harness import get_mesh
from tests.world import run_world

D = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _sharded(mesh: DeviceMesh | None = None, reshard_after_forward: bool | int | None = None) -> Stack:
    torch.manual_seed(0)
    model = Stack()
    mesh = mesh if mesh is not None else get_mesh((dist.get_world_size(),))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)
    return model


def _batch(seed: int) -> torch.Tensor:
    x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    return x.requires_grad_()  # so full backward hooks see an input gradient


def _backward(model: nn.Module, seed: int) -> dict[str, int]:
    with CommDebugMode() as comm:
        model(_batch(seed)).pow(2).mean().backward()
    return {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items() if v}


def _record_transitions(model: Stack) -> list[tuple[str, str, str, str]]:
    log: list[tuple[str, str, str, str]] = []
    for name, m in (("root", model), ("b0", model.blocks[0]), ("b1", model.blocks[1])):
        state: FSDPState = m._fsdp_state

        def advance(event, expected, to, _state=state, _advance=state._advance, _name=name) -> None:
            before = _state.training_state
            _advance(event, expected, to)
            log.append((_name, event, before.name, to.name))

        state._advance = advance  # type: ignore[method-assign]
    return log


def _record_sharded(model: Stack) -> list[tuple[str, str]]:
    """b0's sharded state inside and after its forward and its backward."""
    seen: list[tuple[str, str]] = []
    b0 = model.blocks[0]
    group = b0._fsdp_state.group
    b0.fc1.register_forward_pre_hook(lambda m, a: seen.append(("in forward", group.state.name)))
    b0.register_forward_hook(lambda m, a, o: seen.append(("after forward", group.state.name)))  # after fsdp's
    b0.fc1.register_full_backward_pre_hook(lambda m, g: seen.append(("in backward", group.state.name)))
    return seen


def _legal_sequence() -> dict[str, object]:
    model = _sharded()
    log = _record_transitions(model)
    seen = _record_sharded(model)
    group = model.blocks[0]._fsdp_state.group
    out: dict[str, object] = {}
    out["comm_step"] = _backward(model, 0)  # one synced step
    seen.append(("after backward", group.state.name))
    out["step"], out["sharded_step"] = list(log), list(seen)
    log.clear()
    seen.clear()
    model.zero_grad(set_to_none=True)
    model.set_requires_gradient_sync(False)  # accumulation: micro-batch 1 keeps its grads unsharded
    model.set_reshard_after_backward(False)
    out["comm_micro"] = _backward(model, 1)
    seen.append(("after backward", group.state.name))
    out["no_grads_yet"] = all(p.grad is None for p in model.parameters())
    model.set_requires_gradient_sync(True)  # micro-batch 2 reduces both in one reduce-scatter per group
    model.set_reshard_after_backward(True)
    out["comm_sync"] = _backward(model, 2)
    seen.append(("after backward", group.state.name))
    out["accumulation"], out["sharded_accumulation"] = list(log), list(seen)
    out["grads"] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    out["states"] = [m._fsdp_state.training_state.name for m in (model, *model.blocks)]
    return out


def _grads_reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Stack()
    for seed in (1, 2):
        for rank in range(2):
            x = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(seed + rank))
            (model(x).pow(2).mean() / 2).backward()
    return {n: p.grad for n, p in model.named_parameters()}


ONE_STEP = [
    ("root", "pre_forward", "IDLE", "FORWARD"),
    ("b0", "pre_forward", "IDLE", "FORWARD"),
    ("b0", "post_forward", "FORWARD", "IDLE"),
    ("b1", "pre_forward", "IDLE", "FORWARD"),
    ("b1", "post_forward", "FORWARD", "IDLE"),
    ("root", "post_forward", "FORWARD", "IDLE"),
    ("b1", "pre_backward", "IDLE", "PRE_BACKWARD"),  # b1's output is the root's: its hook came first
    ("root", "pre_backward", "IDLE", "PRE_BACKWARD"),
    ("b1", "post_backward", "PRE_BACKWARD", "POST_BACKWARD"),
    ("b0", "pre_backward", "IDLE", "PRE_BACKWARD"),
    ("b0", "post_backward", "PRE_BACKWARD", "POST_BACKWARD"),
    # end of backward, in tree order: the root has no parameters of its own, so no grad hook fired
    ("root", "post_backward", "PRE_BACKWARD", "POST_BACKWARD"),
    ("root", "end_of_backward", "POST_BACKWARD", "IDLE"),
    ("b0", "end_of_backward", "POST_BACKWARD", "IDLE"),
    ("b1", "end_of_backward", "POST_BACKWARD", "IDLE"),
]


def test_a_step_and_accumulation_follow_the_legal_sequence() -> None:
    reference = _grads_reference()
    for r in run_world(_legal_sequence, 2):
        assert r["step"] == ONE_STEP, r["step"]
        assert r["accumulation"] == ONE_STEP * 2, r["accumulation"]  # sync off, then on: the same states
        forward_and_back = [("in forward", "UNSHARDED"), ("after forward", "SHARDED"), ("in backward", "UNSHARDED")]
        assert r["sharded_step"] == [*forward_and_back, ("after backward", "SHARDED")], r["sharded_step"]
        # reshard_after_backward=False keeps micro-batch 1's parameters for micro-batch 2's backward ...
        assert r["sharded_accumulation"] == [
            *forward_and_back,
            ("after backward", "UNSHARDED"),
            ("in forward", "UNSHARDED"),
            ("after forward", "SHARDED"),  # ... forward reshards anyway (reshard_after_forward)
            ("in backward", "UNSHARDED"),
            ("after backward", "SHARDED"),
        ], r["sharded_accumulation"]
        assert r["comm_step"] == {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 2}, r
        assert "reduce_scatter_tensor" not in r["comm_micro"] and r["no_grads_yet"], r
        assert r["comm_sync"]["reduce_scatter_tensor"] == 2, r  # one per block, both micro-batches in it
        assert r["states"] == ["IDLE"] * 3
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ misuse
def _error(fn) -> str:
    with pytest.raises(RuntimeError) as e:
        fn()
    return str(e.value)


def _misuse() -> dict[str, str]:
    out = {}
    model = _sharded()
    _backward(model, 0)
    out["post_backward_after_step"] = _error(model.blocks[0]._fsdp_state.post_backward)

    # the post-backward path twice in one backward (no sync: no reduce-scatter left in flight)
    model = _sharded()
    model.set_requires_gradient_sync(False)
    b1 = model.blocks[1]._fsdp_state
    model.blocks[0].fc1.register_full_backward_pre_hook(lambda m, g: b1.post_backward())
    out["post_backward_twice"] = _error(lambda: _backward(model, 0))
    # that backward raised, so it never finished: the next forward says so before any collective
    out["forward_after_failed_backward"] = _error(lambda: model(_batch(1)))

    # resharding by hand while the forward or the backward still reads the unsharded parameters
    model = _sharded()
    model.set_requires_gradient_sync(False)
    handle = model.blocks[0].fc2.register_forward_pre_hook(lambda m, a: model.blocks[0].reshard())
    out["reshard_in_forward"] = _error(lambda: model(_batch(2)))
    handle.remove()
    model = _sharded()
    model.set_requires_gradient_sync(False)
    model.blocks[0].fc1.register_full_backward_pre_hook(lambda m, g: model.blocks[0].reshard())
    out["reshard_in_backward"] = _error(lambda: _backward(model, 3))
    return out


def test_misuse_fails_naming_the_module_and_the_states() -> None:
    for r in run_world(_misuse, 2):
        assert r["post_backward_after_step"].startswith(
            "fully_shard module blocks.0 (Block): post_backward found it in IDLE, expected PRE_BACKWARD; "
        ), r
        assert (
            "blocks.1 (Block): post_backward found it in POST_BACKWARD, expected PRE_BACKWARD"
            in (r["post_backward_twice"])
        ), r
        assert "would reduce-scatter its gradients again" in r["post_backward_twice"]
        assert "pre_forward found it in POST_BACKWARD, expected IDLE or FORWARD" in r["forward_after_failed_backward"]
        assert "the previous backward did not finish" in r["forward_after_failed_backward"]
        want = "blocks.0 (Block): reshard found it in {}, expected IDLE or POST_BACKWARD; the running forward"
        assert want.format("FORWARD") in r["reshard_in_forward"], r
        assert want.format("PRE_BACKWARD") in r["reshard_in_backward"], r


# ------------------------------------------------------------------------------ partial-reshard groups
def _holds_groups(value: object) -> bool:
    items = list(value.values()) if isinstance(value, dict) else list(value)  # type: ignore[call-overload]
    items += [x for v in items if isinstance(v, tuple | list) for x in v]
    return any(isinstance(x, dist.ProcessGroup | DeviceMesh) for x in items)


def _partial_groups_on_the_mesh() -> dict[str, object]:
    pgs = len(dist.distributed_c10d._world.pg_map)
    root = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("dp",))  # a fresh root, not the tests' cache
    created = len(dist.distributed_c10d._world.pg_map) - pgs
    model = _sharded(root, reshard_after_forward=2)
    _sharded(root, reshard_after_forward=2)  # a second model on the same mesh reuses the block groups
    block_groups = len(dist.distributed_c10d._world.pg_map) - pgs - created
    loss = model(_batch(0)).pow(2).mean()
    kept = model.blocks[0]._fsdp_state.group.state is ShardedState.SHARDED_POST_FORWARD
    loss.backward()
    refs = root._block_groups
    out: dict[str, object] = {
        "kept": kept,
        "block_groups": block_groups,
        "cached": list(refs),
        "weak": all(isinstance(r, weakref.ref) for r in refs.values()),
        "members": dist.get_process_group_ranks(root.block_group("dp", 2)),
    }
    fsdp_modules = [m for name, m in sys.modules.items() if name.startswith("parallelisms.fsdp")]
    out["module_caches"] = [
        f"{m.__name__}.{name}"
        for m in fsdp_modules
        for name, value in vars(m).items()
        if isinstance(value, dict | list | set | tuple) and _holds_groups(value)
    ]
    alive = weakref.ref(root)
    del model, root, refs, loss  # the loss keeps its graph, whose hooks hold the modules
    # dispatch's plan cache keys hold the specs (so the meshes) of every op it planned (here the
    # parameters' detach): a DTensor-core cache, cleared so that what fsdp holds is what is measured
    dispatch.PLANS.plans.clear()
    gc.collect()
    gc.collect()  # the first pass frees the backward's leftovers (finalizers), which held the mesh
    out["root_freed"] = alive() is None
    return out


def test_partial_reshard_groups_are_cached_on_the_mesh_and_freed_with_it() -> None:
    for rank, r in enumerate(run_world(_partial_groups_on_the_mesh, 4)):
        assert r["block_groups"] == 1, r  # its block of [0, 1], [2, 3] (c10d maps only its own), once for both
        assert r["cached"] == [((0,), 2)] and r["weak"], r
        assert r["members"] == ([0, 1] if rank < 2 else [2, 3]), r
        assert r["kept"] and r["module_caches"] == [], r
        assert r["root_freed"], r
