"""Llama 3 70B on the meta device, parallelized for a 64-rank world that exists only on paper.

Each (layout, rank) runs in its own process on torch's fake process group (every collective is a
no-op, so one process can play rank r of 64): it builds the 70B model under `torch.device("meta")`,
runs parallelize_llama (TP -> FSDP) on the mesh ParallelDims builds, and reports every parameter's
layout. The test process may already hold a default process group (the test worlds) and c10d has
one per process, so a fresh interpreter (`launch_all`) imports torch once and forks one process per
rank, none of which ever held another group.

Checked against an independent reference: a rank's shard is `torch.chunk` twice (TP's chunk on the
plan's dim, then FSDP's dim-0 chunk of that), every parameter and buffer stays on meta, no real
memory is allocated, and over all 64 coordinates the shards tile each parameter exactly once per
replica: the 70B parameters, counted once.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

WORLD = 64
LAYOUTS = {"fsdp8_tp8": (1, 8, 8), "hsdp2x4_tp8": (2, 4, 8)}  # name: (dp_replicate, dp_shard, tp)
RANKS = (0, 13, 63)  # 13 is off the diagonal: a swapped (dp, tp) coordinate shows there, not at 0 or 63
LLAMA3_70B_PARAMS = 70_553_706_496  # the published count of Llama 3 70B
TIME_LIMIT_S = 60.0
RSS_LIMIT_MIB = 512  # a real 70B shard for one rank is ~4.4 GB in fp32; meta metadata is far below
REPO = Path(__file__).resolve().parents[2]

# the plan's TP dim per parameter name (parallelize_llama.apply_tp): Colwise shards Linear dim 0, Rowwise
# Linear dim 1 and Embedding dim 0 (vocabulary); SequenceParallel norms are replicated (None)
TP_DIM = {
    "tok_embeddings.weight": 0,
    "output.weight": 0,
    "attention.wq.weight": 0,
    "attention.wk.weight": 0,
    "attention.wv.weight": 0,
    "attention.wo.weight": 1,
    "feed_forward.w1.weight": 0,
    "feed_forward.w3.weight": 0,
    "feed_forward.w2.weight": 1,
    "attention_norm.weight": None,
    "ffn_norm.weight": None,
    "norm.weight": None,
}


# ------------------------------------------------------------------------------- in the child
def _max_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _all_coordinate_shards(p) -> list[list[list[int]]]:
    """[(local shape, global offset)] of `p` at every coordinate of its mesh, by the pure spec math."""
    from parallelisms.dtensor.placements import local_shape_and_offset

    mesh_shape = p.device_mesh.shape
    coordinates = [list(c) for c in torch.cartesian_prod(*map(torch.arange, mesh_shape)).view(-1, len(mesh_shape))]
    return [
        [list(s) for s in local_shape_and_offset(p.shape, mesh_shape, [int(i) for i in c], p.placements)]
        for c in coordinates
    ]


def _param_report(p, shard_cache: dict) -> dict:
    from parallelisms.dtensor import DTensor

    if not isinstance(p, DTensor):
        return {"dtensor": False, "meta": p.is_meta}
    local = p.to_local()
    key = (tuple(p.shape), tuple(p.device_mesh.shape), tuple(map(repr, p.placements)))
    if key not in shard_cache:  # 80 layers share ten layouts
        shard_cache[key] = _all_coordinate_shards(p)
    spec_shape, spec_offset = p._spec.local_shape_and_offset()
    return {
        "dtensor": True,
        "meta": p.is_meta and local.is_meta,
        "global_shape": list(p.shape),
        "local_shape": list(local.shape),
        "spec_local_shape": list(spec_shape),
        "spec_offset": list(spec_offset),
        "mesh_dim_names": list(p.device_mesh.mesh_dim_names),
        "mesh_shape": list(p.device_mesh.shape),
        "coordinate": p.device_mesh.get_coordinate(),
        "placements": [repr(x) for x in p.placements],
        "all_shards": repr(key),
    }


def rank_report(layout: str, rank: int) -> dict:
    """Parallelize 70B on meta as `rank` of the fake world; the report of every parameter."""
    t0 = time.perf_counter()
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from models.llama3 import Transformer, llama3_configs
    from models.llama3.parallelize import parallelize_llama
    from parallelisms.parallel_dims import ParallelDims

    dp_replicate, dp_shard, tp = LAYOUTS[layout]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=tp, pp=1, world_size=WORLD)
    mesh = dims.build_mesh("cpu")
    t_mesh = time.perf_counter()
    rss_before = _max_rss_mib()
    with torch.device("meta"):
        model = Transformer(llama3_configs["70B"])
    global_numel = sum(p.numel() for p in model.parameters())
    plain_names = [name for name, _ in model.named_parameters()]
    t_build = time.perf_counter()
    parallelize_llama(model, dims, mesh, loss_parallel=True)
    t_parallelize = time.perf_counter()
    rss_growth = _max_rss_mib() - rss_before
    shard_cache: dict = {}
    params = {name: _param_report(p, shard_cache) for name, p in model.named_parameters()}
    report = {
        "global_numel": global_numel,
        "plain_names": plain_names,
        "params": params,
        "all_shards": {repr(k): v for k, v in shard_cache.items()},
        "buffers_meta": all(b.is_meta for b in model.buffers()),
        "rss_growth_mib": rss_growth,
        "times": {
            "init_pg_and_mesh": t_mesh - t0,
            "build_model": t_build - t_mesh,
            "parallelize": t_parallelize - t_build,
            "report": time.perf_counter() - t_parallelize,
        },
    }
    dist.destroy_process_group()
    return report


def _run_rank(layout: str, rank: int) -> tuple[str, int, dict]:
    return layout, rank, rank_report(layout, rank)


def launch_all() -> None:
    """Child entry point: import and warm up once, then fork one fresh process per (layout, rank)
    (maxtasksperchild=1: no process plays two ranks); print every report as one JSON line."""
    import multiprocessing as mp

    t0 = time.perf_counter()
    # imported before forking, so every rank inherits them
    import torch.testing._internal.distributed.fake_pg

    import models.llama3.parallelize  # noqa: F401
    from models.llama3 import Transformer, llama3_configs

    torch.set_num_threads(1)  # before forking: the ranks must never enter an OpenMP region set up here
    with torch.device("meta"):  # the first meta ops load torch's meta kernels (seconds): once, here
        Transformer(llama3_configs["debugmodel"])
    t_warm = time.perf_counter()
    tasks = [(layout, rank) for layout in LAYOUTS for rank in RANKS]
    with mp.get_context("fork").Pool(processes=min(len(tasks), os.cpu_count() or 1), maxtasksperchild=1) as pool:
        results = pool.starmap(_run_rank, tasks)
    reports = {f"{layout}/{rank}": report for layout, rank, report in results}
    times = {"import_and_warm_up": t_warm - t0, "ranks": time.perf_counter() - t_warm}
    print(json.dumps({"reports": reports, "times": times}))


# ------------------------------------------------------------------------------ in the test process
@pytest.fixture(scope="module")
def reports() -> dict:
    """{"ranks": {(layout, rank): report}, "wall_s", "times"} from one fresh interpreter (launch_all)."""
    code = "from tests.models.test_meta_scale import launch_all; launch_all()"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=2 * TIME_LIMIT_S
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the 64-rank meta run did not finish in {2 * TIME_LIMIT_S:.0f} s; stderr:\n{e.stderr}")
    assert done.returncode == 0, f"the 64-rank meta run exited {done.returncode}; stderr:\n{done.stderr[-4000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    by_rank = {}
    for key, report in out["reports"].items():
        layout, rank = key.split("/")
        by_rank[layout, int(rank)] = report
    return {"ranks": by_rank, "wall_s": time.perf_counter() - start, "times": out["times"]}


def _coordinate(rank: int, mesh_shape: Sequence[int]) -> list[int]:
    """Row-major coordinate of `rank` (the world mesh is arange(world).view(shape))."""
    coordinate = []
    for size in reversed(mesh_shape):
        coordinate.append(rank % size)
        rank //= size
    return coordinate[::-1]


def _chunk(t: torch.Tensor, n: int, dim: int, index: int) -> torch.Tensor:
    """torch.chunk's piece `index`; chunk returns fewer pieces when the dim is short: an empty one."""
    pieces = t.chunk(n, dim)
    return pieces[index] if index < len(pieces) else t.narrow(dim, t.shape[dim], 0)


