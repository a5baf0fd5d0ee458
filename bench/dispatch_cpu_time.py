"""Per-op DTensor dispatch cost, ours against torch's, in CPU time of the calling thread.

    python bench/dispatch_cpu_time.py [--rounds 7] [--calls 2000]

The micro cases of `../shared/bench/dtensor_overhead.py` (same shapes and placements, 2 gloo ranks),
timed differently: both implementations live in the same two processes and take turns, round
after round, and each call is charged the CPU time of its thread (`time.thread_time_ns`), not the
wall clock. Time the machine spends on other processes is not counted, so a case's ratio holds
still on a shared, loaded machine where the wall-clock benchmark moves by 2x between runs. None of
these cases communicates, so the CPU time is the whole cost. Prints one line per case (medians
over rounds, µs, on rank 0) and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def _cases(api: ModuleType) -> dict[str, Callable[[], object]]:
    mesh = api.init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    a, b, m = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g)
    S, R = api.Shard, api.Replicate
    dt = api.distribute_tensor
    a_s0, b_s0, a_r, a_s1 = dt(a, mesh, [S(0)]), dt(b, mesh, [S(0)]), dt(a, mesh, [R()]), dt(a, mesh, [S(1)])
    m_r, m_s0, m_s1 = dt(m, mesh, [R()]), dt(m, mesh, [S(0)]), dt(m, mesh, [S(1)])
    local = a_s0.to_local().clone()
    return {
        "add S0+S0": lambda: a_s0 + b_s0,
        "mm S0 x R": lambda: torch.mm(a_s0, m_r),
        "mm R x S1": lambda: torch.mm(a_r, m_s1),
        "mm S1 x S0 -> P": lambda: torch.mm(a_s1, m_s0),
        "sum dim0 -> P": lambda: a_s0.sum(0),
        "relu S0": lambda: torch.relu(a_s0),
        "view S0": lambda: a_s0.view(8, 4, 4),
        "reshape S0": lambda: a_s0.reshape(-1),
        "from_local S0": lambda: api.DTensor.from_local(local, mesh, [S(0)], run_check=False),
    }


def _cpu_us_per_call(fn: Callable[[], object], calls: int) -> float:
    for _ in range(calls // 10):
        fn()
    start = time.thread_time_ns()
    for _ in range(calls):
        fn()
    return (time.thread_time_ns() - start) / calls / 1000


def _rank(rank: int, world: int, port: int, rounds: int, calls: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sys.path.insert(0, str(ROOT))
    import torch.distributed.tensor as theirs

    import parallelisms.dtensor as ours

    impls = {"torch": _cases(theirs), "ours": _cases(ours)}
    times: dict[str, dict[str, list[float]]] = {impl: {c: [] for c in cases} for impl, cases in impls.items()}
    for _ in range(rounds):
        for case in impls["torch"]:
            for impl, cases in impls.items():
                times[impl][case].append(_cpu_us_per_call(cases[case], calls))
    if rank == 0:
        result = {}
        print(f"{'case':18s} {'torch_us':>9s} {'ours_us':>9s} {'ours/torch':>10s}")
        for case in impls["torch"]:
            t, o = statistics.median(times["torch"][case]), statistics.median(times["ours"][case])
            result[case] = {"torch_us": round(t, 2), "ours_us": round(o, 2), "ratio": round(o / t, 3)}
            print(f"{case:18s} {t:9.1f} {o:9.1f} {o / t:10.2f}")
        print(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="turns each implementation takes per case")
    ap.add_argument("--calls", type=int, default=2000, help="calls per turn")
    args = ap.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, args.rounds, args.calls), nprocs=2)


if __name__ == "__main__":
    main()
