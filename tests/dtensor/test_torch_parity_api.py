"""API edges that torch's own DTensor / tensor-parallel tests check, run on torch's DTensor and ours.

Found with bench/torch_public_tests.py: error types and their order (a non-leaf tensor is refused
before its placements are looked at), `torch.load(weights_only=True)` of saved DTensors, Python
results of ops on ranks outside the mesh, `Shard._split_tensor`, and PrepareModuleInput's checks.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.tensor as tdt
from torch import nn

import parallelisms.dtensor as odt
from tests.dtensor.test_torch_parity import _mesh, both
from tests.world import run_world


def raised(fn: Callable[[], Any]) -> tuple[bool, bool, str] | None:
    """(is ValueError, is RuntimeError, message) of what fn() raised; None if it returned."""
    try:
        fn()
    except Exception as e:
        return isinstance(e, ValueError), isinstance(e, RuntimeError), str(e)
    return None


# --------------------------------------------------------------------------------------------------
# distribute_tensor / from_local refusals, weights_only load
# --------------------------------------------------------------------------------------------------


def refusals_program(name: str, dt, tp) -> dict[str, Any]:
    mesh = _mesh(name)
    non_leaf = torch.ones(4, 4, requires_grad=True) * 2
    d = dt.distribute_tensor(torch.arange(16.0).view(4, 4), mesh, [dt.Shard(0)])
    return {
        "non-leaf": raised(lambda: dt.distribute_tensor(non_leaf, mesh, [dt.Shard(0)])),
        # torch refuses the non-leaf before it looks at the (wrong) placement count
        "non-leaf, 2 placements": raised(lambda: dt.distribute_tensor(non_leaf, mesh, [dt.Shard(0)] * 2)),
        "2 placements": raised(lambda: dt.distribute_tensor(torch.ones(4, 4), mesh, [dt.Shard(0)] * 2)),
        "from_local of a DTensor": raised(lambda: dt.DTensor.from_local(d, mesh, [dt.Shard(0)])),
        "shape without stride": raised(
            lambda: dt.DTensor.from_local(torch.ones(2, 4), mesh, [dt.Shard(0)], shape=(3, 4))
        ),
        "stride without shape": raised(
            lambda: dt.DTensor.from_local(torch.ones(2, 4), mesh, [dt.Shard(0)], stride=(4, 1))
        ),
        # clamp_ cannot run on a Partial and must not leave it (torch's test_inplace_op_partial_to_replicate)
        "in-place into a Partial": raised(
            lambda: dt.DTensor.from_local(torch.tensor(64.0), mesh, [dt.Partial()]).clamp_(max=10)
        ),
    }


def save_load_program(name: str, dt, tp) -> list[tuple]:
    mesh = _mesh(name)
    loaded = []
    for placements in ([dt.Shard(0)], [dt.Replicate()], [dt.Partial()]):
        d = dt.DTensor.from_local(torch.arange(6.0).view(2, 3), mesh, placements)
        buffer = io.BytesIO()
        torch.save({"w": d}, buffer)
        buffer.seek(0)
        back = torch.load(buffer, weights_only=True)["w"]
        loaded.append((type(back) is type(d), back.placements == d.placements, tuple(back.shape), back.to_local()))
    return loaded


def test_refusals_and_weights_only_load_follow_torch() -> None:
    for result in run_world(both, 2, refusals_program):
        ours, theirs = result["ours"], result["torch"]
        for key in ours:
            assert ours[key] is not None and theirs[key] is not None, key
            assert ours[key][1] == theirs[key][1], (key, ours[key], theirs[key])  # RuntimeError or not
        assert theirs["non-leaf, 2 placements"][1] and "leaf" in ours["non-leaf, 2 placements"][2]
        assert ours["2 placements"][0] and theirs["2 placements"][0]
        assert "must have the same length" in ours["2 placements"][2]
        assert "only accepts torch.Tensor" in ours["from_local of a DTensor"][2]
        assert "Please pass both shape and stride" in ours["shape without stride"][2]
        inplace = "in-place operations that require placement changes are not supported"
        assert inplace in ours["in-place into a Partial"][2] and inplace in theirs["in-place into a Partial"][2]
    for result in run_world(both, 2, save_load_program):
        for ours, theirs in zip(result["ours"], result["torch"]):
            assert ours[:3] == theirs[:3] and ours[0] and ours[1]
            assert torch.equal(ours[3], theirs[3])


# --------------------------------------------------------------------------------------------------
# Python results on ranks outside the mesh
# --------------------------------------------------------------------------------------------------


def off_mesh_program(name: str, dt, tp) -> tuple[bool, bool]:
    if name == "ours":
        mesh = odt.DeviceMesh("cpu", [0, 1])
    else:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh("cpu", [0, 1])
    a = dt.DTensor.from_local(torch.ones(4, 3), mesh, [dt.Shard(0)])
    b = dt.DTensor.from_local(torch.zeros(4, 3), mesh, [dt.Shard(0)])
    return a.equal(a), a.equal(b)


@pytest.mark.parametrize("world_size", [4])
def test_equal_outside_the_mesh_reads_true_as_torch(world_size: int) -> None:
    results = run_world(both, world_size, off_mesh_program)
    for rank, result in enumerate(results):
        assert result["ours"] == result["torch"], (rank, result)
    assert all(r["ours"] == (True, False) for r in results)  # ranks 2, 3 learn the mesh's answer


def same_size_program(name: str, dt, tp) -> list:
    """is_same_size between a DTensor and a plain tensor compares global shapes (torch.equal asks it
    first); an op without a rule raises torch's sentence."""
    mesh = _mesh(name)
    d = dt.DTensor.from_local(torch.ones(4, 3), mesh, [dt.Shard(0)])  # global (8, 3)
    checks = [torch.ones(4, 3).is_same_size(d), torch.ones(8, 3).is_same_size(d), d.is_same_size(torch.ones(8, 3))]
    try:
        torch.linalg.cholesky(dt.distribute_tensor(torch.eye(4), mesh, [dt.Shard(0)]))
        checks.append("no error")
    except NotImplementedError as e:
        checks.append("does not have a sharding strategy registered" in str(e))
    return checks


