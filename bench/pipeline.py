"""Pipeline parallelism on CPU: the measured bubble of each schedule against theory, and our runtime's step time
against torch.distributed.pipelining on the same stages, schedule and microbatches.

    python bench/pipeline.py            # bubble at pp 2 and 4, every schedule vs torch at pp 2 (~6 min on 2 cores)
    python bench/pipeline.py --quick    # 1 bubble round, GPipe / 1F1B / Interleaved1F1B vs torch (~1.5 min)

The model is `Transformer(debugmodel)` (max_seq_len = --seq), split into `pp x stages per rank` parts by the
trainer's rule (`module_fqns_per_stage`, torchtitan's: the embedding and the output count one layer each; 1 stage
per rank for GPipe and 1F1B, 2 for the others, looped or V placement as the schedule says). A step is 8 microbatches
of (--mb, --seq) random tokens, the summed cross-entropy of each microbatch, no optimizer. Ranks are forked once
per pp (tests/world.py: gloo, `torch.set_num_threads(1)` per rank); every run builds its stages from seed 0, runs
one warm-up step, then times --steps steps, each after a barrier; a step lasts as long as its slowest rank.

- Bubble: our runtime's F / B / I / W actions are timed by patching `PipelineSchedule._forward`, `_backward` and
  `_weight_backward` in the rank processes (the receive waits inside them, `PendingRecv.wait`, left out); runs
  repeat `--rounds` times, the schedules interleaved in each round.
  measured = 1 - sum over ranks of the compute seconds / (pp x step wall): the idle share of all ranks' time, as
  `SimulationResult.bubble_fraction` defines it. Theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1) for
  Interleaved1F1B (Megatron-LM, v stages per rank), and for every schedule the simulator's bubble on the lowered
  schedule with the measured mean seconds of each action kind (one cost per kind: the simulator cannot see that
  stages differ, which the imbalance columns show: the slowest stage's, and the busiest rank's, compute seconds over
  the mean's; with imbalance b a single-stage schedule's bubble is about 1 - (1 - theory) / b).
  pp 4 runs 4 ranks on the 2 cores here: ranks share cores while more than 2 compute, so actions stretch ("CPU/wall"
  in actions, thread CPU over wall, shows by how much) and fill and drain run faster than steady state; its
  measured bubble is not the bubble of 4 dedicated cores.
- Step time: the same debug-model parts (plain tensors, no DTensor) run by our `PipelineSchedule` and by torch's
  schedule class of the same name (`scale_grads=False`, `return_outputs=False`) at pp 2; first both run one step
  from the same weights and their gradients and losses must agree (rtol = atol = 1e-5), so the two time identical
  work. Runs interleave ours and torch's (which goes first alternates by round) `--compare-rounds` times; the table
  shows medians over rounds and ours / torch (the goal: <= 1.0x), then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage as TorchStage
from torch.distributed.pipelining import schedules as torch_schedules

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.common.pipeline_split import module_fqns_per_stage, split_model
from models.llama3 import llama3_configs
from models.llama3.model import Transformer
from parallelisms.pipeline_parallel import (
    SCHEDULES,
    Costs,
    ScheduleSpec,
    get_schedule,
    lower_schedule,
    rank_to_stages,
    simulate,
    stage_to_rank,
)
from parallelisms.pipeline_parallel.interpreter import PipelineSchedule
from parallelisms.pipeline_parallel.p2p import PendingRecv
from parallelisms.pipeline_parallel.stage import BoundaryMeta, PipelineStage
from tests.pipeline_parallel.torch_oracle import TORCH_CLASSES
from tests.world import World

MICROBATCHES = 8
PP_DEGREES = (2, 4)
COMPARE_PP = 2
QUICK_COMPARED = ("GPipe", "1F1B", "Interleaved1F1B")
GRAD_TOL = 1e-5
KINDS = ("F", "B", "I", "W")


# ---------------------------------------------------------------- on each rank


@dataclasses.dataclass(frozen=True)
class Shape:
    """One microbatch: (mb, seq) tokens."""

    mb: int
    seq: int


def stages_per_rank(spec: ScheduleSpec) -> int:
    return 1 if spec.single_stage else 2


def build_parts(spec: ScheduleSpec, shape: Shape) -> dict[int, Transformer]:
    """This rank's parts of the debug model (seed 0), keyed by stage, split as the trainer splits."""
    pp, rank, per_rank = dist.get_world_size(), dist.get_rank(), stages_per_rank(spec)
    args = dataclasses.replace(llama3_configs["debugmodel"], max_seq_len=shape.seq)
    torch.manual_seed(0)
    whole = Transformer(args)
    fqns = module_fqns_per_stage(pp * per_rank, args.n_layers)
    return {s: split_model(whole, fqns[s]) for s in rank_to_stages(pp, per_rank, spec.placement)[rank]}


