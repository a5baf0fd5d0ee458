"""The dry run's command line: `python -m trainer.estimate --job.config_file F [--section.key value ...]
--world_size N --device {a100,h100,h200,b200,cpu} [--search] [--json] [--routing_imbalance F]` (also
`./run_train.sh --estimate`).

One layout's estimate (`dry_run.estimate`) as a table or as docs/architecture.md §7's JSON object; with `--search`, the
layouts `search.search` ranks, best first.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from parallelisms.parallel_dims import ParallelDims

from ..config import JobConfig, load_config
from .devices import GIB, gpus_per_node, lookup_device
from .dry_run import LOG_FORMAT, Estimate, Role, estimate
from .pricing import collective_seconds


# ------------------------------------------------------------------------------------------ output
def _gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


def format_table(e: Estimate, cfg: JobConfig, *, margin: float) -> str:
    d = e.dims
    lines = [
        f"estimate: {cfg.model.name} {cfg.model.flavor} on {e.world_size} x {e.device.name} "
        f"({gpus_per_node()} per node) | dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} x cp {d.cp} x "
        f"tp {d.tp} x pp {d.pp}{_ep(d)} | AC {e.ac_mode} | local batch {e.local_batch_size} x {cfg.training.seq_len}",
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
    lines += moe_assumption(cfg, d, e.routing_imbalance)
    lines += [f"warning: {w}" for w in e.warnings]
    return "\n".join(lines)


def _ep(d: ParallelDims) -> str:
    return f" | ep {d.ep} (etp {d.etp})" if d.ep_enabled else ""


def moe_assumption(cfg: JobConfig, dims: ParallelDims, routing_imbalance: float) -> list[str]:
    """What the estimate assumes of an MoE model's routing, which depends on the data it cannot see."""
    from models.registry import flavor_args, moe_args_of, n_moe_layers

    args = flavor_args(cfg.model.name, cfg.model.flavor)
    moe = moe_args_of(args)
    if moe is None:
        return []
    head = f"moe: {n_moe_layers(args)} layers x {moe.num_experts} experts, top {moe.top_k}: "
    if not dims.ep_enabled:
        return [
            f"{head}memory holds every expert, the model FLOPs count the {moe.top_k} active; each expert's grouped "
            f"GEMM runs tokens x top_k rows in all, so balanced or not, routing costs the same here (without expert "
            f"parallelism every rank holds every expert)"
        ]
    if routing_imbalance == 1:
        routing = (
            "routing assumed balanced: each ep rank receives the mean, tokens x top_k rows "
            "(--routing_imbalance F: the busiest receives F x the mean)"
        )
    else:
        routing = (
            f"routing imbalanced (--routing_imbalance {routing_imbalance:g}): the rank estimated is the busiest of its "
            f"ep group, receiving {routing_imbalance:g} x the mean tokens x top_k rows; its expert activations, "
            "grouped GEMMs and the all-to-alls that return their outputs scale with it"
        )
    return [f"{head}{moe.num_experts // dims.ep} experts per ep rank; {routing}"]


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


def format_candidates(found: list[tuple[Estimate, list[str]]], cfg: JobConfig, *, margin: float) -> str:
    if not found:
        return f"no layout of {cfg.model.flavor} fits in the device memory with a {margin:.0%} margin"
    lines = [f"{'tok/s/dev':>10}{'mfu':>7}{'step s':>8}{'peak GiB':>10}  overrides"]
    for e, overrides in found:
        lines.append(f"{e.tokens_per_s_per_device:>10,.0f}{e.mfu:>7.1%}{e.time.step_s:>8.2f}"
                     f"{e.peak_bytes / GIB:>10.1f}  {' '.join(overrides)}")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.estimate", description=__doc__.split("\n\n")[0],
        epilog="Every key of the job config is taken too (--section.key value, --job.config_file F): "
        "`./run_train.sh --help` lists them. NGPU (GPUs per node, default 8) places the ranks on nodes.",
    )  # fmt: skip
    parser.add_argument("--world_size", type=int, required=True, help="ranks of the job (NGPU x NNODES)")
    parser.add_argument("--device", required=True, help="a100, h100, h200, b200 or cpu")
    parser.add_argument("--search", action="store_true", help="rank layouts for this model and world size")
    parser.add_argument("--json", action="store_true", help="print docs/architecture.md §7's JSON object")
    parser.add_argument("--memory_margin", type=float, default=0.1, help="device memory kept free, in [0, 1)")
    parser.add_argument("--top", type=int, default=5, help="--search: how many layouts to print (>= 1)")
    parser.add_argument(
        "--routing_imbalance", type=float, default=1.0,
        help="MoE under expert parallelism: the busiest ep rank receives this x the mean routed tokens, in "
        "[1, ep] (1: balanced routing); its expert activations, grouped GEMMs and all-to-alls scale with it",
    )  # fmt: skip
    parser.add_argument(
        "--every_block", action="store_true",
        help="trace every block, not two short samples: the same live bytes, collectives and FLOPs (exact on a line), "
        "a closer reserved peak (the allocator's cache grows with the blocks; the samples read it 5-9%% low), "
        "several times slower",
    )  # fmt: skip
    return parser.parse_known_args(argv)


def check_flags(args: argparse.Namespace) -> None:
    """The dry run's own flags in range, before any work (the config's keys are the pre-flight's)."""
    if args.world_size < 1:
        raise ValueError(f"--world_size {args.world_size}: expected a positive number of ranks")
    if not 0 <= args.memory_margin < 1:
        raise ValueError(f"--memory_margin {args.memory_margin}: the fraction of device memory kept free, in [0, 1)")
    if args.top < 1:
        raise ValueError(f"--top {args.top}: how many of --search's layouts to print, >= 1")
    if not args.routing_imbalance >= 1:
        raise ValueError(
            f"--routing_imbalance {args.routing_imbalance}: the busiest ep rank receives this x the mean routed "
            "tokens, >= 1 (1: balanced)"
        )


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    logging.getLogger("trainer.estimate.search").setLevel(logging.INFO)  # --search's progress, on stderr
    try:
        device = lookup_device(args.device)
        check_flags(args)
        gpus_per_node()  # NGPU, read when the layout is placed on nodes: checked before any work
        cfg = load_config(overrides)
        if args.search and args.every_block:
            raise ValueError(
                "--every_block is for one estimate; --search traces its hundreds of candidates from samples: "
                "drop one of them, or estimate the layout --search picks with --every_block"
            )
        if args.search:
            from .search import search

            found = search(cfg, args.world_size, device, margin=args.memory_margin, argv=overrides,
                           routing_imbalance=args.routing_imbalance)[: args.top]  # fmt: skip
            print(json.dumps({"candidates": [{**e.as_json(), "overrides": o} for e, o in found]}, indent=2)
                  if args.json else format_candidates(found, cfg, margin=args.memory_margin))  # fmt: skip
            return 0
        result = estimate(
            cfg, args.world_size, device, every_block=args.every_block, routing_imbalance=args.routing_imbalance
        )
    except (ValueError, NotImplementedError, TypeError) as error:
        print(f"estimate: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_json(), indent=2) if args.json else format_table(result, cfg, margin=args.memory_margin))
    return 0