def test_is_same_size_with_plain_tensors_and_missing_rule_message_follow_torch() -> None:
    for result in run_world(both, 2, same_size_program):
        assert result["ours"] == [False, True, True, True], result
        assert result["torch"][:3] == result["ours"][:3], result


# --------------------------------------------------------------------------------------------------
# Shard._split_tensor, PrepareModuleInput's checks
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", [True, False])
def test_shard_split_tensor_matches_torch(padding: bool) -> None:
    for size in range(7):
        for dim, shape in ((0, (size, 3)), (1, (2, size))):
            x = torch.arange(float(math.prod(shape))).view(shape)
            ours, ours_pads = odt.Shard(dim)._split_tensor(x, 4, with_padding=padding)
            theirs, their_pads = tdt.Shard(dim)._split_tensor(x, 4, with_padding=padding)
            assert ours_pads == their_pads, (size, dim)
            assert [t.shape for t in ours] == [t.shape for t in theirs], (size, dim)
            for o, t in zip(ours, theirs):
                torch.testing.assert_close(o, t, rtol=0, atol=0)
                assert o.is_contiguous()


class _TwoInputs(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


def prepare_input_program(name: str, dt, tp) -> dict[str, Any]:
    mesh = _mesh(name)

    def construct() -> None:
        tp.PrepareModuleInput(input_layouts=dt.Shard(0), desired_input_layouts=(dt.Replicate(), None))

    module = tp.parallelize_module(
        _TwoInputs(), mesh, tp.PrepareModuleInput(input_layouts=dt.Shard(0), desired_input_layouts=dt.Replicate())
    )
    try:
        construct()
        construction = None
    except AssertionError as e:  # torch asserts here; ours is also a ValueError
        construction = ("AssertionError", str(e))
    return {"construct": construction, "call": raised(lambda: module(torch.ones(2, 3), torch.ones(4, 3)))}


def test_prepare_module_input_length_checks_raise_as_torch() -> None:
    for result in run_world(both, 2, prepare_input_program):
        ours, theirs = result["ours"], result["torch"]
        assert ours["construct"] is not None and theirs["construct"] is not None
        assert "should have same length" in ours["construct"][1]
        assert ours["call"] is not None and theirs["call"] is not None
        assert ours["call"][0] and theirs["call"][0]  # ValueError
        assert "module inputs and input_layouts should have same length" in ours["call"][2]


# --------------------------------------------------------------------------------------------------
# Partial("product"), unbind's refusal, bucketize
# --------------------------------------------------------------------------------------------------


def ops_program(name: str, dt, tp) -> dict[str, Any]:
    mesh = _mesh(name)
    rank = torch.distributed.get_rank()
    product = dt.DTensor.from_local(torch.full((4, 2), rank + 2.0), mesh, [dt.Partial("product")])
    sharded = dt.distribute_tensor(torch.randn(4, 8), mesh, [dt.Shard(0)])
    boundaries = torch.tensor([1.0, 3.0, 5.0, 7.0])
    x = torch.tensor([[2.0, 4.0, 6.0, 8.0], [0.0, 1.0, 5.0, 9.0]]) + rank
    bucketized = {}
    for op in ("sum", "avg", "max", "min"):
        out = torch.bucketize(
            dt.DTensor.from_local(x, mesh, [dt.Partial(op)]), dt.distribute_tensor(boundaries, mesh, [dt.Replicate()])
        )
        bucketized[op] = (out.placements == (dt.Partial(op),), out.full_tensor())
    counted = torch.bucketize(
        dt.distribute_tensor(x, mesh, [dt.Replicate()]),
        dt.distribute_tensor(boundaries, mesh, [dt.Shard(0)]),
        right=True,
    )
    return {
        "product": [piece.full_tensor() for piece in torch.split(product, 3, dim=0)],
        "unbind": raised(lambda: sharded.unbind(0)),
        "bucketize": bucketized,
        "bucketize sharded boundaries": counted.full_tensor(),
    }


def test_product_partials_unbind_refusal_and_bucketize_as_torch() -> None:
    for result in run_world(both, 2, ops_program):
        ours, theirs = result["ours"], result["torch"]
        for o, t in zip(ours["product"], theirs["product"]):
            torch.testing.assert_close(o, t, rtol=0, atol=0)
        assert ours["unbind"] is not None and theirs["unbind"] is not None and ours["unbind"][1]
        assert (
            "Sharding propagation failed" in ours["unbind"][2] and "Sharding propagation failed" in theirs["unbind"][2]
        )
        for op in ("sum", "avg", "max", "min"):
            assert torch.equal(ours["bucketize"][op][1], theirs["bucketize"][op][1]), op
            assert ours["bucketize"][op][0] == theirs["bucketize"][op][0], op  # P(max)/P(min) survive
        assert torch.equal(ours["bucketize sharded boundaries"], theirs["bucketize sharded boundaries"])


# --------------------------------------------------------------------------------------------------
# vmap: functorch's batch rules make plain helper tensors under torch's implicit-replication flag
# --------------------------------------------------------------------------------------------------


def vmap_program(name: str, dt, tp) -> tuple:
    mesh = _mesh(name)
    ids = torch.zeros(2, 6, dtype=torch.int64)
    ids[0, 1] = ids[1, 3] = 1
    ids = dt.DTensor.from_local(ids, mesh, [dt.Shard(0)])
    weights = dt.DTensor.from_local(
        torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0)), mesh, [dt.Shard(0)]
    )
    out = torch.vmap(torch.nn.functional.embedding)(ids, weights)
    return tuple(out.shape), out.full_tensor()


