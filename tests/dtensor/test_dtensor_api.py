"""The DTensor API (from_local, to_local, full_tensor, repr, detach, distribute_tensor,
distribute_module, redistribute edge cases) against torch.distributed.tensor and torch.chunk."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
from torch import nn

from parallelisms.dtensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from parallelisms.dtensor.debug import CommDebugMode
from tests.dtensor.harness import chunk_local, get_mesh, get_torch_mesh, to_torch_placements
from tests.world import run_world


def global_tensor(shape, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def raised(fn, *args, **kwargs) -> str | None:
    """The `ValueError`/`NotImplementedError` message `fn` raises on this rank, or None."""
    try:
        fn(*args, **kwargs)
    except (ValueError, NotImplementedError, KeyError) as e:
        return f"{type(e).__name__}: {e}"
    return None


# --------------------------------------------------------------------------------------------------
# from_local / to_local / full_tensor
# --------------------------------------------------------------------------------------------------


def from_local_uneven_cases() -> None:
    for mesh_shape, placements, shape in (
        ((4,), [Shard(0)], (5, 3)),
        ((4,), [Shard(1)], (2, 3)),
        ((2, 2), [Shard(0), Shard(1)], (5, 7)),
        ((2, 2), [Shard(1), Shard(1)], (3, 9)),
        ((2, 2), [Replicate(), Shard(0)], (3, 4)),
    ):
        mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
        t = global_tensor(shape)
        local = chunk_local(t, mesh_shape, tmesh.get_coordinate(), placements)
        ours = DTensor.from_local(local, mesh, placements, shape=shape, stride=t.stride())
        theirs = tdt.DTensor.from_local(local, tmesh, to_torch_placements(placements), shape=shape, stride=t.stride())
        assert ours.shape == theirs.shape == t.shape and ours.stride() == theirs.stride() == t.stride()
        assert ours.to_local() is local or torch.equal(ours.to_local(), local)
        assert torch.equal(ours.full_tensor(), t) and torch.equal(theirs.full_tensor(), t)
        # run_check accepts the right shards
        checked = DTensor.from_local(local, mesh, placements, shape=shape, stride=t.stride(), run_check=True)
        assert torch.equal(checked.full_tensor(), t)


def test_from_local_with_shape_and_stride_builds_uneven_shards():
    run_world(from_local_uneven_cases, 4)


def from_local_infers_even_shape_and_stride() -> None:
    mesh, tmesh = get_mesh((2, 2)), get_torch_mesh((2, 2))
    for placements in (
        [Shard(0), Shard(1)],
        [Shard(1), Shard(0)],
        [Shard(0), Shard(0)],
        [Replicate(), Shard(1)],
        [Partial(), Shard(0)],
    ):
        for local in (torch.randn(2, 3), torch.randn(3, 2).t(), torch.randn(2, 3, 4).permute(2, 0, 1)):
            ours = DTensor.from_local(local, mesh, placements)
            theirs = tdt.DTensor.from_local(local, tmesh, to_torch_placements(placements))
            assert ours.shape == theirs.shape, (placements, ours.shape, theirs.shape)
            assert ours.stride() == theirs.stride(), (placements, local.stride(), ours.stride(), theirs.stride())
            assert ours.placements == tuple(placements)


def test_from_local_infers_global_shape_and_stride_like_torch_when_even():
    run_world(from_local_infers_even_shape_and_stride, 4)


def run_check_wrong_shapes() -> list[str | None]:
    mesh = get_mesh((2, 2))
    rank = dist.get_rank()
    messages = []
    # rank 3 passes a (1, 2) shard where (2, 2) belongs: ranks 0 shares no mesh group with it
    local = torch.zeros((1, 2) if rank == 3 else (2, 2))
    messages.append(
        raised(DTensor.from_local, local, mesh, [Shard(0), Shard(1)], shape=(4, 4), stride=(4, 1), run_check=True)
    )
    # uneven shards without shape=: every rank infers another global shape
    local = torch.zeros(3 if rank < 2 else 2, 4)
    messages.append(raised(DTensor.from_local, local, mesh, [Shard(0), Replicate()], run_check=True))
    # wrong dtype on one rank
    local = torch.zeros(2, 2, dtype=torch.float64 if rank == 1 else torch.float32)
    messages.append(raised(DTensor.from_local, local, mesh, [Replicate(), Replicate()], run_check=True))
    # the world is still usable: a collective after the errors completes on every rank
    ok = DTensor.from_local(torch.full((1, 2), float(rank)), mesh, [Shard(0), Shard(0)], run_check=True)
    assert ok.full_tensor()[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    return messages


def test_from_local_run_check_raises_on_every_rank_without_hanging():
    results = run_world(run_check_wrong_shapes, 4)
    for messages in results:
        assert all(m is not None and m.startswith("ValueError") for m in messages), messages
        assert "rank 3" in messages[0] and "(1, 2)" in messages[0] and "(2, 2)" in messages[0], messages[0]
        assert "shape=" in messages[1], messages[1]
        assert "float64" in messages[2], messages[2]
    assert all(r == results[0] for r in results), "every rank should raise the same error"


def run_check_broadcasts_replicas() -> None:
    mesh, tmesh = get_mesh((2, 2)), get_torch_mesh((2, 2))
    rank = dist.get_rank()
    for placements in ([Replicate(), Replicate()], [Replicate(), Shard(0)], [Shard(0), Replicate()]):
        local = torch.full((2, 3), float(rank))
        ours = DTensor.from_local(local.clone(), mesh, placements, run_check=True)
        theirs = tdt.DTensor.from_local(local.clone(), tmesh, to_torch_placements(placements), run_check=True)
        assert torch.equal(ours._local_tensor, theirs._local_tensor), (placements, rank)
    # a leaf that requires grad can be checked (and synced) too, and stays differentiable
    leaf = torch.full((2, 3), float(rank), requires_grad=True)
    d = DTensor.from_local(leaf, mesh, [Replicate(), Replicate()], run_check=True)
    assert d.to_local().eq(0).all()
    d.to_local().sum().backward()
    assert torch.equal(leaf.grad, torch.ones(2, 3))


def test_from_local_run_check_broadcasts_replicated_data_like_torch():
    run_world(run_check_broadcasts_replicas, 4)


def to_local_and_full_tensor() -> None:
    mesh = get_mesh((4,))
    t = global_tensor((7, 2))
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        d = distribute_tensor(t, mesh, placements)
        local = d.to_local()
        assert not local.requires_grad and local is d._local_tensor
        assert torch.equal(local, chunk_local(t, (4,), [dist.get_rank()], placements))
        assert torch.equal(d.full_tensor(), t)
    p = DTensor.from_local(torch.ones(3) * dist.get_rank(), mesh, [Partial()])
    assert torch.equal(p.full_tensor(), torch.full((3,), 6.0))


def test_to_local_and_full_tensor_return_shard_and_whole():
    run_world(to_local_and_full_tensor, 4)


# --------------------------------------------------------------------------------------------------
# repr, detach, requires_grad_
# --------------------------------------------------------------------------------------------------


def repr_detach_requires_grad() -> None:
    mesh = get_mesh((2,))
    d = distribute_tensor(global_tensor((5, 3)), mesh, [Shard(0)])
    text = repr(d)
    assert "Shard(dim=0)" in text and "(5, 3)" in text and "DTensor" in text, text
    assert d.requires_grad_() is d and d.requires_grad and d.is_leaf
    detached = d.detach()
    assert isinstance(detached, DTensor) and not detached.requires_grad
    assert detached.placements == d.placements and detached.shape == d.shape
    assert torch.equal(detached._local_tensor, d._local_tensor)
    assert detached.requires_grad_().requires_grad
    (d.to_local() * 2).sum().backward()
    assert isinstance(d.grad, DTensor) and d.grad.placements == (Shard(0),)
    assert torch.equal(d.grad._local_tensor, torch.full_like(d._local_tensor, 2.0))
    param = nn.Parameter(distribute_tensor(global_tensor((4, 4)), mesh, [Shard(1)]))
    assert isinstance(param, DTensor) and param.requires_grad and param.placements == (Shard(1),)


def test_repr_detach_and_requires_grad_keep_placements():
    run_world(repr_detach_requires_grad, 2)


# --------------------------------------------------------------------------------------------------
# distribute_tensor
# --------------------------------------------------------------------------------------------------

SRC_CASES = (
    ((4,), [Shard(0)]),
    ((4,), [Shard(1)]),
    ((4,), [Replicate()]),
    ((4,), [Partial()]),
    ((2, 2), [Shard(0), Shard(1)]),
    ((2, 2), [Replicate(), Shard(0)]),
    ((2, 2), [Shard(1), Replicate()]),
    ((2, 2), [Shard(0), Shard(0)]),
    ((2, 2), [Replicate(), Replicate()]),
    ((2, 2), [Partial(), Shard(1)]),
)


def distribute_from_source_rank(src_data_rank: int) -> None:
    rank = dist.get_rank()
    for shape in ((8, 4), (5, 3), (3, 2)):
        good = global_tensor(shape, seed=1)
        mine = good if rank == src_data_rank else torch.full(shape, float("nan"))  # garbage elsewhere
        for mesh_shape, placements in SRC_CASES:
            if src_data_rank >= min(mesh_shape):
                continue
            mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
            ours = distribute_tensor(mine, mesh, placements, src_data_rank=src_data_rank)
            theirs = tdt.distribute_tensor(mine, tmesh, to_torch_placements(placements), src_data_rank=src_data_rank)
            what = (shape, mesh_shape, placements)
            assert torch.equal(ours._local_tensor, theirs._local_tensor), what
            assert ours._local_tensor.is_contiguous() and ours.shape == good.shape, what
            if src_data_rank == 0:  # every rank ends up with the source's data
                assert torch.allclose(ours.full_tensor(), good), what


def test_distribute_tensor_ignores_data_off_the_source_rank():
    run_world(distribute_from_source_rank, 4, 0)


def test_distribute_tensor_from_another_source_rank_matches_torch():
    run_world(distribute_from_source_rank, 4, 1)


def distribute_locally() -> None:
    rank = dist.get_rank()
    for shape in ((8, 4), (5, 3)):
        mine = global_tensor(shape, seed=rank)  # every rank has its own copy
        for mesh_shape, placements in SRC_CASES:
            mesh, tmesh = get_mesh(mesh_shape), get_torch_mesh(mesh_shape)
            with CommDebugMode() as mode:
                ours = distribute_tensor(mine, mesh, placements, src_data_rank=None)
            assert mode.get_total_counts() == 0, mode.get_comm_counts()
            theirs = tdt.distribute_tensor(mine, tmesh, to_torch_placements(placements), src_data_rank=None)
            assert torch.equal(ours._local_tensor, theirs._local_tensor), (shape, placements)
            if not any(isinstance(p, Partial) for p in placements):
                expected = chunk_local(mine, mesh_shape, tmesh.get_coordinate(), placements)
                assert torch.equal(ours._local_tensor, expected)


def test_distribute_tensor_without_source_rank_chunks_locally_without_collectives():
    run_world(distribute_locally, 4)


def distribute_tensor_leaf_and_errors() -> list[str | None]:
    mesh = get_mesh((2,))
    t = global_tensor((4, 2)).requires_grad_()
    d = distribute_tensor(t, mesh, [Shard(0)])
    assert d.is_leaf and d.requires_grad and d._local_tensor.data_ptr() != t.data_ptr()
    r = distribute_tensor(t.detach(), mesh)  # default placements: replicated, and never aliases
    assert r.placements == (Replicate(),) and r._local_tensor.data_ptr() != t.data_ptr()
    return [
        raised(distribute_tensor, d, mesh, [Replicate()]),
        raised(distribute_tensor, t.detach(), mesh, [Shard(2)]),
        raised(distribute_tensor, t.detach(), mesh, [Shard(0), Shard(1)]),
        raised(distribute_tensor, t.detach(), mesh, [Shard(0)], src_data_rank=2),
    ]


def test_distribute_tensor_returns_leaf_and_rejects_bad_arguments():
    for messages in run_world(distribute_tensor_leaf_and_errors, 2):
        assert all(m is not None and m.startswith("ValueError") for m in messages), messages
        assert "redistribute" in messages[0]


# --------------------------------------------------------------------------------------------------
# distribute_module
# --------------------------------------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 6)
        self.register_buffer("scale", torch.full((6,), 2.0))

    def forward(self, x):  # x: DTensor (R), made by input_fn
        weight = self.proj.weight.full_tensor()
        bias = self.proj.bias.full_tensor()
        return (x.to_local() @ weight.t() + bias) * self.scale.to_local()


def shard_linear_rows(name, module, mesh) -> None:
    calls.append(("partition", name))
    if isinstance(module, nn.Linear):
        module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight.data, mesh, [Shard(0)])))


def input_to_dtensor(module, inputs, mesh):
    calls.append(("input", type(module).__name__))
    return (DTensor.from_local(inputs[0], mesh, [Replicate()]),)


def output_to_shards(module, outputs, mesh):
    calls.append(("output", type(module).__name__))
    return DTensor.from_local(outputs, mesh, [Replicate()]).redistribute(mesh, [Shard(0)])


calls: list[tuple[str, str]] = []


def distribute_module_hooks() -> None:
    calls.clear()
    mesh = get_mesh((2,))
    torch.manual_seed(0)
    model = Tiny()
    w, b, scale = (t.detach().clone() for t in (model.proj.weight, model.proj.bias, model.scale))
    x = global_tensor((3, 4))
    distribute_module(model, mesh, shard_linear_rows, input_to_dtensor, output_to_shards)
    assert ("partition", "") in calls and ("partition", "proj") in calls
    assert isinstance(model.proj.weight, nn.Parameter) and isinstance(model.proj.weight, DTensor)
    assert model.proj.weight.placements == (Shard(0),) and model.proj.weight._local_tensor.shape == (3, 4)
    assert model.proj.bias.placements == (Replicate(),) and isinstance(model.proj.bias, nn.Parameter)
    assert isinstance(model.scale, DTensor) and model.scale.placements == (Replicate(),)
    out = model(x)
    assert calls[-2:] == [("input", "Tiny"), ("output", "Tiny")]
    assert isinstance(out, DTensor) and out.placements == (Shard(0),)
    assert torch.allclose(out.full_tensor(), (x @ w.t() + b) * scale)
    try:
        distribute_module(model, mesh)
    except RuntimeError:
        pass
    else:
        raise AssertionError("distribute_module applied twice should raise")
    plain = distribute_module(nn.Linear(2, 2), mesh)  # no partition_fn: everything replicated
    assert all(isinstance(p, DTensor) and p.placements == (Replicate(),) for p in plain.parameters())


def test_distribute_module_partitions_params_and_runs_hooks():
    run_world(distribute_module_hooks, 2)


# --------------------------------------------------------------------------------------------------
# redistribute edge cases
# --------------------------------------------------------------------------------------------------


def redistribute_edges() -> list[str | None]:
    mesh, other = get_mesh((2, 2)), get_mesh((4,))
    d = distribute_tensor(global_tensor((4, 4)), mesh, [Shard(0), Replicate()])
    with CommDebugMode() as mode:
        assert d.redistribute(mesh, [Shard(0), Replicate()]) is d
        assert d.redistribute(placements=[Shard(-2), Replicate()]) is d
    assert mode.get_total_counts() == 0
    g = d.detach().requires_grad_()
    same = g.redistribute(mesh, [Shard(0), Replicate()])  # recorded by autograd, like torch
    assert same is not g and same._local_tensor is g._local_tensor and same.grad_fn is not None
    return [
        raised(d.redistribute, other, [Shard(0)]),
        raised(d.redistribute, mesh, [Shard(0)]),
        raised(d.redistribute, mesh, None),
    ]


def test_redistribute_returns_self_for_same_placements_and_rejects_other_meshes():
    for messages in run_world(redistribute_edges, 4):
        assert messages[0] is not None and messages[0].startswith("NotImplementedError"), messages
        assert messages[1] is not None and "2-D mesh" in messages[1], messages
        assert messages[2] is not None and messages[2].startswith("ValueError"), messages
