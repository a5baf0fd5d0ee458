"""Public behaviour that ported torch DTensor programs rely on, run on our DTensor and torch's.

Each rank function runs one small program twice, once per implementation (only the imports
differ), and returns what both did: values, placements, error types, warnings.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.tensor as tdt
import torch.distributed.tensor.parallel as ttp
from torch import nn
from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

import parallelisms.dtensor as odt
import parallelisms.tensor_parallel as otp
from parallelisms.dtensor.debug import CommDebugMode
from parallelisms.dtensor.experimental import implicit_replication
from tests.dtensor.harness import as_partial, get_mesh, get_torch_mesh
from tests.world import run_world

IMPLS = {"ours": (odt, otp), "torch": (tdt, ttp)}


def _mesh(name: str, shape: tuple[int, ...] = (2,)):
    return get_mesh(shape) if name == "ours" else get_torch_mesh(shape)


def outcome(fn: Callable[[], Any]) -> Any:
    """fn()'s value, or the classes of the error it raised (so both sides compare by kind)."""
    try:
        return fn()
    except Exception as e:
        return ("raised", isinstance(e, ValueError), isinstance(e, RuntimeError))


def both(program: Callable[..., Any], *args: Any) -> dict[str, Any]:
    return {name: program(name, *impl, *args) for name, impl in IMPLS.items()}


# --------------------------------------------------------------------------------------------------
# distribute_tensor, meta tensors, to_empty
# --------------------------------------------------------------------------------------------------


def distribute_program(name: str, dt, tp) -> dict[str, Any]:
    mesh = _mesh(name)
    x = torch.arange(24.0).view(4, 6)
    d = dt.distribute_tensor(x, mesh, [dt.Shard(0)])
    meta = dt.distribute_tensor(torch.empty(5, 6, device="meta"), mesh, [dt.Shard(0)])
    from_meta = dt.DTensor.from_local(torch.empty(2, 6, device="meta"), mesh, [dt.Shard(0)])
    module = nn.Linear(6, 4, device="meta")
    module.weight = nn.Parameter(dt.distribute_tensor(module.weight, mesh, [dt.Shard(0)]))
    module.bias = nn.Parameter(dt.DTensor.from_local(torch.empty(4, device="meta"), mesh, [dt.Partial()]))
    module.to_empty(device="cpu")
    return {
        "same": dt.distribute_tensor(d, mesh, [dt.Shard(0)]) is d,
        "other placements": outcome(lambda: dt.distribute_tensor(d, mesh, [dt.Shard(1)])),
        "meta": (meta.shape, meta.to_local().shape, meta.to_local().is_meta, meta.placements == (dt.Shard(0),)),
        "from_local meta": (from_meta.shape, from_meta.to_local().is_meta),
        "to_empty": [
            (str(p.placements), p.to_local().device.type, tuple(p.to_local().shape)) for p in module.parameters()
        ],
    }


def test_distribute_tensor_of_a_dtensor_meta_tensors_and_to_empty_as_torch() -> None:
    for result in run_world(both, 2, distribute_program):
        ours, theirs = result["ours"], result["torch"]
        assert ours["same"] and theirs["same"]
        assert ours["other placements"] == theirs["other placements"] == ("raised", True, False)
        assert ours["meta"] == theirs["meta"] and ours["meta"][1] in (torch.Size([3, 6]), torch.Size([2, 6]))
        assert ours["from_local meta"] == theirs["from_local meta"]
        # placement strings differ in spelling (ours "(Partial(sum),)" vs torch's); compare the rest
        assert [e[1:] for e in ours["to_empty"]] == [e[1:] for e in theirs["to_empty"]]
        assert "Partial" in ours["to_empty"][1][0] and "Partial" in theirs["to_empty"][1][0]


# --------------------------------------------------------------------------------------------------
# plain tensors mixed with DTensors
# --------------------------------------------------------------------------------------------------


