"""Collective latency and bandwidth on this machine's backend, next to the cost model's link prices.

Times all-reduce, all-gather and reduce-scatter of 1 element to 16 MiB on `--ranks` gloo processes
(or NCCL with `--backend nccl` on GPUs), fits the α–β line `seconds = α + sent / β` to the medians
(sent: the bytes one rank sends in a ring, transitions.RING_VOLUME; `fit` says how), and prints the fit beside
`parallelisms.dtensor.cost`'s intra-host link for that backend, with the model's error at each size. It also
times our reduce-scatter (`collectives.reduce_scatter_flat`: on gloo an all_to_all and a local sum) beside the
backend's own (`reduce_scatter_ms` in the summary, by size):

    python bench/collective_latency.py --ranks 2 --repeats 200
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parallelisms.dtensor.collectives import reduce_scatter_flat

OURS = "reduce_scatter (meshtrain)"
SIZES = [1, 1024, 16 * 1024, 256 * 1024, 4 * 1024 * 1024]  # fp32 elements: 4 B .. 16 MiB


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of one call, over batches of back-to-back calls (a barrier before every call
    would add the ranks' skew in leaving it)."""
    for _ in range(5):
        fn()
    batch = 10
    times = []
    dist.barrier()
    for _ in range(max(repeats // batch, 1)):
        start = time.perf_counter()
        for _ in range(batch):
            fn()
        times.append((time.perf_counter() - start) / batch)
    return statistics.median(times)


def _call_and_sync(fn: Callable[[], object], sync: Callable[[], None]) -> None:
    fn()
    sync()


def _worker(rank: int, world: int, backend: str, port: int, repeats: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # reduce_scatter_tensor's rename
    dist.init_process_group(backend, rank=rank, world_size=world)
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    group = dist.group.WORLD
    assert group is not None

    def sync() -> None:
        if backend == "nccl":
            torch.cuda.synchronize()

    rows = []
    for numel in SIZES:
        x = torch.ones(numel * world, device=device)
        chunk = torch.empty(numel, device=device)
        cases: dict[str, tuple[Callable[[], object], float]] = {
            "all_reduce": (functools.partial(dist.all_reduce, x), 2 * x.nbytes * (world - 1) / world),
            "all_gather": (functools.partial(dist.all_gather_into_tensor, x, chunk), x.nbytes * (world - 1) / world),
            "reduce_scatter": (functools.partial(dist.reduce_scatter_tensor, chunk, x), x.nbytes * (world - 1) / world),
            OURS: (functools.partial(reduce_scatter_flat, x, "sum", group), x.nbytes * (world - 1) / world),
        }
        for kind, (fn, sent) in cases.items():
            seconds = _time(functools.partial(_call_and_sync, fn, sync), repeats)
            rows.append({"kind": kind, "bytes": x.nbytes, "sent": sent, "seconds": seconds})
    if rank == 0:
        out["rows"] = rows
    dist.destroy_process_group()


def fit(rows: list[dict]) -> tuple[float, float]:
    """α: the median time of the smallest collectives; β: the median of sent / (time - α) over the two
    largest sizes (a least-squares line would let the largest sizes set α)."""
    smallest, largest = min(r["bytes"] for r in rows), sorted({r["bytes"] for r in rows})[-2:]
    alpha = statistics.median(r["seconds"] for r in rows if r["bytes"] == smallest)
    beta = statistics.median(r["sent"] / max(r["seconds"] - alpha, 1e-9) for r in rows if r["bytes"] in largest)
    return alpha, beta


def main() -> None:
    from parallelisms.dtensor.cost import GLOO_LINKS, NCCL_LINKS

    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--repeats", type=int, default=200)
    a = parser.parse_args()
    out = mp.Manager().dict()
    port = 29000 + os.getpid() % 1000
    mp.spawn(_worker, args=(a.ranks, a.backend, port, a.repeats, out), nprocs=a.ranks)
    rows = out["rows"]
    alpha, beta = fit([r for r in rows if r["kind"] != OURS])
    link = (NCCL_LINKS if a.backend == "nccl" else GLOO_LINKS).intra_host
    for r in rows:
        model = link.latency_s + r["sent"] / link.bandwidth_bytes_per_s
        print(f"{r['kind']:>14} {r['bytes']:>10,} B  {r['seconds'] * 1e6:9.1f} µs  model {model * 1e6:9.1f} µs")
    summary = {
        "backend": a.backend,
        "ranks": a.ranks,
        "measured": {"latency_us": round(alpha * 1e6, 1), "bandwidth_GBps": round(beta / 1e9, 2)},
        "cost_model": {"latency_us": link.latency_s * 1e6, "bandwidth_GBps": link.bandwidth_bytes_per_s / 1e9},
        "one_element_all_reduce_us": round(rows[0]["seconds"] * 1e6, 1),
        "reduce_scatter_ms": {
            r["bytes"]: {
                k["kind"]: round(k["seconds"] * 1e3, 3)
                for k in rows
                if k["bytes"] == r["bytes"] and "scatter" in k["kind"]
            }
            for r in rows
            if r["kind"] == OURS
        },
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
