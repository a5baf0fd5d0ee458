"""Context parallelism through the trainer: CP(2), FSDP(2) x CP(2), CP(2) x TP(2) and PP(2) x CP(2) (the
ring) train like one process on the same global batches; tokens are counted once, not cp times;
validation under CP gives the one-process loss; a checkpoint saved under CP(2) resumes bitwise on CP(2) and
reshards into FSDP(2); ./run_train.sh trains CP(2); the sequence split's arithmetic is a pre-flight error."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.trainer.test_pipeline_training import JOB
from tests.trainer.test_train import _losses, _train_rank
from tests.world import run_world
from trainer.config import load_config
from trainer.preflight import check_config

REPO = Path(__file__).resolve().parents[2]
CP2 = ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return run_world(_train_rank, 1, [*JOB, "--job.dump_folder", str(tmp_path_factory.mktemp("one"))])[0]


def _tokens(lines: list[str]) -> str:
    return re.search(r"tokens ([\d,]+)", next(line for line in lines if line.startswith("summary")))[1]  # type: ignore[index]


@pytest.mark.parametrize(
    "world, layout",
    [
        (2, CP2),
        (4, ["--parallelism.context_parallel_degree", "2", "--training.local_batch_size", "2",
             "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"]),
        # FSDP(2) x CP(2) under op-level selective AC, which keeps the ring kernels' outputs
        (4, [*CP2, "--parallelism.tensor_parallel_degree", "2"]),  # CP(2) x TP(2): seq 64 / (2 x 2 x 2)
        (4, [*CP2, "--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.context_parallel_rotate_method", "alltoall"]),  # PP(2) x CP(2)
    ],
    ids=["cp2", "fsdp2_cp2_selective_ac", "cp2_tp2", "pp2_cp2_alltoall"],
)  # fmt: skip
def test_context_parallel_training_follows_one_process(
    tmp_path: Path, one_process: list[str], world: int, layout: list[str]
) -> None:
    lines = run_world(_train_rank, world, [*JOB, "--job.dump_folder", str(tmp_path), *layout])[0]
    losses, reference = _losses(lines), _losses(one_process)
    assert len(losses) == 4 and losses == pytest.approx(reference, abs=2e-4), (reference, losses)
    assert _tokens(lines) == _tokens(one_process) == "1,024"  # 4 steps x 4 x 64: counted once, not cp times


def test_a_cp_checkpoint_resumes_bitwise_and_reshards_into_fsdp(tmp_path: Path) -> None:
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false"]
    straight = _losses(run_world(_train_rank, 2, [*JOB, *ckpt, *CP2, "--job.dump_folder", str(tmp_path / "cp")])[0])
    for name, layout in (("cp_again", CP2), ("fsdp", ["--training.local_batch_size", "2"])):
        shutil.copytree(tmp_path / "cp" / "checkpoint" / "step-2", tmp_path / name / "checkpoint" / "step-2")
        argv = [*JOB, *ckpt, *layout, "--job.dump_folder", str(tmp_path / name)]
        resumed = _losses(run_world(_train_rank, 2, argv)[0])
        if name == "cp_again":
            assert resumed == straight[2:], (straight, resumed)
        else:
            assert resumed == pytest.approx(straight[2:], abs=2e-4), (straight, resumed)


def _validate_rank(argv: list[str]) -> list[str]:
    return _train_rank(argv, logger_name="trainer.validate")


def test_validation_under_cp_gives_one_process_loss(tmp_path: Path) -> None:
    val = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "2"]
    one = run_world(_validate_rank, 1, [*JOB, *val, "--job.dump_folder", str(tmp_path / "one")])[0]
    cp = run_world(_validate_rank, 2, [*JOB, *val, *CP2, "--job.dump_folder", str(tmp_path / "cp")])[0]
    losses = [
        [float(line.split("| loss ")[1].split()[0]) for line in lines if "validate step" in line] for lines in (one, cp)
    ]
    assert len(losses[0]) == 2 and losses[1] == pytest.approx(losses[0], abs=2e-4), losses


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--training.seq_len", "34"], r"training.seq_len\(34\) must be divisible by 2 x .*\(2\) x .*\(1\) = 4"),
        (["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "68"], r"= 8: context parallelism"),
        (["--validation.enable", "--validation.seq_len", "30"], r"validation.seq_len\(30\) must be divisible by 2 x"),
    ],
)
def test_a_sequence_cp_cannot_split_is_refused_with_the_arithmetic(overrides: list[str], message: str) -> None:
    cfg = load_config([*JOB, *CP2, *overrides])
    with pytest.raises(ValueError, match=message):
        check_config(cfg, world_size=4 if "--parallelism.tensor_parallel_degree" in overrides else 2)


@pytest.mark.e2e
def test_run_train_sh_trains_cp2_like_one_process(tmp_path: Path, one_process: list[str]) -> None:
    run = subprocess.run(
        ["./run_train.sh", *JOB, *CP2, "--job.dump_folder", str(tmp_path)], cwd=REPO,
        env={**os.environ, "NGPU": "2"}, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    lines = [line.split("trainer.metrics: ", 1)[1] for line in out.splitlines() if "trainer.metrics: step " in line]
    assert "mesh_dim_names=('cp',)" in out and _losses(lines) == pytest.approx(_losses(one_process), abs=2e-4), out
