"""One live job per dump folder: a second job is refused on every rank, naming the holder; a
finished or crashed job leaves no stale lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.test_train import _SHORT_DEBUG_JOB, _train_rank
from tests.world import WorldError, run_world
from trainer.process.dump_folder import DumpFolderLock

_HOLD = (
    "import sys; from trainer.process.dump_folder import DumpFolderLock as L; "
    "assert L(sys.argv[1]).try_acquire() is None"
)


def test_a_second_job_in_a_live_dump_folder_is_refused_on_every_rank(tmp_path: Path) -> None:
    held = DumpFolderLock(tmp_path)
    assert held.try_acquire() is None
    try:
        with pytest.raises(WorldError) as err:
            run_world(_train_rank, 2, [*_SHORT_DEBUG_JOB, "--job.dump_folder", str(tmp_path)])
        message = str(err.value)
        assert message.count("is in use by a running job") == 2, message[-2000:]  # both ranks stop
        assert "running job (pid " in message, "rank 0 names the holder"
        assert not (tmp_path / "config.toml").exists(), "the refused job wrote into the folder"
    finally:
        held.release()
    run_world(_train_rank, 2, [*_SHORT_DEBUG_JOB, "--job.dump_folder", str(tmp_path)])  # free again


def test_the_lock_dies_with_its_process(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", _HOLD, str(tmp_path)], cwd=root, check=True, timeout=60)  # exits holding
    lock = DumpFolderLock(tmp_path)
    assert lock.try_acquire() is None
    lock.release()
