"""The dispatcher: caching, clear errors, the replicate fallback and MESHTRAIN_DEBUG logging."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.world import run_world


def _errors() -> dict[str, str]:
    from parallelisms.dtensor import Replicate, Shard, distribute_tensor
    from tests.dtensor.harness import get_mesh

    mesh = get_mesh((2,))
    x = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    found = {}
    try:
        torch.linalg.cholesky(x)
    except NotImplementedError as e:
        found["missing"] = str(e)
    try:
        x.clone() + torch.ones(4, 4)
    except ValueError as e:
        found["plain"] = str(e)
    other = distribute_tensor(torch.randn(4, 4), get_mesh((1, 2)), [Replicate(), Shard(0)])
    try:
        torch.ops.aten.add.Tensor(x, other)
    except (ValueError, NotImplementedError) as e:
        found["mesh"] = str(e)
    return found


def test_dispatch_errors_name_the_op_the_placements_and_the_fix():
    found = run_world(_errors, 2)[0]
    assert "Operator aten.linalg_cholesky_ex.default does not have a sharding strategy" in found["missing"]
    assert "S(0)" in found["missing"] and "parallelisms/dtensor/ops/" in found["missing"]
    assert "plain torch.Tensor" in found["plain"] and "distribute_tensor" in found["plain"]
    assert "different meshes" in found["mesh"]


def _cache_and_fallback() -> tuple[int, int, bool]:
    from parallelisms.dtensor import Shard, distribute_tensor
    from parallelisms.dtensor.dispatch import PLANS, replicate_fallback
    from tests.dtensor.harness import get_mesh

    mesh = get_mesh((2,))
    a = torch.randn(6, 6)
    spd = a @ a.T + 6 * torch.eye(6)
    x = distribute_tensor(spd, mesh, [Shard(0)])
    x.clone()
    before = len(PLANS)
    for _ in range(3):
        x.clone()
    after = len(PLANS)
    with replicate_fallback():
        chol = torch.linalg.cholesky(x)
    ok = torch.allclose(chol.full_tensor(), torch.linalg.cholesky(spd), atol=1e-5)
    return before, after, ok


def test_plans_are_cached_and_fallback_gathers_to_replicate():
    for before, after, ok in run_world(_cache_and_fallback, 2):
        assert before == after
        assert ok


def _debug_log() -> list[str]:
    from parallelisms.dtensor import Shard, dispatch, distribute_tensor
    from tests.dtensor.harness import get_mesh

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep()
    dispatch.logger.addHandler(handler)
    dispatch.logger.setLevel(logging.INFO)
    previous, dispatch.DEBUG = dispatch.DEBUG, True
    try:
        mesh = get_mesh((2,), ("tp",))
        x = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
        with dispatch.replicate_fallback():
            torch.linalg.cholesky(x)  # an op without a rule: its input is gathered
    except Exception:
        pass
    finally:
        dispatch.DEBUG = previous
        dispatch.logger.removeHandler(handler)
    return records


def test_debug_logs_each_implicit_redistribution():
    records = run_world(_debug_log, 2)[0]
    assert any("arg0 (S(0))->(R): all_gather on tp" in r for r in records), records


@pytest.mark.parametrize("n", [2])
def test_scalar_tensors_act_as_replicated(n):
    assert all(run_world(_scalar_tensor, n))


def _scalar_tensor() -> bool:
    from parallelisms.dtensor import Shard, distribute_tensor
    from tests.dtensor.harness import get_mesh

    x = distribute_tensor(torch.arange(6.0).view(3, 2), get_mesh((2,)), [Shard(0)])
    y = torch.ops.aten.mul.Tensor(x, torch.tensor(2.0))
    return torch.equal(y.full_tensor(), torch.arange(6.0).view(3, 2) * 2)


def test_dispatch_options_and_cost_model_are_local_to_a_thread() -> None:
    """The async checkpoint writer or a data thread must never plan under the training thread's options."""
    import threading

    from parallelisms.dtensor import cost, dispatch

    inside, seen, done = threading.Event(), {}, threading.Event()

    def other_thread() -> None:
        inside.wait(5)
        seen["fallback"] = dispatch.options().replicate_fallback
        seen["implicit"] = dispatch.options().implicit_replication
        seen["model"] = cost.cost_model()
        done.set()

    custom = cost.CostModel(backend="nccl")  # not the default (equal models are one object)
    thread = threading.Thread(target=other_thread)
    thread.start()
    with dispatch.replicate_fallback(), dispatch.implicit_replication(), cost.use_cost_model(custom):
        assert dispatch.options().replicate_fallback and cost.cost_model() is custom
        inside.set()
        assert done.wait(5)
    thread.join()
    assert seen == {"fallback": False, "implicit": False, "model": cost.cost_model()}
    assert seen["model"] is not custom and not dispatch.options().replicate_fallback
