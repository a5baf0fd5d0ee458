"""Prefetch and overlap in fully_shard, shown rather than assumed.

Each program records events (a group's all-gather issued / landed, a block's compute starting and
ending, a reduce-scatter issued / landed) on a stack of blocks trained on 2 ranks, and checks the
overlap windows and the live unsharded parameters at every group boundary.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from parallelisms.dtensor.debug import CommDebugMode
from parallelisms.fsdp import fully_shard
from parallelisms.fsdp.group import ShardedState
from tests.dtensor.harness import get_mesh
from tests.world import run_world

D, N_BLOCKS = 24, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 3 * D)
        self.fc2 = nn.Linear(3 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(N_BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _sharded(reshard_root: bool = False) -> Stack:
    torch.manual_seed(0)
    model = Stack()
    mesh = get_mesh((torch.distributed.get_world_size(),))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True if reshard_root else None)
    return model


def _record(model: Stack) -> list[tuple[str, int]]:
    """Events by block index: gather issued/landed, compute start/end, reduce issued/landed."""
    events: list[tuple[str, int]] = []
    for i, block in enumerate(model.blocks):
        group = block._fsdp_state.group

        def unshard(*, async_op: bool = False, _f=group.unshard, _g=group, _i=i, **kwargs) -> None:
            if not _g.is_unsharded and not _g.is_gathering:
                events.append(("issue", _i))
            _f(async_op=async_op, **kwargs)

        def wait_unshard(_f=group.wait_unshard, _g=group, _i=i) -> None:
            if _g.is_gathering:
                events.append(("land", _i))
            _f()

        def reduce(*, async_op: bool = False, _f=group.reduce_grads, _i=i) -> None:
            events.append(("rs_issue", _i))
            _f(async_op=async_op)

        def finish(_f=group.finish_reduce, _g=group, _i=i) -> None:
            if _g._reducing is not None:
                events.append(("rs_land", _i))
            _f()

        group.unshard, group.wait_unshard, group.reduce_grads, group.finish_reduce = (
            unshard,
            wait_unshard,
            reduce,
            finish,
        )
        block.fc1.register_forward_pre_hook(lambda m, a, _i=i: events.append(("compute", _i)))
        block.fc2.register_forward_hook(lambda m, a, o, _i=i: events.append(("done", _i)))
        block.fc2.register_full_backward_pre_hook(lambda m, go, _i=i: events.append(("bwd_start", _i)))
        block.fc1.register_full_backward_hook(lambda m, gi, go, _i=i: events.append(("bwd_done", _i)))
    return events


def _step(model: Stack, seed: int) -> None:
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(seed + torch.distributed.get_rank()))
    model(x).pow(2).mean().backward()


def _overlap() -> dict[str, list]:
    model = _sharded()
    events = _record(model)
    _step(model, 0)  # the first iteration records the forward order
    events.clear()
    _step(model, 1)
    return {"events": events}


def test_next_groups_all_gather_is_in_flight_while_this_group_computes() -> None:
    events = run_world(_overlap, 2)[0]["events"]
    forward_end = events.index(("done", N_BLOCKS - 1))
    forward, backward = events[: forward_end + 1], events[forward_end + 1 :]
    for b in range(N_BLOCKS - 1):
        # forward: block b+1's all-gather is issued before block b computes and lands after it
        assert forward.index(("issue", b + 1)) < forward.index(("compute", b)), events
        assert forward.index(("done", b)) < forward.index(("land", b + 1)), events
    for b in range(N_BLOCKS - 1, 0, -1):
        # backward: block b-1's all-gather is issued before block b's backward starts, landed after
        # it; block b's reduce-scatter is issued before block b-1's backward starts and lands after
        assert backward.index(("issue", b - 1)) < backward.index(("bwd_start", b)), events
        assert backward.index(("bwd_start", b)) < backward.index(("land", b - 1)), events
        assert backward.index(("rs_issue", b)) < backward.index(("bwd_start", b - 1)), events
        assert backward.index(("bwd_start", b - 1)) < backward.index(("rs_land", b)), events
    assert ("rs_land", 0) in backward  # the last one lands at the end of backward


def _live_groups() -> dict[str, object]:
    model = _sharded(reshard_root=True)
    states = [b._fsdp_state for b in model.blocks]
    most = {"forward": 0, "backward": 0}
    most_bytes = {"forward": 0, "backward": 0}

    def measure(phase: str) -> None:
        live = [s for s in states if s.group.is_unsharded or s.group.is_gathering]
        most[phase] = max(most[phase], len(live))
        nbytes = sum(
            p._padded.untyped_storage().nbytes() for s in states for p in s.group.params if p._padded is not None
        )
        most_bytes[phase] = max(most_bytes[phase], nbytes)

    for b in model.blocks:
        b.register_forward_pre_hook(lambda m, a: measure("forward"))
        b.register_forward_hook(lambda m, a, o: measure("forward"))
        b.register_full_backward_pre_hook(lambda m, go: measure("backward"))
        b.register_full_backward_hook(lambda m, gi, go: measure("backward"))
    _step(model, 0)
    _step(model, 1)
    group_bytes = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks)
    return {"most": most, "bytes": most_bytes, "group_bytes": group_bytes}


def test_at_most_two_groups_hold_unsharded_parameters() -> None:
    """reshard_after_forward=True everywhere: the running group and the prefetched one, no more,
    in forward and backward; live unsharded bytes stay within two groups' worth."""
    for r in run_world(_live_groups, 2):
        assert r["most"]["forward"] <= 2 and r["most"]["backward"] <= 2, r
        for phase in ("forward", "backward"):
            assert r["bytes"][phase] <= 2 * r["group_bytes"] * 1.2, r  # padding to whole rows


