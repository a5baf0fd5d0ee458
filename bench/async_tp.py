"""Async TP against synchronous TP on TP(2): the communication each step leaves exposed, from a profile.

Two gloo ranks (one thread each, as trainer_throughput.py's tp2) train the debug Llama (fp32, seq 512, batch 4 by
default), forward and backward, with and without `async_tp`, in interleaved rounds. The profile times the main
thread inside torch.distributed: issuing a collective or pass, and waiting for one (`Work.wait`), outermost calls
only. That is the communication the step waits for; what the backend moves while the main thread computes is
hidden. Prints per-mode medians (step seconds, exposed communication seconds per step, its share of the step,
the mean per call), and async's exposed time as a fraction of sync's, as one JSON line.

    python bench/async_tp.py --rounds 3 --steps 6
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

_COLLECTIVES = (
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_reduce",
    "batch_isend_irecv",
    "all_gather",
    "broadcast",
)  # fmt: skip (not isend/irecv: P2POp checks them by identity)


class CommProfile:
    """Seconds the main thread spends inside communication calls (issue and wait), outermost calls only."""

    def __init__(self) -> None:
        self.seconds, self.depth = 0.0, 0
        self.by_call: dict[str, float] = {}

    def timed(self, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    spent = time.perf_counter() - start
                    self.seconds += spent
                    self.by_call[fn.__name__] = self.by_call.get(fn.__name__, 0.0) + spent

        return wrapper

    def install(self) -> None:
        for name in _COLLECTIVES:
            setattr(dist, name, self.timed(getattr(dist, name)))
        work = torch._C._distributed_c10d.Work
        work.wait = self.timed(work.wait)


def rank_main(rank: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from models.llama3 import Transformer
    from models.llama3.args import llama3_configs
    from models.llama3.parallelize import parallelize_llama
    from parallelisms.parallel_dims import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, world_size=2)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    base = Transformer(llama3_configs["debugmodel"])
    vocab = base.model_args.vocab_size
    tokens, labels = torch.randint(0, vocab, (2, args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    profile = CommProfile()
    profile.install()
    rows: dict[str, list[tuple[float, float]]] = {"sync": [], "async": []}
    calls: dict[str, dict[str, float]] = {"sync": {}, "async": {}}
    for _ in range(args.rounds):
        for mode in ("sync", "async"):
            model = parallelize_llama(copy.deepcopy(base), dims, mesh, loss_parallel=False, async_tp=mode == "async")
            for step in range(args.warmup + args.steps):
                dist.barrier()
                profile.seconds, start = 0.0, time.perf_counter()
                F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(0, 1)).backward()
                if step >= args.warmup:
                    rows[mode].append((time.perf_counter() - start, profile.seconds))
                    for name, spent in profile.by_call.items():
                        calls[mode][name] = calls[mode].get(name, 0.0) + spent / args.steps / args.rounds
                profile.by_call.clear()
            del model
    if rank == 0:
        out.put((rows, calls))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=rank_main, args=(rank, port, args, out)) for rank in range(2)]
    for p in procs:
        p.start()
    got = None
    while got is None:  # a rank that dies fails the run instead of leaving it waiting
        try:
            got = out.get(timeout=5)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}") from None
    for p in procs:
        p.join(timeout=60)
    rows, calls = got
    result: dict[str, Any] = {}
    for mode, samples in rows.items():
        step, comm = statistics.median(s for s, _ in samples), statistics.median(c for _, c in samples)
        result[mode] = {
            "step_s": round(step, 4),
            "exposed_comm_s": round(comm, 4),
            "exposed_share": round(comm / step, 3),
            "by_call_s": {name: round(spent, 4) for name, spent in sorted(calls[mode].items())},
        }
    result["async_exposed_over_sync"] = round(result["async"]["exposed_comm_s"] / result["sync"]["exposed_comm_s"], 3)
    result["async_step_over_sync"] = round(result["async"]["step_s"] / result["sync"]["step_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
