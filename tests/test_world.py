"""Tests for the multi-process test harness in tests/world.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from tests.world import World, WorldError, get_world, run_world


# Rank functions must be module-level: they are pickled by reference.
def _rank_info() -> tuple[int, int, float]:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _echo(a: int, *, b: str) -> tuple[int, int, str]:
    return dist.get_rank(), a, b


def _raise_on_rank(rank: int, msg: str) -> int:
    if dist.get_rank() == rank:
        raise ValueError(msg)
    return dist.get_rank()


def _raise_on_every_rank() -> None:
    raise KeyError(f"boom-from-{dist.get_rank()}")


def _raise_then_peers_all_reduce() -> None:
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 gave up")
    dist.all_reduce(torch.ones(1))  # blocks forever: rank 1 never joins


def _sleep_on_rank(rank: int, seconds: float) -> int:
    if dist.get_rank() == rank:
        time.sleep(seconds)
    return dist.get_rank()


def _exit_on_rank(rank: int, code: int) -> int:
    if dist.get_rank() == rank:
        os._exit(code)
    return dist.get_rank()


def _segfault_on_rank(rank: int) -> None:
    if dist.get_rank() == rank:
        os.kill(os.getpid(), signal.SIGSEGV)


def _pid() -> int:
    return os.getpid()


def _num_threads() -> int:
    return torch.get_num_threads()


def _env() -> dict[str, str]:
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {k: os.environ[k] for k in keys}


def _matmul_threads() -> tuple[float, int]:
    a = torch.randn(256, 256)
    return float((a @ a).isfinite().all()), torch.get_num_threads()


def _unpicklable_result() -> object:
    return lambda: None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_run_world_returns_rank_ordered_results_for_size(n: int) -> None:
    assert run_world(_rank_info, n) == [(r, n, n * (n - 1) / 2) for r in range(n)]


def test_run_world_passes_args_and_kwargs() -> None:
    assert run_world(_echo, 2, 7, b="x") == [(0, 7, "x"), (1, 7, "x")]


def test_world_reused_across_calls_same_pids() -> None:
    first = run_world(_pid, 2)
    assert run_world(_pid, 2) == first
    assert get_world(2).pids == first


def test_ranks_use_single_thread() -> None:
    assert run_world(_num_threads, 2) == [1, 1]


def test_world_fixture_returns_session_cached_world(world) -> None:
    assert world(2) is get_world(2)


def test_ranks_compute_after_parent_used_openmp_pool() -> None:
    # libgomp is not fork-safe: this would hang if ranks ran parallel regions after forking
    # from a parent whose OpenMP pool is already running.
    a = torch.randn(1024, 1024)
    assert torch.isfinite(a @ a).all()
    fresh = World(2)
    try:
        assert fresh.run(_matmul_threads, timeout=20) == [(1.0, 1), (1.0, 1)]
    finally:
        fresh.close()


def test_function_from_module_imported_after_fork_runs() -> None:
    get_world(2)  # make sure the world is forked before the import below
    import colorsys  # not imported by pytest/torch: ranks must import it when unpickling

    assert run_world(colorsys.rgb_to_hsv, 2, 1.0, 0.0, 0.0) == [(0.0, 1.0, 1.0)] * 2


def test_ranks_have_distributed_env_vars() -> None:
    envs = run_world(_env, 2)
    for r, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == str(r)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0


def test_rank_exception_raises_world_error_then_fresh_world_works() -> None:
    old_pids = get_world(2).pids
    with pytest.raises(WorldError) as exc:
        run_world(_raise_on_rank, 2, 1, "custom-message-42")
    msg = str(exc.value)
    assert "rank 1 raised:" in msg and "ValueError: custom-message-42" in msg
    assert "rank 0 raised" not in msg
    assert not any(_alive(p) for p in old_pids)
    assert run_world(_rank_info, 2) == [(0, 2, 1.0), (1, 2, 1.0)]
    assert get_world(2).pids != old_pids


def test_every_failing_rank_traceback_in_message_when_all_ranks_raise() -> None:
    with pytest.raises(WorldError) as exc:
        run_world(_raise_on_every_rank, 4)
    for r in range(4):
        assert f"rank {r} raised:" in str(exc.value) and f"boom-from-{r}" in str(exc.value)


def test_peer_stuck_in_collective_named_after_grace_when_rank_raises() -> None:
    start = time.monotonic()
    with pytest.raises(WorldError) as exc:
        run_world(_raise_then_peers_all_reduce, 2)
    assert time.monotonic() - start < 10
    msg = str(exc.value)
    assert "rank 1 raised:" in msg and "rank 1 gave up" in msg
    assert "ranks [0] of world 2 did not finish" in msg
    assert run_world(_pid, 2)  # recovered


def test_hang_raises_world_error_naming_rank_when_timeout_passes() -> None:
    world = get_world(4)
    start = time.monotonic()
    with pytest.raises(
        WorldError,
        match=r"ranks \[1\] of world 4 did not finish "
        r"_sleep_on_rank within 2(\.0)?s",
    ):
        world.run(_sleep_on_rank, 1, 60.0, timeout=2)
    assert 2 <= time.monotonic() - start < 6
    assert not any(_alive(p) for p in world.pids)
    assert run_world(_rank_info, 4)[3] == (3, 4, 6.0)


def test_rank_exit_reported_with_exit_code_promptly() -> None:
    start = time.monotonic()
    with pytest.raises(WorldError, match=r"(?s)rank 1 raised:.*died with exit code 3"):
        run_world(_exit_on_rank, 2, 1, 3)
    assert time.monotonic() - start < 5
    assert run_world(_pid, 2)


def test_rank_segfault_reported_with_signal_promptly() -> None:
    start = time.monotonic()
    with pytest.raises(WorldError, match=r"(?s)rank 0 raised:.*killed by signal SIGSEGV"):
        run_world(_segfault_on_rank, 2, 0)
    assert time.monotonic() - start < 5


def test_lambda_raises_type_error_in_parent() -> None:
    with pytest.raises(TypeError, match="module-level"):
        run_world(lambda: 1, 2)
    with pytest.raises(TypeError, match="module-level"):
        run_world(_echo, 2, lambda: 1, b="x")
    assert get_world(2).alive()  # nothing was sent, the world is intact


def test_unpicklable_result_raises_world_error() -> None:
    with pytest.raises(WorldError, match="rank 0 raised:"):
        run_world(_unpicklable_result, 2)


def test_close_reaps_all_rank_processes() -> None:
    world = World(2)
    pids = world.pids
    assert all(_alive(p) for p in pids)
    world.close()
    assert not any(_alive(p) for p in pids)
    with pytest.raises(WorldError, match="closed"):
        world.run(_pid)


def test_ranks_die_when_parent_is_killed(tmp_path) -> None:
    script = textwrap.dedent("""
        import sys, time
        sys.path.insert(0, sys.argv[1])
        from tests.world import World
        print(*World(2).pids, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, os.getcwd()], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
