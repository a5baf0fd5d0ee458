"""A failing job reports its error once: the first failing rank's traceback in the launcher's
summary, one line per stopped peer, no traceback from anyone else."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from tests.world import run_world
from trainer.failure import claim_first_failure
from trainer.launch import root_cause

REPO = Path(__file__).resolve().parents[2]


def _claim(rank_delay: float) -> tuple[int, str] | None:
    time.sleep(rank_delay * dist.get_rank())  # rank 0 first, then 1, 2, 3
    first = claim_first_failure(dist.get_rank(), f"ValueError: from rank {dist.get_rank()}")
    dist.barrier()
    return first


def test_every_rank_agrees_on_the_first_failure() -> None:
    assert run_world(_claim, 4, 0.2) == [(0, "ValueError: from rank 0")] * 4


def _failure(tmp_path: Path, local_rank: int, exitcode: int, *, report: bool, timestamp: int) -> ProcessFailure:
    error_file = tmp_path / f"error-{local_rank}.json"
    if report:
        info = {"py_callstack": "Traceback ...\nValueError: bad", "timestamp": str(timestamp)}
        error_file.write_text(json.dumps({"message": {"message": "ValueError: bad", "extraInfo": info}}))
    return ProcessFailure(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode, error_file=str(error_file))


def test_the_root_cause_is_the_rank_with_a_report_not_an_earlier_bystander(tmp_path: Path) -> None:
    now = int(time.time())
    failures = {
        0: _failure(tmp_path, 0, -15, report=False, timestamp=now),  # SIGTERMed peer, stamped "now"
        1: _failure(tmp_path, 1, 1, report=False, timestamp=now),  # exited on its own, no report
        2: _failure(tmp_path, 2, 1, report=True, timestamp=now + 5),
    }
    failures[0].timestamp = failures[1].timestamp = now - 10  # even when the bystanders look earlier
    assert root_cause(failures) == 2
    del failures[2]
    assert root_cause(failures) == 1  # no report anywhere: an exit code beats a signal


@pytest.mark.e2e
def test_a_diverging_job_reports_its_error_once(tmp_path: Path) -> None:
    env = {**os.environ, "NGPU": "2", "LOG_RANK": "0,1"}  # both ranks' output shown: still one traceback
    run = subprocess.run(
        ["./run_train.sh", "--optimizer.lr", "1e6", "--job.dump_folder", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert out.count("Traceback (most recent call last)") == 1, out
    summary = next(line for line in out.splitlines() if line.startswith("trainer.train failed on rank"))
    first = int(summary.split()[4])
    assert f"rank {first} failed: FloatingPointError: step" in out
    assert f"stopped with it: rank {1 - first} (SIGTERM)" in out
    assert sum(line.startswith("FloatingPointError: step") for line in out.splitlines()) == 1  # the summary's
    assert len(out.splitlines()) < 60, out