def batch(shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of one step, (MICROBATCHES * mb, seq) each, the same on every rank."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, llama3_configs["debugmodel"].vocab_size, (MICROBATCHES * shape.mb, shape.seq + 1),
                           generator=gen)  # fmt: skip
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one microbatch, (mb, seq, V) logits; the same scale under both runtimes."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")


def build_ours(spec: ScheduleSpec, parts: dict[int, Transformer], shape: Shape) -> PipelineSchedule:
    pp, rank, per_rank = dist.get_world_size(), dist.get_rank(), stages_per_rank(spec)
    num_stages = pp * per_rank
    mapping = stage_to_rank(pp, per_rank, spec.placement)
    meta = BoundaryMeta((shape.mb, shape.seq, llama3_configs["debugmodel"].dim), torch.float32)  # (mb, T, D)
    stages = [
        PipelineStage(part, s, num_stages, dist.group.WORLD, mapping, torch.device("cpu"),  # type: ignore[arg-type]
                      input_meta=None if s == 0 else meta, output_meta=None if s == num_stages - 1 else meta)
        for s, part in parts.items()
    ]  # fmt: skip
    lowered = lower_schedule(spec.generate(pp, per_rank, MICROBATCHES), mapping, MICROBATCHES)[rank]
    return PipelineSchedule(stages, [a for a in lowered if a is not None], token_loss)


def build_torch(spec: ScheduleSpec, parts: dict[int, Transformer]) -> torch_schedules._PipelineSchedule:
    num_stages = dist.get_world_size() * stages_per_rank(spec)
    stages = [TorchStage(part, s, num_stages, torch.device("cpu"), group=dist.group.WORLD) for s, part in parts.items()]
    cls = TORCH_CLASSES[spec.name]
    return cls(stages[0] if spec.single_stage else stages, MICROBATCHES, loss_fn=token_loss, scale_grads=False)  # type: ignore[call-arg, arg-type]


def build_step(impl: str, spec: ScheduleSpec, parts: dict[int, Transformer], shape: Shape) -> Callable[[], list]:
    """One training step of `impl` ("ours" / "torch") on these parts; returns the last stage's microbatch losses."""
    inputs, labels = batch(shape)
    first, last = 0 in parts, dist.get_world_size() * stages_per_rank(spec) - 1 in parts
    if impl == "ours":
        runner = build_ours(spec, parts, shape)

        def ours_step() -> list:  # splits the batch inside the step, as torch's does
            microbatches = list(inputs.chunk(MICROBATCHES)) if first else None
            return runner.step(microbatches, list(labels.chunk(MICROBATCHES)) if last else None).losses

        return ours_step
    schedule = build_torch(spec, parts)

    def torch_step() -> list:
        losses: list = []
        schedule.step(*((inputs,) if first else ()), target=labels if last else None, losses=losses if last else None,
                      return_outputs=False)  # fmt: skip
        return losses

    return torch_step


