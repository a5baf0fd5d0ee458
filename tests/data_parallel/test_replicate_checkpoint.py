"""A DDP job (data_parallel_replicate_degree 2 alone) checkpoints its whole replicas once, resumes bitwise,
and its checkpoint loads into FSDP(2) and continues there as FSDP(2)'s own would."""

from __future__ import annotations

import shutil
from pathlib import Path

import checkpoint
from tests.trainer.test_train import _losses, _train_rank
from tests.world import run_world

REPO = Path(__file__).resolve().parents[2]
JOB = [
    "--job.config_file", str(REPO / "configs" / "debug_model.toml"),
    "--training.steps", "4", "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "1",
    "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
    "--checkpoint.last_save_model_only", "false",
]  # fmt: skip
DDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]


def _run(dump: Path, layout: list[str]) -> list[float]:
    return _losses(run_world(_train_rank, 2, [*JOB, "--job.dump_folder", str(dump), *layout])[0])


def test_ddp_checkpoint_resumes_bitwise_and_reshards_into_fsdp(tmp_path: Path) -> None:
    straight = _run(tmp_path / "ddp", DDP)
    index = checkpoint.read_index(tmp_path / "ddp" / "checkpoint" / "step-2")
    files = {chunk.file for entry in index.tensors.values() for chunk in entry.chunks}
    assert len(files) >= 1 and all(len(entry.chunks) == 1 for entry in index.tensors.values())  # each written once
    for name, layout in (("ddp_again", DDP), ("fsdp", [])):
        shutil.copytree(tmp_path / "ddp" / "checkpoint" / "step-2", tmp_path / name / "checkpoint" / "step-2")
        resumed = _run(tmp_path / name, layout)
        assert resumed == straight[2:], (name, straight, resumed)  # averaging two is exact in any order
