"""ParallelDims: degree arithmetic and inference (pure), and the world mesh it builds (gloo worlds)."""

from __future__ import annotations

import pytest

from parallelisms.parallel_dims import ParallelDims
from tests.world import run_world


def _dims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, world_size=8) -> ParallelDims:
    return ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, tp=tp, pp=pp, world_size=world_size)


def test_dp_shard_inferred_from_the_other_degrees():
    assert _dims(tp=2, world_size=8).dp_shard == 4
    assert _dims(dp_replicate=2, tp=2, pp=2, world_size=16).dp_shard == 2
    assert _dims(world_size=1).dp_shard == 1


def test_mismatched_product_shows_arithmetic_and_fix():
    with pytest.raises(ValueError) as err:
        _dims(dp_shard=3, tp=4, world_size=8)
    msg = str(err.value)
    assert "dp_shard_degree(3) * tp_degree(4) = 12 != world_size(8)" in msg
    assert "set parallelism.data_parallel_shard_degree=-1" in msg


def test_mismatched_product_without_inferable_fix():
    with pytest.raises(ValueError, match=r"tp_degree\(3\) = 6 != world_size\(8\); make the degrees multiply"):
        _dims(dp_shard=2, tp=3, world_size=8)


def test_inference_fails_when_world_not_divisible():
    with pytest.raises(ValueError, match=r"world_size\(8\) is not divisible by tp_degree\(3\) = 3"):
        _dims(tp=3, world_size=8)


@pytest.mark.parametrize("field", ["dp_replicate", "cp", "tp", "pp"])
def test_nonpositive_degree_rejected(field):
    with pytest.raises(ValueError, match=f"{field}_degree\\(0\\) must be >= 1"):
        _dims(**{field: 0})


def test_dp_shard_zero_rejected():
    with pytest.raises(ValueError, match=r"dp_shard_degree\(0\).*-1"):
        _dims(dp_shard=0)


def test_enabled_properties():
    d = _dims(dp_replicate=2, tp=2, world_size=8)
    assert (d.dp_enabled, d.dp_replicate_enabled, d.dp_shard_enabled, d.fsdp_enabled) == (True, True, True, True)
    assert (d.tp_enabled, d.cp_enabled, d.pp_enabled) == (True, False, False)
    assert d.non_data_parallel_size == 2 and d.seq_len_divisor == 2
    single = _dims(world_size=1)
    assert not (single.dp_enabled or single.fsdp_enabled or single.tp_enabled)
    cp_only = _dims(dp_shard=1, cp=2, world_size=2)
    assert cp_only.fsdp_enabled and not cp_only.dp_enabled and cp_only.seq_len_divisor == 4


# ------------------------------------------------------------------------------ meshes on ranks
def _mesh_layout(dp_replicate: int, dp_shard: int, tp: int) -> dict:
    import torch.distributed as dist

    dims = ParallelDims(
        dp_replicate=dp_replicate, dp_shard=dp_shard, cp=1, tp=tp, pp=1, world_size=dist.get_world_size()
    )
    mesh = dims.build_mesh("cpu")
    out: dict[str, object] = {"names": mesh.mesh_dim_names, "shape": mesh.shape}
    for name in ("tp", "dp", "dp_shard_cp", "dp_cp", "dp_shard", "dp_replicate"):
        try:
            out[name] = mesh[name].mesh.tolist()
        except KeyError:
            out[name] = None
    return out


