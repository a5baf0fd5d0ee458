"""Resuming through the trainer: 4 steps straight equal 2 + restart + 2, bitwise on the same layout
and within fp32 tolerance on another parallelism (same data order), from the checkpoints' tensors."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint.manager import committed_steps
from tests.trainer.test_train import REPO, _losses, _train_rank
from tests.world import run_world

_JOB = [
    "--job.config_file", str(REPO / "configs" / "debug_model.toml"),
    "--training.steps", "4", "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "1",
    "--training.global_batch_size", "4", "--training.local_batch_size", "2",
    "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
    "--checkpoint.last_save_model_only", "false",
]  # fmt: skip
_LAYOUTS = {  # name -> (world size, overrides); the global batch stays 4 sequences
    "fsdp2": (2, []),
    "one": (1, []),
    "fsdp_tp": (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
}


def _run(layout: str, dump: Path) -> list[float]:
    world_size, overrides = _LAYOUTS[layout]
    return _losses(run_world(_train_rank, world_size, [*_JOB, *overrides, "--job.dump_folder", str(dump)])[0])


def _tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    index = checkpoint.read_index(step_dir)
    return {k: checkpoint.read_tensor(step_dir, k, index=index) for k in index.tensors}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, list[float]]:
    dump = tmp_path_factory.mktemp("straight")
    losses = _run("fsdp2", dump)
    assert committed_steps(dump / "checkpoint") == [2, 4]
    return dump, losses


def _resume_from_step_2(straight_dump: Path, dump: Path) -> None:
    """A job that stopped after its step-2 save: only that checkpoint exists."""
    shutil.copytree(straight_dump / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")


def test_resume_on_the_same_layout_is_bitwise(straight, tmp_path) -> None:
    dump, losses = straight
    _resume_from_step_2(dump, tmp_path)
    resumed = _run("fsdp2", tmp_path)
    assert resumed == losses[2:], (losses, resumed)  # only steps 3 and 4 ran
    want, got = _tensors(dump / "checkpoint" / "step-4"), _tensors(tmp_path / "checkpoint" / "step-4")
    assert want.keys() == got.keys() and any(k.startswith("optimizer.state.") for k in want)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, f"not bitwise after resuming: {differ[:5]}"
    values = checkpoint.read_index(tmp_path / "checkpoint" / "step-4").values
    assert values["train_state"]["step"] == 4 and values["dataloader"]["position"] == 4


@pytest.mark.parametrize("layout", ["one", "fsdp_tp"])
def test_resume_on_another_layout_continues_the_same_run(straight, tmp_path, layout) -> None:
    dump, losses = straight
    _resume_from_step_2(dump, tmp_path)
    resumed = _run(layout, tmp_path)
    assert resumed == pytest.approx(losses[2:], abs=2e-4), (losses, resumed)  # logged to 4 decimals
    want, got = _tensors(dump / "checkpoint" / "step-4"), _tensors(tmp_path / "checkpoint" / "step-4")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