def _offsets(view: torch.Tensor, global_shape: Sequence[int]) -> list[int]:
    """A view's per-dim offset into a contiguous tensor of `global_shape`, from its storage offset."""
    strides = [math.prod(global_shape[d + 1 :]) for d in range(len(global_shape))]
    rest, out = view.storage_offset(), []
    for stride in strides:
        out.append(rest // stride)
        rest %= stride
    return out


def _reference_shard(name: str, global_shape: Sequence[int], layout: str, rank: int) -> tuple[list, list]:
    """(shape, offset) of `rank`'s shard: TP's torch.chunk on the plan's dim, then FSDP's dim-0 chunk."""
    dp_replicate, dp_shard, tp = LAYOUTS[layout]
    _, shard_index, tp_index = _coordinate(rank, (dp_replicate, dp_shard, tp))
    short = name.split(".", 2)[2] if name.startswith("layers.") else name
    tp_dim = TP_DIM[short]
    shard = torch.empty(global_shape, device="meta")
    if tp_dim is not None:
        shard = _chunk(shard, tp, tp_dim, tp_index)
    shard = _chunk(shard, dp_shard, 0, shard_index)
    return list(shard.shape), _offsets(shard, global_shape)


def _disjoint(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> bool:
    """Whether two boxes (shape, offset) share no element."""
    (shape_a, off_a), (shape_b, off_b) = a, b
    return (
        any(oa + sa <= ob or ob + sb <= oa for sa, oa, sb, ob in zip(shape_a, off_a, shape_b, off_b, strict=True))
        or 0 in shape_a
        or 0 in shape_b
    )


# --------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_70b_every_parameter_is_a_meta_dtensor_without_real_memory(reports: dict, layout: str) -> None:
    for rank in RANKS:
        report = reports["ranks"][layout, rank]
        assert list(report["params"]) == report["plain_names"], (layout, rank)
        not_meta = [n for n, p in report["params"].items() if not (p["dtensor"] and p["meta"])]
        assert not not_meta, f"{layout} rank {rank}: not meta DTensors: {not_meta[:5]}"
        assert report["buffers_meta"], (layout, rank)
        assert report["rss_growth_mib"] < RSS_LIMIT_MIB, (layout, rank, report["rss_growth_mib"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_70b_local_shards_are_tp_chunk_then_fsdp_chunk(reports: dict, layout: str) -> None:
    dp_replicate, dp_shard, tp = LAYOUTS[layout]
    want_mesh = [n for n, d in (("dp_replicate", dp_replicate), ("dp_shard_cp", dp_shard)) if d > 1] + ["tp"]
    for rank in RANKS:
        for name, p in reports["ranks"][layout, rank]["params"].items():
            shape, offset = _reference_shard(name, p["global_shape"], layout, rank)
            where = f"{layout} rank {rank} {name} {p['placements']}"
            assert p["mesh_dim_names"] == want_mesh, where
            assert p["coordinate"] == _coordinate(rank, p["mesh_shape"]), where
            assert p["local_shape"] == shape, where
            assert (p["spec_local_shape"], p["spec_offset"]) == (shape, offset), where


def test_70b_wq_shard_is_global_over_tp_then_over_dp_shard(reports: dict) -> None:
    """The worked example: wq (8192, 8192), Colwise over tp 8 -> 1024 rows, FSDP over 8 -> 128."""
    p = reports["ranks"]["fsdp8_tp8", 13]["params"]["layers.0.attention.wq.weight"]
    assert p["global_shape"] == [8192, 8192] and p["local_shape"] == [128, 8192]
    assert p["coordinate"] == [1, 5]  # rank 13 = dp_shard 1, tp 5
    assert p["spec_offset"] == [5 * 1024 + 1 * 128, 0]  # inside tp shard 5, FSDP's second chunk


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_70b_shards_over_all_ranks_tile_each_parameter_once_per_replica(reports: dict, layout: str) -> None:
    report = reports["ranks"][layout, 0]
    assert report["global_numel"] == LLAMA3_70B_PARAMS
    tiled = {key: _tiling(shards) for key, shards in report["all_shards"].items()}  # 80 layers share ten
    unique_total = 0
    for name, p in report["params"].items():
        copies_of, distinct_numel, disjoint = tiled[p["all_shards"]]
        replicas = math.prod(s for s, x in zip(p["mesh_shape"], p["placements"]) if x == "Replicate()")
        assert disjoint, f"{layout} {name}: two shards overlap"
        assert distinct_numel == math.prod(p["global_shape"]), f"{layout} {name}: the shards do not cover it"
        assert copies_of == {replicas}, f"{layout} {name}: each shard should be held by {replicas} ranks"
        unique_total += distinct_numel
    assert unique_total == LLAMA3_70B_PARAMS


def _tiling(shards: list) -> tuple[set[int], int, bool]:
    """(how many ranks hold each distinct shard, numel of the distinct shards, whether they are disjoint)."""
    assert len(shards) == WORLD
    counts: dict[str, int] = {}
    for shard in shards:
        counts[json.dumps(shard)] = counts.get(json.dumps(shard), 0) + 1
    boxes = [json.loads(k) for k in counts]
    disjoint = all(_disjoint(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    return set(counts.values()), sum(math.prod(shape) for shape, _ in boxes), disjoint


def test_70b_on_64_fake_ranks_finishes_fast(reports: dict) -> None:
    per_rank = {f"{layout}/{rank}": r["times"] for (layout, rank), r in reports["ranks"].items()}
    assert reports["wall_s"] < TIME_LIMIT_S, (reports["wall_s"], reports["times"], per_rank)
    assert all(sum(t.values()) < TIME_LIMIT_S / 2 for t in per_rank.values()), per_rank