def test_vmap_of_embedding_over_dtensors_as_torch() -> None:
    for result in run_world(both, 2, vmap_program):
        ours, theirs = result["ours"], result["torch"]
        # values agree; placements may not: torch gathers the weight (output S(0)), our planner
        # gathers the ids and keeps the vocab-sharded weight (output P(sum))
        assert ours[0] == theirs[0]
        torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# redistribute(forward_dtype=, backward_dtype=), Partial -> Partial gradients
# --------------------------------------------------------------------------------------------------


def dtype_and_partial_grad_program(name: str, dt, tp) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    from parallelisms.dtensor.debug import CommDebugMode

    mesh = _mesh(name)
    comm = CommDebugMode() if name == "ours" else TorchCommDebugMode()
    casts = []
    for forward, backward in ((torch.bfloat16, torch.float32), (None, torch.bfloat16), (torch.bfloat16, None)):
        x = dt.distribute_tensor(torch.arange(12.0).view(4, 3).requires_grad_(), mesh, [dt.Shard(0)])
        y = x.redistribute(mesh, [dt.Replicate()], forward_dtype=forward, backward_dtype=backward)
        y.backward(torch.ones_like(y))
        casts.append((y.dtype, y.to_local(), x.grad.dtype, x.grad.placements == (dt.Shard(0),), x.grad.to_local()))
    same = dt.distribute_tensor(torch.ones(4, 3), mesh, [dt.Replicate()]).redistribute(
        mesh, [dt.Replicate()], forward_dtype=torch.bfloat16
    )
    partial = dt.distribute_tensor(torch.ones(4, 3, requires_grad=True), mesh, [dt.Partial()])
    with comm:
        kept = partial.redistribute(mesh, [dt.Partial()])
        kept.backward(dt.DTensor.from_local(torch.ones(4, 3), mesh, [dt.Partial()]))
    return {
        "casts": casts,
        "same placements": (same.dtype, same.placements == (dt.Replicate(),)),
        "partial grad": (partial.grad.placements == (dt.Partial(),), partial.grad.to_local(), comm.get_total_counts()),
    }


