"""Context parallelism on CPU: training tokens/s and memory per rank of the debug model, one process against
CP(2) ring attention with each rotate method, over growing sequence lengths.

    python bench/context_parallel.py            # seq 2048..16384 (~7-11 min on 2 cores, idle to loaded)
    python bench/context_parallel.py --quick    # seq 1024, 2048 (~1.5 min)

Each run forks its ranks (tests/world.py: gloo, `torch.set_num_threads(1)` per rank) and times training steps
of batch 1 (forward, summed cross-entropy over the global token count, backward, gradient all-reduce, AdamW)
after one warm-up step on a 256-token sequence. The model is `Transformer(debugmodel)`, with `apply_cp` on a
1-D ("cp",) mesh for CP; gradients are summed by one flat all-reduce (no FSDP: the trainer's CP layouts
would add FSDP over dp_shard_cp, which moves parameters, not activations). Measured per rank:

- tok/s: the sequence's tokens / step wall time (max over ranks; every rank starts after a barrier). "CPU s"
  is the slowest rank's process CPU time in the step, "CPU/wall" the ranks' median CPU time over wall time:
  well under 1 means a rank waited (communication, a slower peer, or a core taken by another process).
- activations: bytes autograd saves for backward during forward (`saved_tensors_hooks`, unique storages,
  parameters and buffers left out); "attn" is the part saved inside `block.attention.core_attention`
  (SDPA, or ring attention under CP), "attn module" inside the whole `Attention` (projections, RoPE too).
- RSS peak: VmHWM after the step minus VmRSS before it (VmHWM reset through /proc/self/clear_refs), and the
  process's ru_maxrss (a high-water mark over the rank's life: sequences run in ascending order).
- comm wait: rank 0's seconds blocked in ring attention's communication over its step time, timed by wrapping
  `PendingPass.wait` (alltoall: waits on ring passes, i.e. the communication compute did not hide) and
  `all_gather_blocks` / `reduce_scatter_blocks` (allgather: blocking collectives) -- a timer, not a profiler
  trace. Waiting includes any skew between the ranks. The gradient all-reduce is reported apart.

Rounds interleave the three variants (1 process, CP(2) allgather, CP(2) alltoall) `--rounds` times; sequences
of `--long-seq` tokens or more run `--long-rounds` times (a one-core step at 16384 takes ~2 minutes). The
table shows medians over rounds and ratios to one process, then one JSON line. CP(2) runs 2 ranks x 1 thread
on 2 cores against the one process's 1 thread: its tok/s ratio is a speedup on twice the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import functools
import gc
import itertools
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.llama3 import llama3_configs
from models.llama3.model import Attention, Transformer
from models.llama3.parallelize import apply_cp
from parallelisms.context_parallel import SequenceSharding, exchange, ring_attention
from parallelisms.dtensor import DeviceMesh, init_device_mesh
from tests.world import World

VARIANTS = ("1proc", "allgather", "alltoall")  # "allgather" / "alltoall": CP(2) with that rotate method
CP = 2
WARMUP_SEQ = 256
TARGET_SEQ, TARGET_ATTN_RATIO = 8192, 0.6  # the goal: CP(2) attention activations <= 0.6x at 8192
MIB = 2**20
COLUMNS = (
    "seq", "variant", "rounds", "step s", "tok/s", "x 1proc", "CPU s/rank", "CPU/wall", "act MiB/rank", "x 1proc",
    "attn MiB/rank", "x 1proc", "attn module MiB/rank", "RSS peak MiB/rank", "ru_maxrss MiB",
    "attn comm wait (rank 0)", "grad all-reduce", "loss",
)  # fmt: skip


# ---------------------------------------------------------------- on each rank


class SavedBytes:
    """Bytes of the tensors autograd saves for backward while recording (unique storages; the model's
    parameters and buffers left out): the activations a step holds when backward starts, split by scope."""

    def __init__(self, model: nn.Module) -> None:
        tensors = itertools.chain(model.parameters(), model.buffers())
        self.excluded = {t.untyped_storage().data_ptr() for t in tensors}
        self.storages: dict[str, dict[int, int]] = {"all": {}, "attention": {}, "core_attention": {}}
        self.scopes: list[str] = []

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self.excluded:
            for scope in ("all", *self.scopes):
                self.storages[scope][ptr] = storage.nbytes()
        return t  # saved as is: recording changes no memory

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        for storages in self.storages.values():
            storages.clear()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield

    @contextlib.contextmanager
    def scope(self, name: str) -> Iterator[None]:
        self.scopes.append(name)
        try:
            yield
        finally:
            self.scopes.pop()

    def bytes(self) -> dict[str, int]:
        return {scope: sum(storages.values()) for scope, storages in self.storages.items()}


def scoped(fn: Callable[..., torch.Tensor], saved: SavedBytes, name: str) -> Callable[..., torch.Tensor]:
    """`fn` with what autograd saves inside it attributed to scope `name`."""

    def call(*args: torch.Tensor) -> torch.Tensor:
        with saved.scope(name):
            return fn(*args)

    return call


def instrument(model: Transformer, saved: SavedBytes) -> None:
    """Attribute saved tensors to each block's core attention and to its whole attention module."""
    for block in model.layers.values():
        attention = cast(Attention, block.attention)
        attention.core_attention = scoped(attention.core_attention, saved, "core_attention")
        attention.forward = scoped(attention.forward, saved, "attention")  # type: ignore[method-assign]


