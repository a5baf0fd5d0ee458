"""The dry run: `python -m trainer.estimate --job.config_file F [--section.key value ...] --world_size N
--device {a100,h100,h200,b200,cpu} [--search] [--json]` (also `./run_train.sh --estimate`).

In one CPU process, with no GPU: a fake process group of N ranks; rank 0 builds the model on meta with
the trainer's own recipe under the config's degrees and runs one training step on fake tensors
(trainer.estimate_step). Without PP every rank has the same role, so rank 0 represents them all; under
PP the first and the last stage are traced, each on its first rank, and the step is the slower's. It
reports memory per rank by category and its peak (trainer.estimate_memory), the collectives by kind and
mesh dim, the FLOPs, and a step time, tok/s per device and MFU (trainer.estimate_time on the tables of
trainer.devices). `--json` prints DESIGN.md §7's object; `--search` ranks layouts (trainer.estimate_search).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from models.llama3.parallelize import compile_supported
from parallelisms.dtensor.cost import CostModel, use_cost_model
from parallelisms.parallel_dims import ParallelDims

from .config import load_config
from .devices import GIB, Device, gpus_per_node, lookup_device
from .estimate_step import StepTrace, trace_step_sampled
from .estimate_time import StepTime, collective_seconds, pipeline_stretch, price_step
from .job_config import JobConfig
from .pipeline_schedule import schedule_spec, stages_per_rank
from .preflight import check_config
from .runtime import build_runtime, resolve_precision
from .train import build_parallel_dims

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Role:
    """Ranks that hold the same shards and run the same step: all of them without PP; under PP the first
    and the last stage (the embedding's and the output's), each traced on its first rank."""

    name: str
    ranks: tuple[int, int]  # [first, last] global rank of the role (pp is the outermost mesh dim)
    trace: StepTrace
    time: StepTime


@dataclass(frozen=True)
class Estimate:
    """One layout's prediction: each role's memory and traffic; the step is the slowest role's."""

    world_size: int
    device: Device
    dims: ParallelDims
    roles: tuple[Role, ...]
    ac_mode: str
    local_batch_size: int

    @property
    def critical(self) -> Role:
        return max(self.roles, key=lambda r: r.time.step_s)

    @property
    def trace(self) -> StepTrace:
        """The slowest role's trace (the one whole role without PP)."""
        return self.critical.trace

    @property
    def time(self) -> StepTime:
        return self.critical.time

    @property
    def peak_bytes(self) -> int:
        """The highest peak of any role: what must fit on every device."""
        return max(r.trace.memory.peak for r in self.roles)

    @property
    def steady_bytes(self) -> int:
        return max(sum(r.trace.memory.steady.values()) for r in self.roles)

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.trace.local_tokens / self.time.step_s / self.dims.non_data_parallel_size

    @property
    def mfu(self) -> float:
        return self.tokens_per_s_per_device * self.trace.flops_per_token / (self.device.peak_tflops * 1e12)

    def as_json(self) -> dict[str, Any]:
        """DESIGN.md §7's object (extra keys beside the contract's: detail, never in place of it)."""
        d = self.dims
        model_flops = self.trace.flops_per_token * self.trace.local_tokens / d.non_data_parallel_size
        return {
            "world_size": self.world_size,
            "device": self.device.name,
            "layout": {"dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp, "pp": d.pp},
            "ranks": [
                {
                    "role": r.name,
                    "ranks": list(r.ranks),
                    "memory_bytes": r.trace.memory.as_dict(),
                    "peak_where": r.trace.memory.peak_where,
                    "reserved_bytes": r.trace.memory.reserved,
                    "steady_bytes": r.trace.memory.steady,
                    "collectives": [dataclasses.asdict(c) for c in r.trace.collectives],
                    "executed_flops_per_step": r.trace.executed_flops,
                    "float8_flops_per_step": r.trace.float8_flops,
                    "float8_casts_per_step": r.trace.float8_casts,
                    "step_time_s": r.time.step_s,
                }
                for r in self.roles
            ],  # fmt: skip
            "flops_per_step": model_flops,  # model FLOPs (6N + 12 L d T per token) per device
            "step_time_s": self.time.step_s,
            "compute_s": self.time.compute_s,
            "exposed_comm_s": self.time.exposed_s,
            "tokens_per_s_per_device": self.tokens_per_s_per_device,
            "mfu": self.mfu,
            "activation_checkpoint": self.ac_mode,
            "local_batch_size": self.local_batch_size,
        }


def init_fake_world(world_size: int, rank: int = 0) -> None:
    """A fake process group of `world_size` ranks, this process rank `rank` (kept if one exists like it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() == world_size and dist.get_rank() == rank:
            return
        if dist.get_backend() != "fake":
            raise RuntimeError(
                f"a process group of {dist.get_world_size()} ranks exists; the estimate needs a fake one of "
                f"{world_size}"
            )
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def roles_of(dims: ParallelDims, world_size: int) -> list[tuple[str, tuple[int, int]]]:
    """(name, [first, last] rank) of each role: one without PP; under PP the first and the last stage."""
    if not dims.pp_enabled:
        return [("all", (0, world_size - 1))]
    per_stage = world_size // dims.pp
    last = world_size - per_stage
    return [("first stage", (0, per_stage - 1)), ("last stage", (last, world_size - 1))]


def estimate(
    cfg: JobConfig, world_size: int, device: Device, *, nodes_of: int | None = None, every_block: bool = False
) -> Estimate:
    """One layout: the config's degrees on `world_size` ranks of `device` (NGPU per node unless `nodes_of`);
    `every_block`: trace every block instead of two samples (`trace_step_sampled`)."""
    check_config(cfg, world_size, local_files=False)  # the job's tokenizer and data live on the cluster
    if cfg.model.converters and not device.float8_tflops:
        raise ValueError(
            f"model.converters={cfg.model.converters} on --device {device.name}: it has no float8 tensor cores "
            f"(sm_89 or newer needed); set model.converters=[] or pick h100, h200 or b200"
        )
    dims = build_parallel_dims(cfg.parallelism, world_size)
    stretch = 1.0
    if dims.pp_enabled:
        p = cfg.parallelism
        microbatches = cfg.training.local_batch_size // p.pipeline_parallel_microbatch_size
        stretch = pipeline_stretch(schedule_spec(cfg), dims.pp, stages_per_rank(cfg), microbatches)
    roles = []
    per_node = nodes_of or gpus_per_node()
    # the DTensor plans are the target's: priced with its backend's links and hosts of `per_node` ranks
    target_links = CostModel(backend="gloo" if device.name == "cpu" else "nccl", host_size=per_node)
    for name, ranks in roles_of(dims, world_size):
        init_fake_world(world_size, ranks[0])
        with use_cost_model(target_links), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fake tensors' data_ptr deprecation, from code that caches by pointer
            mesh = dims.build_mesh("cpu")
            runtime = build_runtime(cfg, dims, mesh, torch.device("cpu"))  # the tensors: fake, on the CPU
            precision = resolve_precision(cfg, torch.device("cpu" if device.name == "cpu" else "cuda"), dims)
            runtime = dataclasses.replace(runtime, precision=precision)  # the dtypes: the target device's
            trace = trace_step_sampled(cfg, runtime, every_block=every_block)
        compiled = cfg.compile.enable and "model" in cfg.compile.components and compile_supported(dims)
        time = price_step(trace, dims, device, per_node, pipeline_stretch=stretch, compiled=compiled)
        roles.append(Role(name, ranks, trace, time))
    return Estimate(
        world_size, device, dims, tuple(roles), cfg.activation_checkpoint.mode, cfg.training.local_batch_size
    )


# ------------------------------------------------------------------------------------------ output
def _gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


def format_table(e: Estimate, cfg: JobConfig, *, margin: float) -> str:
    d = e.dims
    lines = [
        f"estimate: {cfg.model.name} {cfg.model.flavor} on {e.world_size} x {e.device.name} "
        f"({gpus_per_node()} per node) | dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x cp {d.cp} x "
        f"tp {d.tp} x pp {d.pp} | AC {e.ac_mode} | local batch {e.local_batch_size} x {cfg.training.seq_len}",
    ]
    for role in e.roles:
        lines += _role_lines(e, role, margin=margin, named=len(e.roles) > 1)
    t = e.time
    model = e.trace.flops_per_token * e.trace.local_tokens / d.non_data_parallel_size
    executed = e.trace.executed_flops / 1e12
    float8 = f", {e.trace.float8_flops / 1e12:,.1f} of them in float8" if e.trace.float8_flops else ""
    lines.append(f"flops per device per step: model {model / 1e12:,.1f} TFLOP, executed {executed:,.1f} TFLOP "
                 f"(recomputation included{float8}{'; the slowest stage' if d.pp_enabled else ''})")  # fmt: skip
    exposed = ", ".join(f"{k} {v:.3f}s" for k, v in t.exposed_s.items()) or "none"
    bubble = f" + pipeline bubble {t.bubble_s:.3f}s" if d.pp_enabled else ""
    peaks = f"{e.device.peak_tflops:g}" + (f" / float8 {e.device.float8_tflops:g}" if e.trace.float8_flops else "")
    lines.append(f"step time {t.step_s:.3f}s = compute {t.compute_s:.3f}s (at {e.device.efficiency:.0%} of "
                 f"{peaks} TFLOPS){bubble} + exposed comm ({exposed})")  # fmt: skip
    lines.append(f"tok/s per device {e.tokens_per_s_per_device:,.0f} | mfu {e.mfu:.1%}")
    return "\n".join(lines)


def _role_lines(e: Estimate, role: Role, *, margin: float, named: bool) -> list[str]:
    m = role.trace.memory
    title = f"{role.name} (ranks {role.ranks[0]}-{role.ranks[1]}): " if named else ""
    lines = [f"{title}memory per rank at the peak ({m.peak_where}):"]
    lines += [f"  {name:<17}{_gib(nbytes)}" for name, nbytes in m.at_peak.items()]
    budget = e.device.memory_bytes * (1 - margin)
    verdict = "fits" if m.peak <= budget else "does NOT fit"
    lines.append(f"  {'peak':<17}{_gib(m.peak)}  of {e.device.memory_bytes / GIB:.1f} GiB: {verdict} "
                 f"with a {margin:.0%} margin (tensor bytes)")  # fmt: skip
    lines.append(f"  {'reserved':<17}{_gib(m.reserved)}  (the CUDA caching allocator's peak for these allocations: "
                 "what torch reports)")  # fmt: skip
    lines.append("  steady (after the step): " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in m.steady.items()))
    lines.append(f"{title}collectives per rank per step:")
    lines.append(f"  {'kind':<24}{'mesh dim':<14}{'count':>7}{'bytes':>16}{'seconds':>10}  link")
    for c in role.trace.collectives:
        link = "network" if role.time.inter_node.get(c.mesh_dim) else "nvlink"
        secs = collective_seconds(c, e.dims, e.device, gpus_per_node())
        lines.append(f"  {c.kind:<24}{c.mesh_dim:<14}{c.count:>7}{c.bytes:>16,}{secs:>10.4f}  {link}")
    return lines


# ------------------------------------------------------------------------------------------ CLI
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="python -m trainer.estimate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world_size", type=int, required=True, help="ranks of the job (NGPU x NNODES)")
    parser.add_argument("--device", required=True, help="a100, h100, h200, b200 or cpu")
    parser.add_argument("--search", action="store_true", help="rank layouts for this model and world size")
    parser.add_argument("--json", action="store_true", help="print DESIGN.md §7's JSON object")
    parser.add_argument("--memory_margin", type=float, default=0.1, help="device memory kept free (fraction)")
    parser.add_argument("--top", type=int, default=5, help="--search: how many layouts to print")
    parser.add_argument(
        "--every_block", action="store_true",
        help="trace every block, not two short samples: the same live bytes, collectives and FLOPs (exact on a line), "
        "a closer reserved peak (the allocator's cache grows with the blocks; the samples read it 5-9%% low), "
        "several times slower",
    )  # fmt: skip
    return parser.parse_known_args(argv)


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    logging.getLogger("trainer.estimate_search").setLevel(logging.INFO)  # --search's progress, on stderr
    try:
        device = lookup_device(args.device)
        if args.world_size < 1:
            raise ValueError(f"--world_size {args.world_size}: expected a positive number of ranks")
        cfg = load_config(overrides)
        if args.search and args.every_block:
            raise ValueError(
                "--every_block is for one estimate; --search traces its hundreds of candidates from samples: "
                "drop one of them, or estimate the layout --search picks with --every_block"
            )
        if args.search:
            from .estimate_search import format_candidates, search

            found = search(cfg, args.world_size, device, margin=args.memory_margin, argv=overrides)[: args.top]
            print(json.dumps({"candidates": [{**e.as_json(), "overrides": o} for e, o in found]}, indent=2)
                  if args.json else format_candidates(found, cfg, margin=args.memory_margin))  # fmt: skip
            return 0
        result = estimate(cfg, args.world_size, device, every_block=args.every_block)
    except (ValueError, NotImplementedError, TypeError) as error:
        print(f"estimate: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_json(), indent=2) if args.json else format_table(result, cfg, margin=args.memory_margin))
    return 0


if __name__ == "__main__":
    sys.exit(main())