def test_redistribute_dtypes_and_partial_grads_follow_torch() -> None:
    for result in run_world(both, 2, dtype_and_partial_grad_program):
        ours, theirs = result["ours"], result["torch"]
        for o, t in zip(ours["casts"], theirs["casts"]):
            assert o[0] == t[0] and o[2] == t[2] == torch.float32 and o[3] and t[3]
            torch.testing.assert_close(o[1], t[1], rtol=0, atol=0)
            torch.testing.assert_close(o[4], t[4], rtol=0, atol=0)
        assert ours["same placements"] == theirs["same placements"] == (torch.bfloat16, True)
        assert ours["partial grad"][0] and theirs["partial grad"][0]
        assert ours["partial grad"][2] == theirs["partial grad"][2] == 0
        torch.testing.assert_close(ours["partial grad"][1], theirs["partial grad"][1], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# experimental.local_map
# --------------------------------------------------------------------------------------------------


def local_map_program(name: str, dt, tp) -> dict[str, Any]:
    """Y = X @ W on the shards (X row-wise, W replicated), the same with inputs redistributed, gradients
    through to_local's grad placements, and the refusals; each with the collectives it issued."""
    import torch.distributed.tensor.experimental as torch_experimental
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    import parallelisms.dtensor.experimental as ours_experimental
    from parallelisms.dtensor.debug import CommDebugMode

    local_map = (ours_experimental if name == "ours" else torch_experimental).local_map
    comm = CommDebugMode() if name == "ours" else TorchCommDebugMode()
    mesh = _mesh(name)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 6, generator=g), torch.randn(6, 5, generator=g)
    row, rep = [dt.Shard(0)], [dt.Replicate()]
    x_row = dt.distribute_tensor(x.clone().requires_grad_(), mesh, row)
    w_rep = dt.distribute_tensor(w.clone().requires_grad_(), mesh, rep)
    mm = local_map(torch.mm, out_placements=row, in_placements=(row, rep), in_grad_placements=(row, rep))
    with comm:
        y = mm(x_row, w_rep)
    quiet = comm.get_total_counts()
    y.full_tensor().sum().backward()
    x_rep = dt.distribute_tensor(x, mesh, rep)
    moved = local_map(torch.mm, out_placements=row, in_placements=(row, rep), redistribute_inputs=True)(x_rep, w_rep)
    strict = local_map(torch.mm, out_placements=row, in_placements=(row, rep))
    decorated = local_map(out_placements=(row, None), device_mesh=mesh)(lambda a: (a * 2, "tag"))
    doubled, tag = decorated(x_row)
    return {
        "y": (y.placements == tuple(row), y.full_tensor(), quiet),
        "grads": (x_row.grad.placements == tuple(row), x_row.grad.full_tensor(), w_rep.grad.to_local()),
        "redistributed": moved.full_tensor(),
        "mismatch": raised(lambda: strict(x_rep, w_rep)),
        "None for a DTensor": raised(lambda: local_map(torch.mm, row, in_placements=(row, None))(x_row, w_rep)),
        "plain call": local_map(torch.mm, row, in_placements=(None, None), device_mesh=mesh)(x, w),
        "decorated": (doubled.full_tensor(), tag),
    }


def test_local_map_runs_on_shards_like_torchs() -> None:
    for result in run_world(both, 2, local_map_program):
        ours, theirs = result["ours"], result["torch"]
        assert ours["y"][0] and theirs["y"][0] and ours["y"][2] == theirs["y"][2] == 0  # no collective
        torch.testing.assert_close(ours["y"][1], theirs["y"][1], rtol=0, atol=0)
        for o, t in zip(ours["grads"], theirs["grads"]):
            assert (o is True and t is True) or torch.equal(o, t)
        torch.testing.assert_close(ours["redistributed"], theirs["redistributed"], rtol=0, atol=0)
        assert ours["mismatch"][:2] == theirs["mismatch"][:2] == (True, False)  # ValueError, as torch's
        assert "mismatched placements" in ours["mismatch"][2] and "redistribute_inputs=True" in ours["mismatch"][2]
        assert ours["None for a DTensor"] is not None and "expects placements" in ours["None for a DTensor"][2]
        assert torch.equal(ours["plain call"], theirs["plain call"])  # no DTensor argument: a plain tensor
        assert torch.equal(ours["decorated"][0], theirs["decorated"][0]) and ours["decorated"][1] == "tag"
