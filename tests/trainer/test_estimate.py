"""The dry-run estimator (trainer.estimate): exact sharded bytes for the production configs, the fake step
against real gloo runs of the debug model (peak live tensor bytes, collectives), the CLI's JSON contract
and its one-line refusals."""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.estimate_server import EstimateServer
from tests.world import run_world
from trainer.config import load_config
from trainer.config.state_floor import state_bytes_lower_bound
from trainer.estimate.search import Layout, parameter_count

REPO = Path(__file__).resolve().parents[2]
CONTRACT = {
    "world_size",
    "device",
    "layout",
    "ranks",
    "flops_per_step",
    "step_time_s",
    "tokens_per_s_per_device",
    "mfu",
}
RANK_KEYS = {"role", "ranks", "memory_bytes", "collectives"}
MEMORY_KEYS = {"params", "grads", "optimizer", "activations", "temporaries", "comm_buffers", "peak"}
LAYOUT_KEYS = {"dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp"}


_SERVER: list[EstimateServer] = []  # the module's one server, started by the first estimate


@pytest.fixture(scope="module", autouse=True)
def _close_estimate_server() -> Iterator[None]:
    yield
    while _SERVER:
        _SERVER.pop().close()


def run_estimate(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`python -m trainer.estimate ARGS`: its exit status and output, run by the module's estimate server
    (one fresh interpreter for all of them: the fake world must not leak into pytest's)."""
    if _SERVER and not _SERVER[0].alive:  # it died or timed out in an earlier test: the next ones get a new one
        _SERVER.pop()
    if not _SERVER:
        _SERVER.append(EstimateServer())
    return _SERVER[0].run(*args, timeout=timeout)


def estimate_json(config: str, world_size: int, *overrides: str, device: str = "cpu") -> dict[str, Any]:
    """The estimate's JSON; the production configs name tokenizers that are not here, as on a laptop planning
    a cluster job: their model.vocab_size stands in (the dry run needs no tokenizer or data files)."""
    done = run_estimate("--job.config_file", str(REPO / "configs" / f"{config}.toml"), *overrides,
                        "--world_size", str(world_size), "--device", device, "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


# ------------------------------------------------------------------------ exact sharded bytes
def analytic_local_numel(config: str, dp_shard: int, tp: int) -> tuple[int, int]:
    """(rank 0's parameter elements, parameter tensors) from the sharding plan alone: TP shards colwise
    weights on dim 0, rowwise ones (wo, w2) on dim 1, the embedding on dim 0 (vocabulary), norms not; FSDP
    then chunks dim 0 of what TP left over dp_shard, rank 0 taking the first (largest) chunk."""
    import dataclasses

    import torch

    from models.llama3 import llama3_configs
    from models.llama3.model import Transformer
    from trainer.config import load_config

    cfg = load_config(["--job.config_file", str(REPO / "configs" / f"{config}.toml"), "--model.tokenizer_path", ""])
    args = dataclasses.replace(llama3_configs[cfg.model.flavor], vocab_size=cfg.model.vocab_size,
                               max_seq_len=cfg.training.seq_len)  # fmt: skip
    with torch.device("meta"):
        model = Transformer(args)
    total, tensors = 0, 0
    for name, p in model.named_parameters():
        rows, cols = (p.shape[0], math.prod(p.shape[1:])) if p.ndim > 1 else (p.shape[0], 1)
        if name.endswith(("wo.weight", "w2.weight")):
            cols //= tp
        elif p.ndim > 1:  # colwise linears, the output and the embedding: dim 0
            rows //= tp
        total += math.ceil(rows / dp_shard) * cols
        tensors += 1
    return total, tensors


@pytest.mark.parametrize(("config", "world_size"), [("llama3_8b", 8), ("llama3_70b", 64), ("llama3_405b", 512)])
def test_sharded_param_grad_optimizer_bytes_equal_the_analytic_figures(config: str, world_size: int) -> None:
    # without PP (405B's config pipelines over 8 stages; its stages are checked against real runs below)
    report = estimate_json(config, world_size, "--parallelism.pipeline_parallel_degree", "1", device="h100")
    layout = report["layout"]
    numel, tensors = analytic_local_numel(config, layout["dp_shard"], layout["tp"])
    steady = report["ranks"][0]["steady_bytes"]
    assert steady["params"] == 4 * numel  # float32 master weights
    assert steady["grads"] == 4 * numel  # float32 gradients, sharded as the parameters
    assert steady["optimizer"] == 2 * 4 * numel + 4 * tensors  # AdamW's exp_avg, exp_avg_sq and a 0-d step each
    flavor_params = {"llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496, "llama3_405b": 405_853_388_800}
    even = 4 * flavor_params[config] / (layout["dp_shard"] * layout["tp"])
    assert abs(steady["params"] - even) / even < 0.01  # params x bytes / (dp_shard x tp), up to uneven chunks


# each config in configs/ with the world size its header names
SHIPPED_CONFIGS = {"debug_model": 2, "llama3_1b": 1, "llama3_8b": 8, "llama3_70b": 64, "llama3_405b": 512}


def test_every_shipped_config_is_estimated_below() -> None:
    assert {p.stem for p in (REPO / "configs").glob("*.toml")} == set(SHIPPED_CONFIGS)


@pytest.mark.parametrize(("config", "world_size"), list(SHIPPED_CONFIGS.items()))
def test_no_memory_category_of_any_role_is_negative_on_the_shipped_configs(config: str, world_size: int) -> None:
    """405B's first pipeline stage once reported -1 GiB of gradients: its 1- and 2-block samples peaked at different
    moments of the step, and the line through them crossed zero."""
    report = estimate_json(config, world_size, device="h100")
    for role in report["ranks"]:
        negative = {k: v for k, v in role["memory_bytes"].items() if v < 0}
        assert not negative, (role["role"], negative)
        assert role["memory_bytes"]["peak"] == sum(v for k, v in role["memory_bytes"].items() if k != "peak")


# ------------------------------------------------------------------------ against real gloo runs
CP2 = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.context_parallel_degree", "2"]
PP2 = ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.pipeline_parallel_degree", "2"]
LAYOUTS = {  # name -> (world size, overrides)
    "fsdp2": (2, []),
    "tp2": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "2"]),
    "fsdp2_tp2": (4, ["--parallelism.tensor_parallel_degree", "2"]),
    # float8 linears: the amax all-reduces under TP, the float8 matmuls' FLOPs and casts counted apart
    "fsdp2_tp2_float8": (4, ["--parallelism.tensor_parallel_degree", "2", "--model.converters", "float8",
                             "--quantize.linear.float8.filter_fqns", "output"]),
    # rowwise float8: a row's or column's amax over TP's sharded dim is an all-reduce of a vector
    "tp2_float8_rowwise": (2, ["--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree",
                               "2", "--model.converters", "float8", "--quantize.linear.float8.recipe_name", "rowwise"]),
    "ddp2": (2, ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]),
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2"]),
    "cp2_ring": (2, [*CP2, "--parallelism.context_parallel_rotate_method", "alltoall"]),
    # PP(2) x FSDP(2) under a split backward (V placement, 2 stages per rank): one all-gather and one
    # reduce-scatter per stage and step, W's gradients reduced after the stage's last W
    "pp2_fsdp2_zbv": (4, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "2",
                          "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),
    # 8 microbatches: the estimate traces two smaller counts the simulator picks (trainer/estimate/microbatches.py:
    # 1F1B 1 and 2, GPipe 2 and 3, Interleaved1F1B 1 and 4) and extrapolates; the real run traces all 8
    "pp2_1f1b_8mb": (2, [*PP2, "--training.local_batch_size", "8"]),
    "pp2_gpipe_8mb": (2, [*PP2, "--parallelism.pipeline_parallel_schedule", "GPipe",
                          "--training.local_batch_size", "8"]),
    "pp2_interleaved_8mb": (2, [*PP2, "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                "--training.local_batch_size", "8"]),
}  # fmt: skip


def real_step(overrides: list[str]) -> dict[str, Any]:
    """On every rank of a gloo world: the debug model's real step under the estimator's accounting."""
    import torch
    import torch.distributed as dist

    from trainer.config import load_config
    from trainer.estimate.trace import trace_pipeline_step, trace_step
    from trainer.preflight import build_parallel_dims
    from trainer.runtime import build_runtime

    cfg = load_config(["--job.config_file", str(REPO / "configs" / "debug_model.toml"), *overrides])
    dims = build_parallel_dims(cfg.parallelism, dist.get_world_size())
    runtime = build_runtime(cfg, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    trace = (trace_pipeline_step if dims.pp_enabled else trace_step)(cfg, runtime, fake=False)
    return {
        "peak": trace.memory.peak, "reserved": trace.memory.reserved, "counts": trace.comm_counts,
        "bytes": trace.comm_bytes, "float8": (trace.float8_flops, trace.float8_casts, trace.executed_flops),
        "collectives": sorted((c.kind, c.mesh_dim, c.count, c.bytes) for c in trace.collectives),
    }  # fmt: skip


def test_estimated_float8_all_gathers_match_a_real_gloo_run() -> None:
    """FSDP(2)'s float8 all-gather with precomputed scales: the estimate's collectives are the real step's, kind
    by kind, count and bytes (the gathers in float8 bytes, the amax all-reduce once a step, after the optimizer)."""
    float8 = ["--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "output"]
    keys = ["--quantize.linear.float8.enable_fsdp_float8_all_gather", "true",
            "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "true"]  # fmt: skip
    real = run_world(real_step, 2, [*float8, *keys])[0]
    estimated = estimate_json("debug_model", 2, *float8, *keys)["ranks"][0]["collectives"]
    assert sorted((c["kind"], c["mesh_dim"], c["count"], c["bytes"]) for c in estimated) == real["collectives"]
    # one amax all-reduce (precomputed after the optimizer) beside the step's two: the target count, the grad norm
    assert real["counts"]["all_reduce"] == 1 + 2


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_estimated_peak_and_collectives_match_a_real_gloo_run(layout: str) -> None:
    world_size, overrides = LAYOUTS[layout]
    reals = run_world(real_step, world_size, overrides)
    estimate = estimate_json("debug_model", world_size, *overrides)
    assert len(estimate["ranks"]) == (2 if "pp" in layout else 1)  # roles: the first and last stage under PP
    # --search drops a layout whose state floor overflows before estimating it: the floor must stay under the
    # measured peak of the busiest rank, or a fitting layout could be dropped unseen
    cfg = load_config(["--job.config_file", str(REPO / "configs" / "debug_model.toml"), *overrides])
    floor = state_bytes_lower_bound(cfg, parameter_count(cfg), Layout(**estimate["layout"]))
    assert 0 < floor <= max(real["peak"] for real in reals), (floor, [real["peak"] for real in reals])
    for role in estimate["ranks"]:
        real = reals[role["ranks"][0]]
        peak = role["memory_bytes"]["peak"]
        print(f"{layout} {role['role']}: estimated peak {peak:,} B, measured {real['peak']:,} B "
              f"({peak / real['peak'] - 1:+.2%}); reserved {role['reserved_bytes']:,} B, "
              f"measured {real['reserved']:,} B")  # fmt: skip
        assert abs(peak - real["peak"]) <= 0.10 * real["peak"]
        # the allocator model replayed on the real run's allocations: the estimate's (sampled blocks, the
        # cache over the live peak carried over) is within 10% of it and never under its own live peak
        reserved = role["reserved_bytes"]
        assert peak <= reserved and abs(reserved - real["reserved"]) <= 0.10 * real["reserved"], (reserved, real)
        estimated = sorted((c["kind"], c["mesh_dim"], c["count"], c["bytes"]) for c in role["collectives"])
        assert estimated == real["collectives"]
        assert (role["float8_flops_per_step"], role["executed_flops_per_step"]) == real["float8"][::2]
        assert role["float8_casts_per_step"] == real["float8"][1]  # elements cast, each priced as HBM traffic
        assert (role["float8_flops_per_step"] > 0) == ("float8" in layout)
        by_kind: dict[str, list[int]] = {}
        for kind, _, count, nbytes in estimated:
            by_kind.setdefault(kind, [0, 0])
            by_kind[kind][0] += count
            by_kind[kind][1] += nbytes
        assert by_kind == {k: [real["counts"][k], real["bytes"][k]] for k in real["counts"]}  # CommDebugMode's


def test_every_block_traces_the_whole_model_as_the_real_run_does() -> None:
    """--every_block: the same live peak and collectives as the samples' line (exact), and a reserved peak
    within 10% of the allocator model replayed on the real run's allocations."""
    world_size, overrides = LAYOUTS["fsdp2"]
    real = run_world(real_step, world_size, overrides)[0]
    whole = estimate_json("debug_model", world_size, *overrides, "--every_block")["ranks"][0]
    sampled = estimate_json("debug_model", world_size, *overrides)["ranks"][0]
    assert whole["memory_bytes"]["peak"] == sampled["memory_bytes"]["peak"]
    print(f"reserved: real {real['reserved']:,} B, every block {whole['reserved_bytes']:,}, "
          f"sampled {sampled['reserved_bytes']:,}")  # fmt: skip
    # within 10%, as the sampled figure: at this size a few 2 MiB small-pool segments are 5% (the fake step
    # makes some small tensors the real one does not); at 8B-405B scale whole traces move the figure 5-9%
    assert abs(whole["reserved_bytes"] - real["reserved"]) <= 0.10 * real["reserved"]
    assert whole["collectives"] == sampled["collectives"]


# ------------------------------------------------------------------------ the CLI
def test_json_has_every_key_of_the_contract() -> None:
    """Through `./run_train.sh --estimate` in a fresh interpreter, as a user runs it (the world size NGPU x NNODES);
    the other tests run the same `trainer.estimate.main` in the module's estimate server, which must answer
    exactly as the fresh interpreter does after the estimates it ran before (no state carried between them)."""
    env = {**os.environ, "NGPU": "4", "OMP_NUM_THREADS": "1"}
    tp2 = ["--parallelism.tensor_parallel_degree", "2"]
    command = ["./run_train.sh", "--estimate", "--device", "h100", *tp2, "--json"]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert estimate_json("debug_model", 4, *tp2, device="h100") == report
    assert CONTRACT <= report.keys()
    assert LAYOUT_KEYS == report["layout"].keys()
    rank = report["ranks"][0]
    assert RANK_KEYS <= rank.keys() and MEMORY_KEYS <= rank["memory_bytes"].keys()
    assert all({"kind", "mesh_dim", "count", "bytes"} == c.keys() for c in rank["collectives"])
    assert report["layout"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "pp": 1, "ep": 1, "etp": 1}
    assert {c["mesh_dim"] for c in rank["collectives"]} >= {"dp_shard", "tp"}
    assert report["step_time_s"] > 0 and 0 < report["mfu"] < 1
    # the peak is in the step's backward, not the optimizer step that made the AdamW state before it (whose
    # hook once left every later allocation labelled "optimizer step" and out of the activations)
    assert rank["peak_where"].startswith("backward") and rank["memory_bytes"]["activations"] > 0, rank["peak_where"]


def test_float8_matmuls_run_at_the_float8_peak_and_their_casts_cost_memory_traffic() -> None:
    """The same FLOPs and bytes with float8 linears; the matmuls priced at h100's float8 peak. Eager, the casts'
    chains of kernels eat most of the gain (torchao's own advice: float8 wants torch.compile); compiled, each
    cast fuses into a read and a write and the step is shorter. A100s have no float8 tensor cores: refused."""
    eight = ("--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "8")
    float8 = ("--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "output")
    variants = {"bf16": (), "eager": float8, "compiled": (*float8, "--compile.enable")}
    runs = {name: estimate_json("llama3_8b", 8, *eight, *extra, device="h100") for name, extra in variants.items()}
    flops = {name: run["ranks"][0]["executed_flops_per_step"] for name, run in runs.items()}
    assert flops["bf16"] == flops["eager"] == flops["compiled"]
    assert runs["bf16"]["ranks"][0]["float8_flops_per_step"] == 0
    assert 0.6 < runs["eager"]["ranks"][0]["float8_flops_per_step"] / flops["eager"] < 1  # the linears, not output
    steps = {name: run["step_time_s"] for name, run in runs.items()}
    assert steps["compiled"] < steps["eager"] < 1.05 * steps["bf16"], steps
    done = run_estimate("--model.converters", "float8", "--world_size", "8", "--device", "a100")
    assert done.returncode == 2 and "no float8 tensor cores" in done.stderr, done.stderr


def test_async_tp_prices_the_blocks_tp_collectives_under_their_matmuls() -> None:
    """The same trace and bytes (the rings send what the all-gathers and reduce-scatters do); under async TP the
    "tp" traffic is exposed only beyond the compute, at least one layer's worth: a shorter step."""
    tp8 = ("--parallelism.data_parallel_shard_degree", "1", "--parallelism.tensor_parallel_degree", "8")
    sync = estimate_json("llama3_8b", 8, *tp8, device="h100")
    ring = estimate_json("llama3_8b", 8, *tp8, "--parallelism.enable_async_tensor_parallel", device="h100")
    assert ring["ranks"][0]["collectives"] == sync["ranks"][0]["collectives"]
    assert sync["compute_s"] == ring["compute_s"] and sync["exposed_comm_s"]["tp"] > 0
    layers = 32  # llama3_8b
    assert ring["exposed_comm_s"]["tp"] == pytest.approx(sync["exposed_comm_s"]["tp"] / layers)  # below the compute
    assert ring["step_time_s"] < sync["step_time_s"]


def test_degrees_that_do_not_multiply_to_the_world_and_unknown_devices_fail_with_the_arithmetic() -> None:
    done = run_estimate("--parallelism.tensor_parallel_degree", "3", "--world_size", "8", "--device", "h100")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "8" in done.stderr and "3" in done.stderr
    done = run_estimate("--world_size", "8", "--device", "tpu")
    assert done.returncode == 2 and "expected one of" in done.stderr
    done = run_estimate("--world_size", "2", "--device", "h100", "--search", "--every_block")
    assert done.returncode == 2 and "--every_block is for one estimate" in done.stderr


def test_the_dry_run_s_own_flags_out_of_range_fail_before_any_work() -> None:
    """Before: --top 0 ran the whole search and printed nothing; --memory_margin -5 said "fits with a -500% margin"."""
    for flags, message in (
        (("--search", "--top", "0"), "--top 0: how many of --search's layouts to print, >= 1"),
        (("--memory_margin", "-5"), "--memory_margin -5.0: the fraction of device memory kept free, in [0, 1)"),
        (("--memory_margin", "1"), "in [0, 1)"),
    ):
        done = run_estimate("--world_size", "2", "--device", "h100", *flags)
        assert done.returncode == 2 and message in done.stderr, (flags, done.stderr[-2000:])


@pytest.mark.parametrize("ngpu", ["0", "abc", "-8"])
def test_a_bad_ngpu_is_named(monkeypatch: pytest.MonkeyPatch, ngpu: str) -> None:
    """Before: NGPU=0 crashed the dry run with ZeroDivisionError; NGPU=abc gave an error without the name."""
    from trainer.estimate.devices import gpus_per_node

    monkeypatch.setenv("NGPU", ngpu)
    with pytest.raises(ValueError, match=rf"NGPU='{ngpu}': the GPUs per node must be a positive whole number"):
        gpus_per_node()


def test_run_train_estimate_help_shows_the_dry_run_s_flags() -> None:
    done = subprocess.run(["./run_train.sh", "--estimate", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    for flag in ("--world_size", "--device", "--search", "--json", "--memory_margin", "./run_train.sh --help"):
        assert flag in done.stdout, (flag, done.stdout)


def test_a_million_ranks_are_priced_in_seconds_and_their_padding_is_warned() -> None:
    """Before: --world_size 1000000 priced every rank's chunk one by one (147 s) and said the layout fits
    without a word on the padding that almost all of it is."""
    import time

    start = time.monotonic()
    done = run_estimate("--world_size", "1000000", "--device", "h100", "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - start < 60
    warnings = json.loads(done.stdout)["warnings"]
    assert len(warnings) == 1 and "dp_shard x cp = 1000000 ranks shard dim 0 of 57 of the 57 parameters" in warnings[0]
    assert json.loads(run_estimate("--world_size", "8", "--device", "h100", "--json").stdout)["warnings"] == []


def test_search_ranks_fitting_layouts_best_first_with_their_overrides() -> None:
    done = run_estimate("--world_size", "2", "--device", "h100", "--search", "--json", "--top", "20")
    assert done.returncode == 0, done.stderr[-3000:]
    candidates = json.loads(done.stdout)["candidates"]
    layouts = {tuple(c["layout"][k] for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp")) for c in candidates}
    # FSDP, DDP, CP, TP and PP on 2 ranks
    assert layouts == {(1, 2, 1, 1, 1), (2, 1, 1, 1, 1), (1, 1, 2, 1, 1), (1, 1, 1, 2, 1), (1, 1, 1, 1, 2)}
    throughput = [c["tokens_per_s_per_device"] for c in candidates]
    assert throughput == sorted(throughput, reverse=True)
    for c in candidates:
        assert CONTRACT <= c.keys() and "--parallelism.pipeline_parallel_degree" in c["overrides"]
        assert c["ranks"][0]["memory_bytes"]["peak"] <= 0.9 * 80 * 2**30


def test_mesh_dims_are_priced_on_the_network_only_when_their_groups_span_nodes() -> None:
    from parallelisms.parallel_dims import ParallelDims
    from trainer.estimate.pricing import dim_extent, spans_nodes

    dims = ParallelDims(dp_replicate=2, dp_shard=32, cp=1, tp=8, pp=1, world_size=512)
    assert dim_extent(dims, "tp") == (8, 1) and dim_extent(dims, "dp_shard") == (32, 8)
    assert dim_extent(dims, "dp") == (64, 8) and dim_extent(dims, "dp_replicate") == (2, 256)
    assert not spans_nodes(dims, "tp", 8)
    assert all(spans_nodes(dims, name, 8) for name in ("dp_shard", "dp_replicate", "dp", "world"))
    fsdp_in_node = ParallelDims(dp_replicate=4, dp_shard=2, cp=1, tp=4, pp=1, world_size=32)
    assert not spans_nodes(fsdp_in_node, "dp_shard", 8) and spans_nodes(fsdp_in_node, "dp_replicate", 8)


@pytest.mark.parametrize("family, flavor", [("qwen3", "30B-A3B"), ("deepseek_v3", "16B")])
def test_an_moe_flavor_holds_every_expert_and_counts_the_active_flops(family: str, flavor: str) -> None:
    """FSDP over 8 ranks: the parameters per rank are all of the model's over 8 (every expert held), the model
    FLOPs per token are the active parameters' (top_k of num_experts routed), and the step's executed FLOPs
    include the experts' grouped GEMMs (about the model's FLOPs: no recomputation)."""
    from models.registry import flops_per_token, job_model_args

    model = ["--model.name", family, "--model.flavor", flavor, "--model.vocab_size", "2048"]
    report = estimate_json("debug_model", 8, *model, "--activation_checkpoint.mode", "none", device="h100")
    args = job_model_args(family, flavor, vocab_size=2048, max_seq_len=256)
    params = report["ranks"][0]["memory_bytes"]["params"]
    assert params == pytest.approx(args.parameter_count * 4 / 8, rel=0.02), (params, args.parameter_count)
    tokens = 2 * 256  # per device: local batch 2 x seq 256
    assert report["flops_per_step"] == pytest.approx(flops_per_token(family, args, 256) * tokens, rel=0.02)
    executed = report["ranks"][0]["executed_flops_per_step"]
    assert executed == pytest.approx(report["flops_per_step"], rel=0.1), executed  # the grouped GEMMs counted
    assert args.active_parameter_count < args.parameter_count / 4  # the active share is what the FLOPs count


# ------------------------------------------------------------------------ expert parallelism
DEEPSEEK_16B = ["--model.name", "deepseek_v3", "--model.flavor", "16B", "--model.vocab_size", "2048",
                "--activation_checkpoint.mode", "none"]  # fmt: skip
EP = "--parallelism.expert_parallel_degree"


def _collectives(report: dict[str, Any], kind: str, mesh_dim: str) -> tuple[int, int]:
    """(count, bytes) of the first role's collectives of `kind` on `mesh_dim`."""
    rows = [c for c in report["ranks"][0]["collectives"] if c["kind"].startswith(kind) and c["mesh_dim"] == mesh_dim]
    return sum(c["count"] for c in rows), sum(c["bytes"] for c in rows)


def test_expert_parallelism_keeps_the_experts_off_fsdp_s_gathers_and_prices_its_all_to_alls_on_ep() -> None:
    """DeepSeek-V3 16B on 8 ranks, FSDP 8 against ep 8 (dp_shard's 8 ranks): each rank holds 1/8 of the parameters
    either way (8 of the 64 experts whole, or 1/8 of each), but FSDP no longer gathers the experts (94% of them),
    and each MoE layer moves its routed rows instead: per step 4 all-to-alls of tokens x top_k rows x dim in bf16
    (dispatch and combine, forward and backward) and one of the (E,) int64 counts."""
    from models.registry import job_model_args, n_moe_layers

    fsdp = estimate_json("debug_model", 8, *DEEPSEEK_16B, device="h100")
    ep = estimate_json("debug_model", 8, *DEEPSEEK_16B, EP, "8", device="h100")
    assert ep["layout"] == {"dp_replicate": 1, "dp_shard": 8, "cp": 1, "tp": 1, "pp": 1, "ep": 8, "etp": 1}
    args = job_model_args("deepseek_v3", "16B", vocab_size=2048, max_seq_len=256)
    layers, moe = n_moe_layers(args), args.moe_args
    expert_share = layers * moe.num_experts * 3 * args.dim * args.moe_inter_dim / args.parameter_count
    assert expert_share == pytest.approx(0.941, abs=1e-3)
    params = {name: r["ranks"][0]["memory_bytes"]["params"] for name, r in (("fsdp", fsdp), ("ep", ep))}
    assert params["ep"] == params["fsdp"] == pytest.approx(args.parameter_count * 4 / 8, rel=0.02)
    gathered = {name: _collectives(r, "all_gather", "dp_shard")[1] for name, r in (("fsdp", fsdp), ("ep", ep))}
    assert gathered["ep"] / gathered["fsdp"] == pytest.approx(1 - expert_share, rel=0.01)
    assert ep["ranks"][0]["memory_bytes"]["params_unsharded"] < fsdp["ranks"][0]["memory_bytes"]["params_unsharded"]
    assert _collectives(fsdp, "all_to_all", "ep") == (0, 0)
    tokens = 2 * 256  # local batch x seq_len, per rank
    rows_bytes = tokens * moe.top_k * args.dim * 2  # bf16 rows, one all-to-all's payload
    assert _collectives(ep, "all_to_all", "ep") == (layers * 5, layers * (4 * rows_bytes + moe.num_experts * 8))
    # this small batch's step is FSDP's traffic: gathering and reducing the experts costs more than moving the tokens
    assert ep["step_time_s"] < fsdp["step_time_s"]


def test_a_routing_imbalance_makes_the_busiest_ep_rank_slower() -> None:
    """--routing_imbalance F: the rank estimated receives F x the mean routed rows (the busiest of its ep group), so
    its grouped GEMMs run F x the rows, and the combine's all-to-alls (forward and backward) hand back F x the rows;
    the dispatch's stay this rank's own. F lies in [1, ep]."""
    ep2 = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", EP, "2"]
    balanced = estimate_json("debug_model", 2, *ep2, "--every_block", device="h100")  # 6 blocks: cheaper than 3 + 5
    skewed = estimate_json("debug_model", 2, *ep2, "--every_block", "--routing_imbalance", "1.5", device="h100")
    assert (balanced["routing_imbalance"], skewed["routing_imbalance"]) == (1.0, 1.5)
    rows_bytes = 2 * 256 * 3 * 256 * 2  # tokens x top_k x dim x bf16
    layers, experts = 5, 8
    counts = layers * experts * 8
    assert _collectives(balanced, "all_to_all", "ep")[1] == layers * 4 * rows_bytes + counts
    assert _collectives(skewed, "all_to_all", "ep")[1] == layers * (2 + 2 * 1.5) * rows_bytes + counts
    flops = [r["ranks"][0]["executed_flops_per_step"] for r in (balanced, skewed)]
    assert flops[1] > flops[0] and skewed["step_time_s"] > balanced["step_time_s"]
    assert skewed["ranks"][0]["memory_bytes"]["peak"] >= balanced["ranks"][0]["memory_bytes"]["peak"]
    done = run_estimate("--world_size", "2", "--device", "h100", *ep2, "--routing_imbalance", "3")
    assert done.returncode == 2 and "--routing_imbalance 3.0" in done.stderr, done.stderr
    assert "in [1, expert_parallel_degree(2)]" in done.stderr
    done = run_estimate("--world_size", "2", "--device", "h100", "--routing_imbalance", "0.5")
    assert done.returncode == 2 and "--routing_imbalance 0.5" in done.stderr, done.stderr


def test_the_report_states_the_routing_it_assumes() -> None:
    from parallelisms.parallel_dims import ParallelDims
    from trainer.estimate.cli import moe_assumption

    cfg = load_config(["--model.name", "deepseek_v3", "--model.flavor", "16B"])
    fsdp = ParallelDims(dp_replicate=1, dp_shard=8, cp=1, tp=1, pp=1, world_size=8)
    ep = ParallelDims(dp_replicate=1, dp_shard=8, cp=1, tp=1, pp=1, world_size=8, ep=8)
    assert "balanced or not, routing costs the same here" in moe_assumption(cfg, fsdp, 1.0)[0]
    assert "8 experts per ep rank; routing assumed balanced" in moe_assumption(cfg, ep, 1.0)[0]
    assert "the busiest of its ep group, receiving 2 x the mean" in moe_assumption(cfg, ep, 2.0)[0]


def test_search_enumerates_the_expert_parallel_degrees_of_an_moe_model_only() -> None:
    """Each ep divides num_experts and passes ParallelDims (it borrows dp_shard x cp, x tp with etp 1); dense models
    keep their layouts and overrides."""
    from parallelisms.parallel_dims import ParallelDims
    from trainer.estimate.search import layouts

    moe = load_config(["--model.name", "deepseek_v3", "--model.flavor", "16B", "--model.vocab_size", "2048"])
    found = layouts(moe, 8, 8)
    for layout in found:
        assert 64 % layout.ep == 0 and layout.experts, layout
        ParallelDims(**{k: getattr(layout, k) for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "etp")},
                     world_size=8)  # fmt: skip
        assert layout.overrides()[-4:] == [EP, str(layout.ep), "--parallelism.expert_tensor_parallel_degree",
                                           str(layout.etp)]  # fmt: skip
    fsdp8 = [(la.ep, la.etp) for la in found if (la.dp_replicate, la.dp_shard, la.cp, la.tp, la.pp) == (1, 8, 1, 1, 1)]
    assert fsdp8 == [(1, 1), (2, 1), (4, 1), (8, 1)]
    tp2 = [(la.ep, la.etp) for la in found if (la.dp_replicate, la.dp_shard, la.cp, la.tp, la.pp) == (1, 4, 1, 2, 1)]
    assert tp2 == [(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2)]  # etp 1: ep a multiple of tp; etp 2: of dp_shard
    dense = layouts(load_config([]), 8, 8)
    assert all(la.ep == la.etp == 1 and not la.experts for la in dense)
    assert EP not in dense[0].overrides()


def test_a_bad_expert_parallel_degree_is_an_error_naming_the_key() -> None:
    model = ["--model.name", "deepseek_v3", "--model.flavor", "16B", "--model.vocab_size", "2048"]
    done = run_estimate("--world_size", "12", "--device", "h100", *model, EP, "3")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "parallelism.expert_parallel_degree(3) must divide the 16B flavor's num_experts(64)" in done.stderr
    done = run_estimate("--world_size", "8", "--device", "h100", *model, EP, "16")
    assert done.returncode == 2 and "expert_parallel_degree(16) must divide" in done.stderr, done.stderr


def test_the_ep_all_to_all_is_priced_on_the_network_only_when_its_group_spans_nodes() -> None:
    from parallelisms.parallel_dims import ParallelDims
    from trainer.estimate.pricing import dim_extent, spans_nodes

    # etp 1: ep borrows tp first, the innermost dim; 64 ranks cross nodes of 8, 8 stay in one
    wide = ParallelDims(dp_replicate=1, dp_shard=32, cp=1, tp=8, pp=1, world_size=256, ep=64)
    assert dim_extent(wide, "ep") == (64, 1) and spans_nodes(wide, "ep", 8)
    assert dim_extent(wide, "dp_shard") == (32, 8) and dim_extent(wide, "dp_shard_mod_ep") == (4, 64)
    in_node = ParallelDims(dp_replicate=1, dp_shard=32, cp=1, tp=8, pp=1, world_size=256, ep=8)
    assert dim_extent(in_node, "ep") == (8, 1) and not spans_nodes(in_node, "ep", 8)
    # etp = tp: ep takes dp_shard ranks only, tp apart, so its 8 ranks lie on 8 nodes
    strided = ParallelDims(dp_replicate=1, dp_shard=32, cp=1, tp=8, pp=1, world_size=256, ep=8, etp=8)
    assert dim_extent(strided, "ep") == (8, 8) and spans_nodes(strided, "ep", 8)