def _explicit_prefetch_and_accumulation() -> dict[str, object]:
    model = _sharded()
    blocks = model.blocks
    blocks[0].set_modules_to_forward_prefetch([blocks[1], blocks[2]])  # two ahead
    blocks[3].set_modules_to_backward_prefetch([blocks[2], blocks[1]])
    events = _record(model)
    _step(model, 0)
    forward = events[: next(i for i, e in enumerate(events) if e[0] == "bwd_done")]
    early = forward.index(("issue", 2)) < forward.index(("compute", 0))
    # gradient accumulation: no reduce-scatter while sync is off, and, with reshard_after_backward
    # off, no all-gather in the next micro-batch's forward (backward gathers again, as forward resharded)
    model.zero_grad(set_to_none=True)
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    with CommDebugMode() as micro:
        _step(model, 1)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(2 + torch.distributed.get_rank()))
    with CommDebugMode() as second_forward:  # the parameters stayed unsharded after backward
        out = model(x)
    out.pow(2).mean().backward()
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    _step(model, 3)
    handle = blocks[1].unshard(async_op=True)
    assert handle is not None
    handle.wait()
    gathered = blocks[1]._fsdp_state.group.is_unsharded
    blocks[1].reshard()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    micro_counts = {str(k): v for k, v in micro.get_comm_counts().items() if v}
    return {
        "early": early,
        "micro": micro_counts,
        "second_forward": second_forward.get_total_counts(),
        "gathered": gathered,
        "grads": grads,
    }


def _accumulation_reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Stack()
    for seed in (1, 2, 3):
        for rank in range(2):
            x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(seed + rank))
            (model(x).pow(2).mean() / 2).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def test_explicit_prefetch_unshard_handle_and_accumulation_without_communication() -> None:
    results = run_world(_explicit_prefetch_and_accumulation, 2)
    reference = _accumulation_reference()
    for r in results:
        assert r["early"] and r["gathered"]
        assert not any("reduce_scatter" in str(k) for k in r["micro"]), r["micro"]
        assert r["second_forward"] == 0, r
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, reference[name], rtol=1e-5, atol=1e-6)


def _partial_reshard(k: int | bool = 2) -> dict[str, object]:
    torch.manual_seed(0)
    model = Stack()
    mesh = get_mesh((torch.distributed.get_world_size(),))
    for b in model.blocks:
        fully_shard(b, mesh=mesh, reshard_after_forward=k)
    fully_shard(model, mesh=mesh)
    group = model.blocks[0]._fsdp_state.group
    kept = []
    post_forward = ShardedState.SHARDED_POST_FORWARD
    model.blocks[1].register_forward_pre_hook(lambda m, a: kept.append(group.state is post_forward))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for seed in range(3):
        _step(model, seed)
        opt.step()
        opt.zero_grad()
    error = ""
    try:
        fully_shard(Block(), mesh=mesh, reshard_after_forward=3)
    except ValueError as e:
        error = str(e)
    return {"kept": kept, "params": {n: p.full_tensor() for n, p in model.named_parameters()}, "error": error}


def _partial_reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Stack()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for seed in range(3):
        for rank in range(4):
            x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(seed + rank))
            (model(x).pow(2).mean() / 4).backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


def test_reshard_after_forward_int_keeps_a_k_rank_shard_and_trains_exactly() -> None:
    """reshard_after_forward=2 on 4 ranks: after forward a group keeps half the gathered slots
    (backward gathers over 2 ranks); training is bitwise that of reshard_after_forward=True (the
    same reductions) and equals one process (AdamW after 3 steps: up to 1e-4 relative on an element
    whose gradient sum rounds differently in a 4-rank average)."""
    reference = _partial_reference()
    full = run_world(_partial_reshard, 4, True)
    for r, f in zip(run_world(_partial_reshard, 4), full):
        assert r["kept"] == [True] * 3 and f["kept"] == [False] * 3, (r["kept"], f["kept"])
        assert "divide the shard dim's size 4" in r["error"]
        for name, p in r["params"].items():
            assert torch.equal(p, f["params"][name]), name
            torch.testing.assert_close(p, reference[name].detach(), rtol=2e-4, atol=1e-5)