class CommTimer:
    """Seconds blocked in ring attention's communication, by wrapping its waits and blocking collectives."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        # ring_attention.py calls the collectives by its own imported names, and PendingPass.wait as a method
        targets = (
            (exchange.PendingPass, "wait"),
            (ring_attention, "all_gather_blocks"),
            (ring_attention, "reduce_scatter_blocks"),
        )
        originals = [(owner, name, getattr(owner, name)) for owner, name in targets]
        for owner, name, fn in originals:
            setattr(owner, name, self._timed(fn))
        try:
            yield
        finally:
            for owner, name, fn in originals:
                setattr(owner, name, fn)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))


def _release_free_heap() -> None:
    """Hand the allocator's cached free memory back to the OS (glibc), so VmRSS counts live memory only."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@functools.cache
def _cp_mesh() -> DeviceMesh:
    """The ("cp",) mesh over this world, built once per rank process (each build makes a process group)."""
    return init_device_mesh("cpu", (CP,), mesh_dim_names=("cp",))


def build_model(variant: str, seq_len: int) -> tuple[Transformer, SequenceSharding | None]:
    args = dataclasses.replace(llama3_configs["debugmodel"], max_seq_len=seq_len)
    torch.manual_seed(0)
    model = Transformer(args)
    if variant == "1proc":
        return model, None
    apply_cp(model, _cp_mesh(), rotate_method=variant)  # type: ignore[arg-type]
    return model, SequenceSharding.of(_cp_mesh())


