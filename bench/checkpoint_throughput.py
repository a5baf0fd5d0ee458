#!/usr/bin/env python
"""Our checkpoint's save / load GB/s on ../shared/bench/ckpt_anchor.py's workload, so the two print
comparable lines: a ~1 GiB fp32 state dict (16 x [4096, 4096]); saves are durable (fsync), loads
cold (page cache dropped with fadvise DONTNEED) and checked for exact equality.

  * one process: save, load (checksums verified, and with verify=False)
  * 2 gloo ranks, each a Shard(0) DTensor half: save, load on the same layout
  * resharding: the 2-rank checkpoint loaded into full tensors in one process

Usage: python bench/checkpoint_throughput.py [--root DIR] [--trials 3]
Run it back to back with `python ../shared/bench/ckpt_anchor.py --skip torch,st,dcphf` and compare medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import checkpoint

N_TENSORS = int(os.environ.get("CKPT_ANCHOR_NTENSORS", "16"))
ROWS, COLS = 4096, 4096


def make_state_dict(rank: int | None = None, world: int = 1) -> dict[str, torch.Tensor]:
    """The anchor's tensors (same seeds); with rank given, its Shard(0) piece."""
    sd = {}
    for i in range(N_TENSORS):
        t = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(1234 + i))
        sd[f"layers.{i}.weight"] = t.chunk(world)[rank].clone() if rank is not None else t
    return sd


def nbytes(sd: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


def evict(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def line(name: str, payload: int, save_s: list[float], load_s: list[float]) -> dict:
    gb = payload / 1e9
    r = {
        "name": name,
        "save_GBps_median": round(gb / statistics.median(save_s), 3) if save_s else None,
        "load_GBps_median": round(gb / statistics.median(load_s), 3) if load_s else None,
        "save_s": [round(x, 3) for x in save_s],
        "load_s": [round(x, 3) for x in load_s],
    }
    save, load = r["save_GBps_median"], r["load_GBps_median"]
    print(f"{name:40s} save {save!s:>6} GB/s   load(cold) {load!s:>6} GB/s", flush=True)
    return r


def bench_one_process(root: Path, trials: int) -> list[dict]:
    sd = make_state_dict()
    ws, rs, rs_fast = [], [], []
    for i in range(trials):
        path = root / f"one-{i}"
        t = time.perf_counter()
        checkpoint.save(sd, path)
        ws.append(time.perf_counter() - t)
        for verify, times in ((True, rs), (False, rs_fast)):
            evict(path)
            out = {k: torch.empty_like(v) for k, v in sd.items()}
            t = time.perf_counter()
            checkpoint.load(out, path, verify=verify)
            times.append(time.perf_counter() - t)
            assert all(torch.equal(out[k], sd[k]) for k in sd)
            del out
        shutil.rmtree(path)
    n = nbytes(sd)
    return [
        line("meshtrain 1-proc save / load (verified)", n, ws, rs),
        line("meshtrain 1-proc load, verify=False", n, [], rs_fast),
    ]


def worker(rank: int, port: int, root: Path, trials: int) -> None:
    import torch.distributed as dist

    from parallelisms.dtensor import DTensor, Shard, init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    local = make_state_dict(rank, 2)
    sd = {k: DTensor.from_local(v, mesh, [Shard(0)]) for k, v in local.items()}
    ws, rs = [], []
    for i in range(trials):
        path = root / f"two-{i}"
        dist.barrier()
        t = time.perf_counter()
        checkpoint.save(sd, path)
        dist.barrier()
        ws.append(time.perf_counter() - t)
        if rank == 0:
            evict(path)
        out = {k: DTensor.from_local(torch.empty_like(v), mesh, [Shard(0)]) for k, v in local.items()}
        dist.barrier()
        t = time.perf_counter()
        checkpoint.load(out, path)
        dist.barrier()
        rs.append(time.perf_counter() - t)
        assert all(torch.equal(out[k].to_local(), local[k]) for k in local)
    if rank == 0:
        print("RESULT " + json.dumps({"save": ws, "load": rs}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def bench_two_ranks(root: Path, trials: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen([sys.executable, __file__, "--worker", str(r), "--port", str(port), "--root", str(root),
                          "--trials", str(trials)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=1800) for p in procs]
    for p, (o, e) in zip(procs, outs):
        if p.returncode:
            raise RuntimeError(f"worker failed rc={p.returncode}\n{o}\n{e[-3000:]}")
    d = json.loads(next(x for x in outs[0][0].splitlines() if x.startswith("RESULT "))[len("RESULT ") :])
    sd = make_state_dict()
    res = [line("meshtrain 2 gloo ranks, Shard(0)", nbytes(sd), d["save"], d["load"])]
    rs = []
    for i in range(trials):
        path = root / f"two-{i}"
        evict(path)
        out = {k: torch.empty_like(v) for k, v in sd.items()}
        t = time.perf_counter()
        checkpoint.load(out, path)
        rs.append(time.perf_counter() - t)
        assert all(torch.equal(out[k], sd[k]) for k in sd)
        del out
        shutil.rmtree(path)
    res.append(line("meshtrain reshard load 2 ranks -> 1 proc", nbytes(sd), [], rs))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "meshtrain_ckpt_bench"))
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--worker", type=int, default=None)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    root = Path(a.root)
    if a.worker is not None:
        return worker(a.worker, a.port, root, a.trials)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    results = bench_one_process(root, a.trials) + bench_two_ranks(root, a.trials)
    shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    main()