class ActionTimer:
    """Wall and thread-CPU seconds of each F / B / I / W our runtime runs, the receive waits inside them (an F or
    B waits for its input there) left out, by patching `PipelineSchedule`'s compute methods while installed."""

    def __init__(self) -> None:
        self.records: list[tuple[int, str, float, float]] = []  # (stage, kind, wall s, thread CPU s)
        self.waited = 0.0  # wall s in receive waits so far

    def _compute(self, fn: Callable[..., Any], kind_of: Callable[[dict[str, Any]], str]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(runner: PipelineSchedule, stage: PipelineStage, *args: Any, **kwargs: Any) -> Any:
            waited, start, cpu = self.waited, time.perf_counter(), time.thread_time()
            result = fn(runner, stage, *args, **kwargs)
            wall = time.perf_counter() - start - (self.waited - waited)
            self.records.append((stage.stage_index, kind_of(kwargs), wall, time.thread_time() - cpu))
            return result

        return timed

    def _wait(self, fn: Callable[[PendingRecv], torch.Tensor]) -> Callable[[PendingRecv], torch.Tensor]:
        @functools.wraps(fn)
        def timed(pending: PendingRecv) -> torch.Tensor:
            start = time.perf_counter()
            try:
                return fn(pending)
            finally:
                self.waited += time.perf_counter() - start

        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        patches = {
            (PipelineSchedule, "_forward"): self._compute(PipelineSchedule._forward, lambda kw: "F"),
            (PipelineSchedule, "_backward"): self._compute(
                PipelineSchedule._backward, lambda kw: "B" if kw["weights"] else "I"
            ),
            (PipelineSchedule, "_weight_backward"): self._compute(PipelineSchedule._weight_backward, lambda kw: "W"),
            (PendingRecv, "wait"): self._wait(PendingRecv.wait),
        }
        originals = {target: getattr(*target) for target in patches}
        for (owner, name), fn in patches.items():
            setattr(owner, name, fn)
        try:
            yield
        finally:
            for (owner, name), fn in originals.items():
                setattr(owner, name, fn)


def bench_rank(name: str, impl: str, shape: Shape, steps: int, timed_actions: bool) -> dict[str, Any]:
    """`steps` timed steps of schedule `name` under `impl` after one warm-up step; with `timed_actions` (ours
    only) the F / B / I / W records of each step."""
    spec = get_schedule(name)
    parts = build_parts(spec, shape)
    step, timer = build_step(impl, spec, parts, shape), ActionTimer()
    out: dict[str, Any] = {"step_s": [], "actions": [], "threads": torch.get_num_threads()}
    with timer.installed() if timed_actions else contextlib.nullcontext():
        step()
        for _ in range(steps):
            for part in parts.values():
                part.zero_grad(set_to_none=True)
            dist.barrier()  # every rank starts together: the step lasts as long as the slowest rank
            timer.records.clear()
            start = time.perf_counter()
            step()
            out["step_s"].append(time.perf_counter() - start)
            out["actions"].append(list(timer.records))
    return out


def compare_grads(name: str, shape: Shape) -> float:
    """One step of ours and one of torch's from the same weights: the largest gradient difference on this rank
    (raises when a gradient or the losses differ beyond GRAD_TOL)."""
    spec = get_schedule(name)
    ours = build_parts(spec, shape)
    theirs = copy.deepcopy(ours)
    losses = build_step("ours", spec, ours, shape)(), build_step("torch", spec, theirs, shape)()
    if losses[0]:
        torch.testing.assert_close(torch.stack(losses[0]), torch.stack(losses[1]), rtol=GRAD_TOL, atol=GRAD_TOL)
    worst = 0.0
    for s, part in ours.items():
        for (key, p), q in zip(part.named_parameters(), theirs[s].parameters()):
            assert p.grad is not None and q.grad is not None, f"{name} stage {s} {key}: no gradient"
            torch.testing.assert_close(p.grad, q.grad, rtol=GRAD_TOL, atol=GRAD_TOL, msg=f"{name} stage {s} {key}")
            worst = max(worst, (p.grad - q.grad).abs().max().item())
    return worst


# ---------------------------------------------------------------- in the driver


def step_time(ranks: list[dict[str, Any]]) -> float:
    """The median over steps of the slowest rank's step."""
    return statistics.median(max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"])))


def bubble_figures(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's measured bubble (median over steps), mean seconds per action kind, imbalances, CPU/wall."""
    steps, pp = range(len(ranks[0]["step_s"])), len(ranks)
    records = [rec for r in ranks for step in r["actions"] for rec in step]
    bubbles = [
        1 - sum(rec[2] for r in ranks for rec in r["actions"][i]) / (pp * max(r["step_s"][i] for r in ranks))
        for i in steps
    ]
    by_kind = {k: [rec[2] for rec in records if rec[1] == k] for k in KINDS}
    costs = {k: statistics.mean(walls) for k, walls in by_kind.items() if walls}
    per_stage: dict[int, float] = {}
    for stage, _, wall, _ in records:
        per_stage[stage] = per_stage.get(stage, 0.0) + wall
    per_rank = [sum(rec[2] for step in r["actions"] for rec in step) for r in ranks]
    return {
        "step_s": step_time(ranks),
        "bubble": statistics.median(bubbles),
        "costs_s": costs,
        "stage_imbalance": max(per_stage.values()) / statistics.mean(per_stage.values()),
        "rank_imbalance": max(per_rank) / statistics.mean(per_rank),
        "cpu_per_wall": sum(rec[3] for rec in records) / sum(rec[2] for rec in records),
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds, per action kind for the costs."""
    out: dict[str, Any] = {key: statistics.median(run[key] for run in runs) for key in runs[0] if key != "costs_s"}
    out["costs_s"] = {k: statistics.median(run["costs_s"][k] for run in runs) for k in runs[0]["costs_s"]}
    return out | {"rounds": len(runs)}


def theory(spec: ScheduleSpec, pp: int, costs_s: dict[str, float]) -> dict[str, float | None]:
    """The closed form where one exists, and the simulator's bubble with the measured costs (transfers free)."""
    per_rank, m = stages_per_rank(spec), MICROBATCHES
    closed = {"GPipe": (pp - 1) / (m + pp - 1), "1F1B": (pp - 1) / (m + pp - 1),
              "Interleaved1F1B": (pp - 1) / (per_rank * m + pp - 1)}  # fmt: skip
    costs = Costs(forward=costs_s["F"], backward=costs_s.get("B", 0.0), backward_input=costs_s.get("I", 0.0),
                  backward_weight=costs_s.get("W", 0.0))  # fmt: skip
    mapping = stage_to_rank(pp, per_rank, spec.placement)
    lowered = lower_schedule(spec.generate(pp, per_rank, m), mapping, m)
    simulated = simulate(lowered, costs, stage_to_rank=mapping).bubble_fraction
    return {"closed_form": closed.get(spec.name), "simulated": simulated}


def log(start: float, message: str) -> None:
    print(f"[{time.perf_counter() - start:6.0f}s] {message}", file=sys.stderr, flush=True)


def measure_bubbles(world: World, names: list[str], a: argparse.Namespace, start: float) -> dict[str, dict[str, Any]]:
    """Every schedule on this world's pp, the schedules interleaved within each round."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for round_ in range(a.rounds):
        for name in names:
            ranks = world.run(bench_rank, name, "ours", a.shape, a.steps, True)
            runs[name].append(bubble_figures(ranks) | {"threads": ranks[0]["threads"]})
            log(start, f"pp {world.world_size} round {round_} {name}: bubble {runs[name][-1]['bubble']:.3f}")
    out = {}
    for name, r in runs.items():
        agg = median_of(r)
        out[name] = agg | theory(get_schedule(name), world.world_size, agg["costs_s"])
    return out


def measure_step_times(world: World, names: list[str], a: argparse.Namespace, start: float) -> dict[str, dict]:
    """Ours against torch's per schedule, after the gradient check; the two interleaved in every round."""
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        out[name] = {"max_grad_diff": max(world.run(compare_grads, name, a.shape)), "ours": [], "torch": []}
        log(start, f"{name}: gradients equal ours vs torch (max diff {out[name]['max_grad_diff']:.1e})")
    for round_ in range(a.compare_rounds):
        for name in names:
            for impl in ("ours", "torch")[:: 1 if round_ % 2 == 0 else -1]:
                out[name][impl].append(step_time(world.run(bench_rank, name, impl, a.shape, a.steps, False)))
            log(start, f"round {round_} {name}: ours {out[name]['ours'][-1]:.3f}s torch {out[name]['torch'][-1]:.3f}s")
    for r in out.values():
        paired = [o / t for o, t in zip(r["ours"], r["torch"])]
        r |= {"ours_s": statistics.median(r["ours"]), "torch_s": statistics.median(r["torch"])}
        r |= {"ratio": r["ours_s"] / r["torch_s"], "paired_min": min(paired), "paired_max": max(paired)}
    return out


def valid_schedules(pp: int) -> list[str]:
    """The schedules that can lay out MICROBATCHES microbatches at this pp (all of them, here)."""
    names = []
    for name, spec in SCHEDULES.items():
        with contextlib.suppress(ValueError):
            spec.generate(pp, stages_per_rank(spec), MICROBATCHES)
            names.append(name)
    return names


def threads_of(bubbles: dict[int, dict[str, dict[str, Any]]]) -> str:
    """The torch threads of the ranks, e.g. "1"."""
    return ",".join(str(t) for t in sorted({r["threads"] for by_name in bubbles.values() for r in by_name.values()}))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def print_bubbles(bubbles: dict[int, dict[str, dict[str, Any]]], a: argparse.Namespace) -> None:
    cores = os.cpu_count() or 1
    print(f"\n### Pipeline bubble, debug model, {MICROBATCHES} microbatches of ({a.shape.mb}, {a.shape.seq}) tokens, "
          f"CPU ({cores} cores), {threads_of(bubbles)} thread(s) per rank; {a.steps} timed step(s) per run, medians "
          "over rounds")  # fmt: skip
    for pp in bubbles:
        if pp > cores:
            print(f"pp {pp}: {pp} ranks on {cores} cores (oversubscribed): actions stretch while more than {cores} "
                  f"ranks compute; the measured bubble is not that of {pp} dedicated cores")  # fmt: skip
    columns = ("pp", "schedule", "stages/rank", "rounds", "step s", "measured bubble", "theory (closed form)",
               "simulated (measured costs)", "measured - simulated", "F / B / I / W ms", "stage imbalance",
               "rank imbalance", "CPU/wall")  # fmt: skip
    print("\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for pp, by_name in bubbles.items():
        for name, r in by_name.items():
            costs = " / ".join(f"{r['costs_s'][k] * 1e3:.1f}" if k in r["costs_s"] else "-" for k in KINDS)
            cells = (str(pp), name, str(stages_per_rank(get_schedule(name))), str(r["rounds"]), f"{r['step_s']:.3f}",
                     _pct(r["bubble"]), _pct(r["closed_form"]), _pct(r["simulated"]),
                     f"{(r['bubble'] - r['simulated']) * 100:+.1f} pt", costs, f"{r['stage_imbalance']:.2f}",
                     f"{r['rank_imbalance']:.2f}", f"{r['cpu_per_wall']:.2f}")  # fmt: skip
            print("| " + " | ".join(cells) + " |")


def print_step_times(times: dict[str, dict[str, Any]], a: argparse.Namespace) -> None:
    print(f"\n### Step time, ours vs torch.distributed.pipelining, pp {COMPARE_PP}, same debug-model stages, "
          f"{MICROBATCHES} microbatches; {a.steps} timed step(s) per run, medians over {a.compare_rounds} interleaved "
          f"round(s); gradients checked equal first (rtol = atol = {GRAD_TOL})")  # fmt: skip
    columns = ("schedule", "ours s", "torch s", "ours / torch", "paired ratios (min..max)", "max grad diff")
    print("\n| " + " | ".join(columns) + " |\n|" + "---|" * len(columns))
    for name, r in times.items():
        cells = (name, f"{r['ours_s']:.3f}", f"{r['torch_s']:.3f}", f"{r['ratio']:.3f}x",
                 f"{r['paired_min']:.3f}..{r['paired_max']:.3f}", f"{r['max_grad_diff']:.1e}")  # fmt: skip
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1, help="sequences per microbatch")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    ap.add_argument("--rounds", type=int, default=3, help="bubble rounds over the schedules")
    ap.add_argument("--compare-rounds", type=int, default=5, help="rounds of (ours, torch) over the schedules")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--quick", action="store_true", help="1 bubble round; GPipe, 1F1B, Interleaved1F1B vs torch")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.compare_rounds = 1, 2
    a.shape = Shape(a.mb, a.seq)
    compared = list(QUICK_COMPARED) if a.quick else valid_schedules(COMPARE_PP)
    load_before, start = os.getloadavg(), time.perf_counter()
    bubbles, times = {}, {}
    for pp in PP_DEGREES:
        world = World(pp, timeout=3600)
        try:
            bubbles[pp] = measure_bubbles(world, valid_schedules(pp), a, start)
            if pp == COMPARE_PP:
                times = measure_step_times(world, compared, a, start)
        finally:
            world.close()
    print_bubbles(bubbles, a)
    print_step_times(times, a)
    met = all(r["ratio"] <= 1.0 for r in times.values())
    ratios = ", ".join(f"{name} {r['ratio']:.3f}x" for name, r in times.items())
    print(f"\ntarget: ours <= 1.0x torch's step time: {ratios} -> {'met' if met else 'NOT met'}")
    print(f"load average (1 min) {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after; "
          f"{time.perf_counter() - start:.0f}s in all")  # fmt: skip
    config = {"microbatches": MICROBATCHES, "mb": a.mb, "seq": a.seq, "rounds": a.rounds,
              "compare_rounds": a.compare_rounds, "steps": a.steps, "cpu_count": os.cpu_count(),
              "threads_per_rank": threads_of(bubbles)}  # fmt: skip
    for r in times.values():
        del r["ours"], r["torch"]
    print(json.dumps({"config": config, "bubble": bubbles, "step_time": times, "checks": {"target_met": met}}))


if __name__ == "__main__":
    main()