@dataclasses.dataclass
class Step:
    """A batch-1 training step on this rank's share of one sequence."""

    model: Transformer
    optimizer: torch.optim.Optimizer | None
    sharding: SequenceSharding | None

    def batch(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(inputs, labels) of this rank, (1, seq_len / cp) each, and the global target count."""
        gen = torch.Generator().manual_seed(seq_len)
        tokens = torch.randint(0, self.model.model_args.vocab_size, (1, seq_len + 1), generator=gen)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        if self.sharding is not None:
            inputs, labels = self.sharding.shard(inputs), self.sharding.shard(labels)
        return inputs, labels, seq_len

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor, targets: int) -> torch.Tensor:
        logits = self.model(inputs)  # (1, T/cp, V)  this rank's tokens
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / targets

    def backward(self, loss: torch.Tensor) -> tuple[float, float]:
        """(the global loss, seconds in the gradient all-reduce) after backward and the optimizer step."""
        loss.backward()
        loss = loss.detach()
        start = time.perf_counter()
        if self.sharding is not None:  # each rank's loss is its own tokens' share: gradients and loss sum
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            flat = torch.cat([*(g.reshape(-1) for g in grads), loss.reshape(1)])  # one all-reduce for all
            dist.all_reduce(flat)
            for g, part in zip(grads, flat[:-1].split([g.numel() for g in grads])):
                g.copy_(part.view_as(g))
            loss = flat[-1]
        reduce_s = time.perf_counter() - start
        if self.optimizer is not None:
            self.optimizer.step()
        self.model.zero_grad(set_to_none=True)
        return loss.item(), reduce_s


def bench_rank(variant: str, seq_len: int, steps: int, optimizer: bool) -> dict[str, Any]:
    """One run on this rank: a warm-up step at WARMUP_SEQ tokens, then `steps` timed steps at `seq_len`."""
    model, sharding = build_model(variant, seq_len)
    saved = SavedBytes(model)
    instrument(model, saved)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, weight_decay=0.1) if optimizer else None
    step, comm = Step(model, opt, sharding), CommTimer()
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "step_s": [], "cpu_s": [], "comm_s": []}
    out |= {"reduce_s": [], "loss": [], "rss_peak_kib": []}
    with comm.installed():
        out["warmup_loss"], _ = step.backward(step.forward(*step.batch(WARMUP_SEQ)))
        for _ in range(steps):
            batch = step.batch(seq_len)
            if sharding is not None:
                dist.barrier()  # every rank starts the step together: the step time is the slowest rank's
            _release_free_heap()
            reset, rss_kib, comm.seconds = _reset_peak_rss(), _status_kib("VmRSS"), 0.0
            start, cpu_start = time.perf_counter(), time.process_time()
            with saved.recording():
                loss = step.forward(*batch)
            loss_value, reduce_s = step.backward(loss)
            out["step_s"].append(time.perf_counter() - start)
            out["cpu_s"].append(time.process_time() - cpu_start)
            out["comm_s"].append(comm.seconds)
            out["reduce_s"].append(reduce_s)
            out["loss"].append(loss_value)
            out["rss_peak_kib"].append(_status_kib("VmHWM") - rss_kib if reset else None)
    out["saved"] = saved.bytes()
    out["ru_maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return out


# ---------------------------------------------------------------- in the driver


def summarize(ranks: list[dict[str, Any]], seq_len: int) -> dict[str, Any]:
    """One run's figures: times are medians over its steps (a step lasting as long as its slowest rank),
    memory the largest rank's."""
    r0 = ranks[0]
    steps = range(len(r0["step_s"]))
    step_s = statistics.median(max(r["step_s"][i] for r in ranks) for i in steps)
    rss = [statistics.median(r["rss_peak_kib"]) for r in ranks if None not in r["rss_peak_kib"]]
    return {
        "tok_s": seq_len / step_s,
        "step_s": step_s,
        "cpu_s": statistics.median(max(r["cpu_s"][i] for r in ranks) for i in steps),
        "cpu_per_wall": statistics.median(r["cpu_s"][i] / r["step_s"][i] for r in ranks for i in steps),
        "comm_share": statistics.median(c / s for c, s in zip(r0["comm_s"], r0["step_s"])),
        "reduce_share": statistics.median(c / s for c, s in zip(r0["reduce_s"], r0["step_s"])),
        "act_mib": max(r["saved"]["all"] for r in ranks) / MIB,
        "attn_mib": max(r["saved"]["core_attention"] for r in ranks) / MIB,
        "attn_module_mib": max(r["saved"]["attention"] for r in ranks) / MIB,
        "rss_peak_mib": max(rss) / 1024 if rss else None,
        "ru_maxrss_mib": max(r["ru_maxrss_kib"] for r in ranks) / 1024,
        "loss": r0["loss"][0],
        "warmup_loss": r0["warmup_loss"],
        "threads": r0["threads"],
    }


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds; ru_maxrss the smallest (a high-water mark: the first round's is this run's)."""
    agg: dict[str, Any] = {"rounds": len(runs)}
    for key, first in runs[0].items():
        values = [run[key] for run in runs]
        if first is None:
            agg[key] = None
        elif key == "ru_maxrss_mib":
            agg[key] = min(values)
        else:
            agg[key] = statistics.median(values)
    return agg


def rounds_of(seq_len: int, a: argparse.Namespace) -> int:
    return a.long_rounds if seq_len >= a.long_seq else a.rounds


def measure(a: argparse.Namespace, seq_lens: list[int]) -> dict[int, dict[str, dict[str, Any]]]:
    """Every (sequence length, variant), the variants interleaved within each round."""
    worlds = {1: World(1, timeout=3600), CP: World(CP, timeout=3600)}
    results: dict[int, dict[str, dict[str, Any]]] = {}
    start = time.perf_counter()
    try:
        for seq_len in seq_lens:
            runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
            for round_ in range(rounds_of(seq_len, a)):
                for variant in VARIANTS:
                    world = worlds[1 if variant == "1proc" else CP]
                    ranks = world.run(bench_rank, variant, seq_len, a.steps, not a.no_optimizer)
                    runs[variant].append(summarize(ranks, seq_len))
                    print(f"[{time.perf_counter() - start:6.0f}s] seq {seq_len} round {round_} {variant}: "
                          f"{runs[variant][-1]['tok_s']:,.0f} tok/s", file=sys.stderr, flush=True)  # fmt: skip
            results[seq_len] = {v: aggregate(r) for v, r in runs.items()}
    finally:
        for world in worlds.values():
            world.close()
    return results


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def print_table(results: dict[int, dict[str, dict[str, Any]]], a: argparse.Namespace) -> None:
    threads = {v: r[v]["threads"] for r in results.values() for v in VARIANTS}
    print(f"\n### Context parallelism, debug model, batch 1, CPU ({os.cpu_count()} cores), "
          f"threads per rank: 1proc {threads['1proc']}, CP(2) {threads['allgather']} x 2 ranks")  # fmt: skip
    print(
        f"step = forward + CE loss + backward + flat grad all-reduce (CP; no FSDP)"
        f"{'' if a.no_optimizer else ' + AdamW'}; {a.steps} timed step(s) per run; medians over rounds; comm wait "
        "timed around PendingPass.wait / all_gather_blocks / reduce_scatter_blocks (no profiler)\n"
    )
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for seq_len, by_variant in results.items():
        base = by_variant["1proc"]
        for variant, r in by_variant.items():
            name = "1 process (SDPA)" if variant == "1proc" else f"CP(2) {variant}"
            cells = [
                str(seq_len), name, str(r["rounds"]), f"{r['step_s']:.2f}", f"{r['tok_s']:,.0f}",
                f"{r['tok_s'] / base['tok_s']:.2f}x", f"{r['cpu_s']:.2f}", f"{r['cpu_per_wall']:.2f}",
                f"{r['act_mib']:.1f}", f"{r['act_mib'] / base['act_mib']:.2f}x", f"{r['attn_mib']:.1f}",
                f"{r['attn_mib'] / base['attn_mib']:.2f}x", f"{r['attn_module_mib']:.1f}",
                _fmt(r["rss_peak_mib"], ".0f"), f"{r['ru_maxrss_mib']:.0f}",
                "-" if variant == "1proc" else f"{r['comm_share']:.1%}",
                "-" if variant == "1proc" else f"{r['reduce_share']:.1%}", f"{r['loss']:.4f}",
            ]  # fmt: skip
            print("| " + " | ".join(cells) + " |")


def checks(results: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The issue's attention-memory target, and whether every variant computed the same warm-up loss."""
    out: dict[str, Any] = {}
    if TARGET_SEQ in results:
        r = results[TARGET_SEQ]
        ratios = {v: r[v]["attn_mib"] / r["1proc"]["attn_mib"] for v in VARIANTS[1:]}
        out["attn_ratio_at_8192"] = ratios
        out["attn_target_met"] = all(x <= TARGET_ATTN_RATIO for x in ratios.values())
    losses = [r[v]["warmup_loss"] for r in results.values() for v in VARIANTS]
    out["warmup_loss_spread"] = max(losses) - min(losses)  # same seed, same 256 tokens: should be ~1e-6
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default="2048,4096,8192,16384", help="comma-separated sequence lengths")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (1proc, allgather, alltoall)")
    ap.add_argument("--long-seq", type=int, default=8192, help="sequences this long or longer run --long-rounds")
    ap.add_argument("--long-rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1, help="timed steps per run (after a 256-token warm-up)")
    ap.add_argument("--no-optimizer", action="store_true", help="leave the AdamW step out")
    ap.add_argument("--quick", action="store_true", help="seq 1024,2048, 2 steps per run (~1 min)")
    a = ap.parse_args()
    if a.quick:
        a.seq_lens, a.steps = "1024,2048", 2
    seq_lens = [int(s) for s in a.seq_lens.split(",")]
    bad = [s for s in seq_lens if s % (2 * CP) or s < WARMUP_SEQ]
    if bad:
        raise SystemExit(f"--seq-lens {bad}: each must be >= {WARMUP_SEQ} and divide by 2 x cp = {2 * CP}")
    load_before = os.getloadavg()
    results = measure(a, seq_lens)
    print_table(results, a)
    check = checks(results)
    if "attn_ratio_at_8192" in check:
        ratios = ", ".join(f"{v} {x:.2f}x" for v, x in check["attn_ratio_at_8192"].items())
        verdict = "met" if check["attn_target_met"] else "NOT met"
        print(f"\ntarget: CP(2) attention activations per rank <= {TARGET_ATTN_RATIO}x one process's at seq "
              f"{TARGET_SEQ}: {ratios} -> {verdict}")  # fmt: skip
    print(
        f"warm-up loss spread over all runs: {check['warmup_loss_spread']:.2e}; load average (1 min) "
        f"{load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after"
    )
    config = {"steps": a.steps, "optimizer": not a.no_optimizer, "cpu_count": os.cpu_count(), "cp": CP}
    print(json.dumps({"config": config, "results": results, "checks": check}))


if __name__ == "__main__":
    main()
