"""checkpoint.save / load on real gloo worlds: the reshard matrix (every saving layout into every
loading layout, one process included, bitwise), Partial reduction, key checks and refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import checkpoint
from checkpoint import CheckpointError
from parallelisms.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from parallelisms.dtensor.placements import _StridedShard
from tests.dtensor.harness import get_mesh
from tests.world import run_world

# name -> (global shape, dtype, role): roles pick placements as the Llama recipe does
TENSORS = {
    "model.tok_embeddings.weight": ((13, 6), torch.float32, "col"),
    "model.layers.0.attention.wq.weight": ((10, 7), torch.float32, "col"),
    "model.layers.0.attention.wo.weight": ((7, 10), torch.float32, "row"),
    "model.layers.0.attention_norm.weight": ((7,), torch.float32, "norm"),
    "model.output.weight": ((3, 5), torch.bfloat16, "col"),  # fewer rows than ranks: empty shards
    "optimizer.state.model.output.weight.step": ((), torch.float32, "plain"),
    "optimizer.state.model.layers.0.attention.wq.weight.exp_avg": ((10, 7), torch.float32, "col"),
}
# layout -> (world size, mesh shape, mesh dim names, placements per role)
LAYOUTS = {
    "one": (1, None, None, {}),
    "fsdp2": (2, (2,), ("dp_shard",), {"col": (Shard(0),), "row": (Shard(0),), "norm": (Shard(0),)}),
    "tp2": (2, (2,), ("tp",), {"col": (Shard(0),), "row": (Shard(1),), "norm": (Replicate(),)}),
    "fsdp4": (4, (4,), ("dp_shard",), {"col": (Shard(0),), "row": (Shard(0),), "norm": (Shard(0),)}),
    "tp4": (4, (4,), ("tp",), {"col": (Shard(0),), "row": (Shard(1),), "norm": (Replicate(),)}),
    "fsdp_tp": (
        4,
        (2, 2),
        ("dp_shard", "tp"),
        {
            "col": (_StridedShard(0, split_factor=2), Shard(0)),
            "row": (Shard(0), Shard(1)),
            "norm": (Shard(0), Replicate()),
        },
    ),  # fmt: skip
    "hsdp": (
        4,
        (2, 2),
        ("dp_replicate", "dp_shard"),
        {
            "col": (Replicate(), Shard(0)),
            "row": (Replicate(), Shard(0)),
            "norm": (Replicate(), Shard(0)),
        },
    ),  # fmt: skip
}
# Pipeline layouts: the outer "pp" mesh dim splits the names by stage (each rank saves and loads only its stage's
# keys, as a pipelined trainer's ranks do), the inner dims shard them as above.
STAGE = {
    name: 1 if name.endswith(("output.weight", "output.weight.step", "attention_norm.weight")) else 0
    for name in TENSORS
}
LAYOUTS |= {
    "pp2": (2, (2,), ("pp",), {}),
    "pp2_fsdp2": (4, (2, 2), ("pp", "dp_shard"), {"col": (Shard(0),), "row": (Shard(0),), "norm": (Shard(0),)}),
}
SAVERS = ["fsdp4", "tp4", "fsdp_tp", "hsdp", "pp2_fsdp2"]


def _global(name: str) -> torch.Tensor:
    shape, dtype, _ = TENSORS[name]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=g).to(dtype)


def _state_dict(layout: str, *, empty: bool) -> dict:
    """The nested state dict in `layout` (under PP, this rank's stage's names only): real values, or zeros/defaults
    to load into."""
    _, mesh_shape, names, by_role = LAYOUTS[layout]
    mesh = get_mesh(mesh_shape, names) if mesh_shape else None
    stage = None
    if mesh is not None and names[0] == "pp":
        stage = mesh.get_local_rank("pp")
        mesh = mesh[names[1:]] if len(names) > 1 else None
    sd: dict = {"model": {}, "optimizer": {"state": {}, "param_groups": [{"lr": 0.0 if empty else 3e-4, "betas": (0, 0)
                if empty else (0.9, 0.95), "params": ["model.output.weight"]}]}, "train_state": {"step": 0 if empty
                else 7}}  # fmt: skip
    for name, (_, _, role) in TENSORS.items():
        if stage is not None and STAGE[name] != stage:
            continue
        t = torch.zeros_like(_global(name)) if empty else _global(name)
        if mesh is not None and role in by_role:
            t = distribute_tensor(t, mesh, by_role[role])
        section, rest = name.split(".", 1)
        if section == "optimizer":
            sd["optimizer"]["state"][rest.removeprefix("state.")] = t
        else:
            sd["model"][rest] = t
    return sd


def _flat_tensors(sd: dict) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in sd["model"].items()}
    out.update({f"optimizer.state.{k}": v for k, v in sd["optimizer"]["state"].items()})
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in out.items()}


def _save(layout: str, directory: str) -> list[str]:
    checkpoint.save(_state_dict(layout, empty=False), directory)
    return sorted(os.listdir(directory))


def _load_and_compare(layout: str, directory: str) -> list[str]:
    sd = _state_dict(layout, empty=True)
    checkpoint.load(sd, directory)
    got = _flat_tensors(sd)
    bad = [k for k in got if not _bitwise_equal(got[k], _global(k))]
    _, mesh_shape, names, _ = LAYOUTS[layout]
    stage = get_mesh(mesh_shape, names).get_local_rank("pp") if names and names[0] == "pp" else None
    if set(got) != {k for k in TENSORS if stage in (None, STAGE[k])}:
        bad.append(f"stage {stage} holds {sorted(got)}")
    if sd["train_state"]["step"] != 7 or sd["optimizer"]["param_groups"][0]["betas"] != (0.9, 0.95):
        bad.append("json values")
    return bad


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    out = {}
    for layout in SAVERS:
        directory = str(tmp_path_factory.mktemp("ckpt") / f"step-{layout}")
        files = run_world(_save, LAYOUTS[layout][0], layout, directory)[0]
        assert "index.json" in files
        out[layout] = directory
    return out


@pytest.mark.parametrize("saver", SAVERS)
def test_every_layout_loads_into_every_layout_bitwise(saved, saver) -> None:
    for loader in LAYOUTS:
        world_size = LAYOUTS[loader][0]
        if world_size == 1:
            bad = _load_and_compare(loader, saved[saver])
        else:
            bad = sum(run_world(_load_and_compare, world_size, loader, saved[saver]), [])
        assert not bad, f"saved as {saver}, loaded as {loader}: {sorted(set(bad))} differ"


def test_replicated_chunks_are_written_once_with_balanced_bytes(saved) -> None:
    index = checkpoint.read_index(saved["hsdp"])
    for name, entry in index.tensors.items():
        covered = sum(torch.Size(c.shape).numel() for c in entry.chunks)
        assert covered == torch.Size(entry.shape).numel(), name  # each element exactly once
    sizes = [f.size for f in index.files.values()]
    assert len(sizes) == 4 and max(sizes) < 2 * min(sizes), sizes  # every rank of both replicas writes
    raw = json.loads((Path(saved["hsdp"]) / "index.json").read_text())
    assert raw["format"] == "meshtrain-checkpoint" and raw["values"]["train_state"] == {"step": 7}


def _save_partial(directory: str) -> list[float]:
    mesh = get_mesh((2,), ("tp",))
    pending = DTensor.from_local(torch.full((3,), float(dist.get_rank() + 1)), mesh, [Partial("sum")])
    checkpoint.save({"x": pending}, directory)
    target = {"x": torch.zeros(3)}
    checkpoint.load(target, directory)
    return target["x"].tolist()


def test_partial_is_reduced_before_saving(tmp_path) -> None:
    assert run_world(_save_partial, 2, str(tmp_path / "step-1")) == [[3.0] * 3] * 2


def _save_disjoint(directory: str) -> dict:
    """Pipeline stages: each rank saves its own keys (plain tensors: each is held by one rank only)."""
    rank = dist.get_rank()
    sd = {"a": torch.full((2,), 1.0), "shared": torch.arange(3)} if rank == 0 else {"b": torch.full((3,), 2.0)}
    sd["shared"] = torch.arange(3)
    checkpoint.save(sd, directory)
    back = {"a": torch.zeros(2), "b": torch.zeros(3), "shared": torch.zeros(3, dtype=torch.int64)}
    checkpoint.load(back, directory)
    return {k: v.tolist() for k, v in back.items()}


def test_ranks_with_different_keys_each_save_their_own(tmp_path) -> None:
    got = run_world(_save_disjoint, 2, str(tmp_path / "step-1"))
    assert got == [{"a": [1.0, 1.0], "b": [2.0, 2.0, 2.0], "shared": [0, 1, 2]}] * 2
    index = checkpoint.read_index(tmp_path / "step-1")
    files = {k: {c.file for c in e.chunks} for k, e in index.tensors.items()}
    assert files["a"] == {"rank-0.safetensors"} and files["b"] == {"rank-1.safetensors"}


def _save_conflicting(directory: str) -> str:
    sd = {"a": torch.zeros(2)} if dist.get_rank() == 0 else {"a": torch.zeros(3)}
    try:
        checkpoint.save(sd, directory)
    except ValueError as e:
        return str(e)
    return "saved"


def test_ranks_describing_a_key_differently_are_refused_on_every_rank(tmp_path) -> None:
    messages = run_world(_save_conflicting, 2, str(tmp_path / "step-1"))
    assert all("ranks 0 and 1 save 'a' differently" in m for m in messages), messages


def test_load_reports_every_mismatch_at_once_and_allows_listed_ones(tmp_path) -> None:
    torch_sd = {"a": torch.ones(2, 3), "b": torch.arange(4), "c": torch.ones(1), "n": 5}
    path = _save_one_process({**torch_sd}, tmp_path / "step-1")
    target = {"a": torch.zeros(3, 2), "b": torch.zeros(4), "missing": torch.zeros(1), "n": 0}
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(target, path)
    message = str(err.value)
    assert "3 problems" in message and "(3, 2) here, (2, 3)" in message and "float32 here, int64" in message
    assert "missing: missing from the checkpoint" in message
    assert torch.equal(target["a"], torch.zeros(3, 2)), "a failed load must change nothing"
    result = checkpoint.load(target, path, allow_mismatch=["a", "b", "missing"])
    assert len(result.skipped) == 3 and target["n"] == 5


def _save_one_process(sd: dict, path: Path) -> Path:
    """A 1-rank world in the test process itself (load needs none)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return checkpoint.save(sd, path)
    finally:
        dist.destroy_process_group()


def test_saving_into_a_committed_checkpoint_is_refused(tmp_path) -> None:
    path = _save_one_process({"a": torch.ones(2)}, tmp_path / "step-1")
    before = (path / "rank-0.safetensors").read_bytes()
    with pytest.raises(FileExistsError, match="never overwritten"):
        _save_one_process({"a": torch.zeros(2)}, path)
    assert (path / "rank-0.safetensors").read_bytes() == before