def test_build_mesh_dp_shard_tp_4_ranks():
    results = run_world(_mesh_layout, 4, 1, -1, 2)
    for rank, r in enumerate(results):
        assert r["names"] == ("dp_shard", "tp") and r["shape"] == (2, 2)
        assert r["tp"] == [2 * (rank // 2), 2 * (rank // 2) + 1]  # tp innermost: neighbouring ranks
        assert r["dp_shard_cp"] == r["dp"] == r["dp_cp"] == [rank % 2, rank % 2 + 2]
        assert r["dp_replicate"] is None


def test_build_mesh_hsdp_4_ranks():
    results = run_world(_mesh_layout, 4, 2, -1, 1)
    for rank, r in enumerate(results):
        assert r["names"] == ("dp_replicate", "dp_shard") and r["shape"] == (2, 2)
        assert r["dp"] == r["dp_cp"] == [0, 1, 2, 3]
        assert r["dp_shard_cp"] == r["dp_shard"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert r["tp"] is None


def test_build_mesh_tp_only_has_no_dp_meshes():
    for r in run_world(_mesh_layout, 2, 1, 1, 2):
        assert r["names"] == ("tp",) and r["tp"] == [0, 1]
        assert r["dp"] is None and r["dp_shard_cp"] is None


def test_build_mesh_single_rank_is_1d_dp_shard():
    (r,) = run_world(_mesh_layout, 1, 1, -1, 1)
    assert r["names"] == ("dp_shard",) and r["shape"] == (1,)
    assert r["dp"] == r["dp_shard_cp"] == r["dp_cp"] == [0]


# ------------------------------------------------------------------------------ expert parallelism
def test_ep_borrows_dp_shard_and_cp_and_tp_when_etp_is_1():
    d = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=2, pp=1, world_size=8, ep=4)
    assert (d.dp_shard_in_ep, d.dp_shard_mod_ep) == (2, 2)  # ep 4 = 2 dp_shard ranks x tp 2
    d = ParallelDims(dp_replicate=1, dp_shard=4, cp=1, tp=2, pp=1, world_size=8, ep=4, etp=2)
    assert (d.dp_shard_in_ep, d.dp_shard_mod_ep) == (4, 1)  # etp = tp: ep only from dp_shard
    d = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=1, pp=1, world_size=8, ep=2)
    assert (d.dp_shard_in_ep, d.dp_shard_mod_ep, d.expert_gradient_divide_factor) == (1, 2, 8)  # ep is cp


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"ep": 3}, r"expert_parallel_degree\(3\) must divide dp_shard_degree\(4\) \* tp_degree\(2\) = 8, .* pick one "
                    r"of \[2, 4, 8\] for parallelism.expert_parallel_degree"),
        ({"ep": 16}, r"expert_parallel_degree\(16\) must divide .* = 8"),  # larger than the ranks it borrows
        ({"ep": 2, "cp": 2, "dp_shard": 2}, r"= 8, .* a multiple of cp_degree\(2\) \* tp_degree\(2\) = 4; pick "
                                             r"one of \[4, 8\]"),  # ep spans whole cp x tp groups
        ({"ep": 4, "etp": 3}, r"expert_tensor_parallel_degree\(3\) must be 1 .* or tensor_parallel_degree\(2\)"),
        ({"etp": 2}, r"expert_tensor_parallel_degree\(2\) without expert parallelism"),
        ({"ep": 0}, r"ep_degree\(0\) must be >= 1; set parallelism.expert_parallel_degree=1"),
    ],
)  # fmt: skip
def test_bad_expert_degrees_name_the_arithmetic(kw: dict, match: str):
    base = {"dp_replicate": 1, "dp_shard": 4, "cp": 1, "tp": 2, "pp": 1, "world_size": 8}
    with pytest.raises(ValueError, match=match):
        ParallelDims(**(base | kw))


def _ep_mesh_layout(dp_replicate: int, cp: int, tp: int, ep: int, etp: int) -> dict:
    import torch.distributed as dist

    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=-1, cp=cp, tp=tp, pp=1,
                        world_size=dist.get_world_size(), ep=ep, etp=etp)  # fmt: skip
    mesh = dims.build_mesh("cpu")
    return {"names": mesh.mesh_dim_names, "shape": mesh.shape} | {
        name: mesh[name].mesh.tolist() for name in ("ep", "dp", "dp_shard_cp", "dp_cp", "dp_shard_mod_ep")
    }


def test_ep_meshes_on_8_ranks():
    # dp_shard 4 x tp 2, ep 4 with etp 1: ep = 2 dp_shard ranks x the tp pair; FSDP of experts over the other 2
    for rank, r in enumerate(run_world(_ep_mesh_layout, 8, 1, 1, 2, 4, 1)):
        assert r["names"] == ("dp_shard_mod_ep", "dp_shard_in_ep", "tp") and r["shape"] == (2, 2, 2)
        first = 4 * (rank // 4)
        assert r["ep"] == [first, first + 1, first + 2, first + 3]
        assert r["dp_shard_mod_ep"] == [rank % 4, rank % 4 + 4]
        assert r["dp_shard_cp"] == r["dp"] == r["dp_cp"] == [rank % 2 + 2 * i for i in range(4)]  # as without EP
    # HSDP 2 x cp 2 x tp 2, ep 2 with etp = tp: ep is cp; dp_shard_mod_ep kept at size 1
    for rank, r in enumerate(run_world(_ep_mesh_layout, 8, 2, 2, 2, 2, 2)):
        assert r["names"] == ("dp_replicate", "dp_shard_mod_ep", "cp", "tp") and r["shape"] == (2, 1, 2, 2)
        assert r["ep"] == [rank - rank % 4 + rank % 2, rank - rank % 4 + rank % 2 + 2]
        assert r["dp_shard_mod_ep"] == [rank]