def mixed_program(name: str, dt, tp) -> dict[str, Any]:
    mesh = _mesh(name)
    x = torch.arange(24.0).view(4, 6)
    d = dt.distribute_tensor(x, mesh, [dt.Shard(0)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the implicit replication of (1,) tensors
        one = d * torch.tensor([2.0])
        first = torch.tensor([[3.0]]) + d
    param = nn.Parameter(dt.distribute_tensor(torch.ones(4, 6), mesh, [dt.Shard(0)]))
    param.grad = dt.distribute_tensor(torch.full((4, 6), 0.5), mesh, [dt.Shard(0)])
    torch.optim.AdamW([param], lr=torch.tensor([0.1]), foreach=False).step()
    return {
        "(1,)": (one.placements == (dt.Shard(0),), one.full_tensor()),
        "(1,1) first": first.full_tensor(),
        "adamw tensor lr": param.full_tensor(),
        "plain (4, 6)": outcome(lambda: d + torch.ones(4, 6)),
    }


def implicit_program() -> torch.Tensor:
    mesh = get_mesh((2,))
    d = odt.distribute_tensor(torch.arange(24.0).view(4, 6), mesh, [odt.Replicate()])
    with implicit_replication():
        return (d + torch.ones(4, 6)).full_tensor()


def test_single_element_tensors_count_as_replicated_and_implicit_replication_covers_the_rest() -> None:
    for result in run_world(both, 2, mixed_program):
        ours, theirs = result["ours"], result["torch"]
        for key in ("(1,)", "(1,1) first", "adamw tensor lr"):
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0)
        assert ours["plain (4, 6)"][0] == "raised" and theirs["plain (4, 6)"][0] == "raised"
    for full in run_world(implicit_program, 2):
        assert torch.equal(full, torch.arange(24.0).view(4, 6) + 1)


# --------------------------------------------------------------------------------------------------
# Partial("prod"), CommDebugMode
# --------------------------------------------------------------------------------------------------


def prod_and_comm_program() -> dict[str, Any]:
    mesh = get_mesh((2,))
    rank = torch.distributed.get_rank()
    p = odt.DTensor.from_local(torch.full((3,), rank + 2.0), mesh, [odt.Partial("prod")])
    r = odt.distribute_tensor(torch.tensor([-3.0, 5.0]), mesh, [odt.Replicate()])
    with CommDebugMode() as comm:
        full = p.full_tensor()
        roundtrip = as_partial(r, [odt.Partial("prod")]).redistribute(mesh, [odt.Replicate()])
        scattered = p.redistribute(mesh, [odt.Shard(0)]).full_tensor()
    counts = comm.get_comm_counts()
    return {
        "full": full,
        "roundtrip": roundtrip.to_local(),
        "scattered": scattered,
        "missing reads 0": counts[torch.ops.c10d_functional.all_to_all_single],
        "str": str(odt.Partial("prod")),
    }


def test_partial_prod_reduces_by_product_and_comm_counts_default_to_zero() -> None:
    for result in run_world(prod_and_comm_program, 2):
        assert torch.equal(result["full"], torch.full((3,), 6.0))
        assert torch.equal(result["roundtrip"], torch.tensor([-3.0, 5.0]))
        assert torch.equal(result["scattered"], torch.full((3,), 6.0))
        assert result["missing reads 0"] == 0 and result["str"] == "P(prod)"


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def module_counts_program(name: str, dt, tp) -> dict[str, Any]:
    mesh = _mesh(name)
    torch.manual_seed(0)
    model = tp.parallelize_module(TwoLayers(), mesh, {"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()})
    mode = CommDebugMode() if name == "ours" else TorchCommDebugMode()
    with mode:
        model(torch.randn(4, 8, requires_grad=True)).sum().backward()
    return {
        module: {phase: {str(k): v for k, v in counts.items() if v} for phase, counts in phases.items()}
        for module, phases in mode.comm_module_counts.items()
    }


def test_comm_module_counts_attribute_collectives_to_modules_as_torch() -> None:
    for result in run_world(both, 2, module_counts_program):
        ours, theirs = result["ours"], result["torch"]
        assert ours["Global"] == theirs["Global"] and ours["Global"]["forward"]
        for module in ("TwoLayers.up", "TwoLayers.down"):
            assert ours.get(module) == theirs.get(module), (module, ours, theirs)


# --------------------------------------------------------------------------------------------------
# validation and metadata
# --------------------------------------------------------------------------------------------------


def validation_program(name: str, dt, tp) -> dict[str, Any]:
    mesh = _mesh(name)
    rank = torch.distributed.get_rank()
    x = torch.arange(24.0).view(4, 6)
    d = dt.distribute_tensor(x, mesh, [dt.Shard(0)])
    local = torch.ones(2, 3) if rank == 0 else torch.ones(3, 2).t()  # same shape, other strides
    return {
        "unbind sharded": outcome(lambda: d.unbind(0)),
        "unbind other": [u.full_tensor() for u in d.unbind(1)][2],
        "as_strided identity": torch.equal(d.as_strided(d.shape, d.stride()).to_local(), d.to_local()),
        "storage_offset": (d[:, 2:].storage_offset(), d[:, 2:].to_local().storage_offset()),
        "run_check strides": outcome(lambda: dt.DTensor.from_local(local, mesh, [dt.Shard(0)], run_check=True)),
        "new_empty_strided": (lambda e: (e.stride(), e.to_local().stride()))(d.new_empty_strided((4, 6), (1, 4))),
    }


def test_validation_and_metadata_follow_torch() -> None:
    for result in run_world(both, 2, validation_program):
        ours, theirs = result["ours"], result["torch"]
        assert ours["unbind sharded"] == ("raised", True, True) and theirs["unbind sharded"][:3:2] == ("raised", True)
        assert torch.equal(ours["unbind other"], theirs["unbind other"])
        assert ours["as_strided identity"] and theirs["as_strided identity"]
        assert ours["storage_offset"] == theirs["storage_offset"]
        assert ours["run_check strides"][:2] == theirs["run_check strides"][:2] == ("raised", True)
        assert ours["new_empty_strided"] == theirs["new_empty_strided"]


def warnings_program(name: str, dt, tp) -> dict[str, Any]:
    mesh = _mesh(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tp.parallelize_module(TwoLayers(), mesh, {"nope": tp.ColwiseParallel()})
        no_key = len(caught)
        tp.parallelize_module(TwoLayers(), mesh, None)
        no_plan = len(caught) - no_key
        seen = []
        module = dt.distribute_module(TwoLayers(), mesh, input_fn=lambda inputs, device_mesh: seen.append(device_mesh))
        legacy = [w.category for w in caught[no_key + no_plan :]]
    module(dt.distribute_tensor(torch.randn(2, 8), mesh, [dt.Replicate()]))
    assert seen == [mesh]
    return {"no key": no_key, "no plan": no_plan, "legacy": FutureWarning in legacy}


def test_plan_mismatches_and_legacy_hooks_warn_as_torch() -> None:
    for result in run_world(both, 2, warnings_program):
        assert result["ours"] == result["torch"] == {"no key": 1, "no plan": 1, "legacy": True}


# --------------------------------------------------------------------------------------------------
# ranks outside a DTensor's mesh
# --------------------------------------------------------------------------------------------------


def submesh_program(name: str, dt, tp) -> dict[str, Any] | None:
    mesh = odt.DeviceMesh("cpu", [0, 1]) if name == "ours" else _torch_submesh()
    x = torch.arange(12.0).view(4, 3)
    d = dt.distribute_tensor(x, mesh, [dt.Shard(0)])
    w = dt.distribute_tensor(torch.ones(3, 2), mesh, [dt.Replicate()])
    results = {
        "distribute": d.to_local(),
        "from_local": dt.DTensor.from_local(torch.ones(2, 3), mesh, [dt.Shard(0)]).to_local(),
        "zeros": dt.zeros(4, 3, device_mesh=mesh, placements=[dt.Shard(0)]).to_local(),
        "redistribute": d.redistribute(mesh, [dt.Replicate()]).to_local(),
        "add": (d + d).to_local(),
        "mm": (d @ w).to_local(),
        "sum": d.sum().to_local(),
    }
    return {k: (tuple(v.shape), v.tolist()) for k, v in results.items()}


def _torch_submesh():
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", [0, 1])


@pytest.mark.parametrize("world_size", [4])
def test_ranks_outside_the_mesh_get_empty_shards_as_torch(world_size: int) -> None:
    results = run_world(both, world_size, submesh_program)
    for rank, result in enumerate(results):
        assert result["ours"] == result["torch"], (rank, result)
    assert results[2]["ours"]["add"] == ((0,), []) and results[0]["ours"]["sum"][0] == ()


def _prims_and_powsum(name: str) -> dict:
    """prims ops that decompositions emit and linalg__powsum: the same placements and values as torch's."""
    import torch.distributed.tensor as tdt

    import parallelisms.dtensor as odt
    from tests.dtensor.harness import get_mesh, get_torch_mesh

    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).abs() + 0.1
    results = {}
    for impl, mesh in ((odt, get_mesh((2,))), (tdt, get_torch_mesh((2,)))):
        d = impl.distribute_tensor(x, mesh, [impl.Shard(0)])
        ops = {
            "bessel_i0e": lambda t: torch.ops.prims.bessel_i0e(t),
            "view_of": lambda t: torch.ops.prims.view_of(t),
            "fmax": lambda t: torch.ops.prims.fmax(t, t * 0.5),
            "powsum": lambda t: torch.ops.aten.linalg__powsum(t, 3),
            "powsum_dim1": lambda t: torch.ops.aten.linalg__powsum(t, 2, [1]),
        }
        y = ops[name](d)
        results[impl.__name__] = (str(y.placements), y.full_tensor())
    return results


@pytest.mark.parametrize("name", ["bessel_i0e", "view_of", "fmax", "powsum", "powsum_dim1"])
def test_prims_ops_and_powsum_follow_torch(name: str) -> None:
    got = run_world(_prims_and_powsum, 2, name)[0]
    (ours, ours_value), (theirs, theirs_value) = got["parallelisms.dtensor"], got["torch.distributed.tensor"]
    assert ours == theirs
    torch.testing.assert_close(ours_value, theirs_value)


# --------------------------------------------------------------------------------------------------
# ops along a sharded dim
# --------------------------------------------------------------------------------------------------

ALONG_DIM_OPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "cumsum": lambda t: torch.cumsum(t, 1),
    "cummax": lambda t: torch.cummax(t, 1)[1],
    "logsumexp": lambda t: torch.logsumexp(t, 1),
    "topk": lambda t: torch.topk(t, 2, dim=1)[0],
    "sort": lambda t: torch.sort(t, dim=1)[0],
    "flip": lambda t: torch.flip(t, [1]),
}


def along_dim_program(name: str, dt, tp, op: str) -> dict[str, Any]:
    """An op along the sharded dim: torch gathers that dim once and returns Replicate (an all-to-all
    to another dim would be cheaper, but a ported program's to_local() would see another shape)."""
    counter = CommDebugMode if name == "ours" else TorchCommDebugMode
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(0))
    d = dt.distribute_tensor(x, _mesh(name), [dt.Shard(1)])
    with counter() as comm:
        y = ALONG_DIM_OPS[op](d)
    counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
    return {"placements": [repr(p) for p in y.placements], "comm": counts, "value": y.full_tensor()}


@pytest.mark.parametrize("op", list(ALONG_DIM_OPS))
def test_ops_along_a_sharded_dim_gather_it_once_and_return_replicate_as_torch(op: str) -> None:
    result = run_world(both, 2, along_dim_program, op)[0]
    ours, theirs = result["ours"], result["torch"]
    assert ours["placements"] == theirs["placements"] == ["Replicate()"]
    assert ours["comm"] == theirs["comm"] == {"all_gather_into_tensor": 1}
    torch.testing.assert_close(ours["value"], theirs["value"])


# --------------------------------------------------------------------------------------------------
# Partial arithmetic: collectives and placements as torch's
# --------------------------------------------------------------------------------------------------


def partial_arithmetic_program(name: str, dt, tp) -> dict[str, Any]:
    """The cases of torch's test_mul_partial and test_maximum_mixed_partials_redistribution, counted."""
    counter = CommDebugMode if name == "ours" else TorchCommDebugMode
    mesh, rank = _mesh(name), torch.distributed.get_rank()
    cases = {
        "P*P": lambda: (
            dt.DTensor.from_local(torch.ones(2, 2), mesh, [dt.Partial()])
            * dt.DTensor.from_local(torch.ones(2, 2), mesh, [dt.Partial()])
        ),
        "P(avg)*2": lambda: dt.DTensor.from_local(torch.ones(4), mesh, [dt.Partial("avg")]) * torch.tensor(2.0),
        "P(max)*R": lambda: (
            dt.DTensor.from_local(torch.ones(4), mesh, [dt.Partial("max")])
            * dt.distribute_tensor(torch.ones(4), mesh, [dt.Replicate()])
        ),
        "max(P(max), P(sum))": lambda: torch.maximum(
            dt.DTensor.from_local(torch.ones(4, 4) * (rank + 1), mesh, [dt.Partial("max")]),
            dt.DTensor.from_local(torch.ones(4, 4) * 0.1 * (rank + 1), mesh, [dt.Partial("sum")]),
        ),
    }
    out = {}
    for case, fn in cases.items():
        with counter() as comm:
            y = fn()
        # torch keys a direct c10d call by its c10d name (broadcast_), ours by its functional twin's (broadcast)
        counts = {str(k).split(".")[-1].rstrip("_"): v for k, v in comm.get_comm_counts().items() if v}
        out[case] = ([repr(p) for p in y.placements], counts, y.full_tensor())
    return out


def test_partial_arithmetic_follows_torch() -> None:
    result = run_world(both, 2, partial_arithmetic_program)[0]
    for case, (placements, counts, value) in result["torch"].items():
        ours = result["ours"][case]
        assert ours[:2] == (placements, counts), case
        torch.testing.assert_close(ours[2], value, msg=case)
