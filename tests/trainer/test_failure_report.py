"""A failing job reports its error once: the first failing rank's traceback in the launcher's
summary, one line per stopped peer, no traceback from anyone else."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from tests.trainer.test_processes import TRAIN_ARGS, Job, rank_of, wait_gone
from tests.world import run_world
from trainer.launch import failure_summary, root_cause
from trainer.process.failure import claim_first_failure

REPO = Path(__file__).resolve().parents[2]


def _claim(rank_delay: float) -> tuple[int, str] | None:
    time.sleep(rank_delay * dist.get_rank())  # rank 0 first, then 1, 2, 3
    first = claim_first_failure(dist.get_rank(), f"ValueError: from rank {dist.get_rank()}")
    dist.barrier()
    return None if first is None else (first.rank, first.summary)


def test_every_rank_agrees_on_the_first_failure() -> None:
    assert run_world(_claim, 4, 0.2) == [(0, "ValueError: from rank 0")] * 4


def _failure(
    tmp_path: Path, local_rank: int, exitcode: int, *, report: bool, timestamp: int, error: str = "ValueError: bad"
) -> ProcessFailure:
    error_file = tmp_path / f"error-{local_rank}.json"
    if report:
        info = {"py_callstack": f"Traceback ...\n{error}", "timestamp": str(timestamp)}
        error_file.write_text(json.dumps({"message": {"message": error, "extraInfo": info}}))
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


RESET = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:4242: Connection reset by peer"


def test_a_rank_killed_by_a_signal_is_the_root_cause_not_its_peers_broken_connections(tmp_path: Path) -> None:
    """SIGKILL of rank 1 mid-collective: rank 0 reports the reset connection first and the agent
    stops rank 2. Before, rank 0's follow-on was the root cause and the killed rank "stopped with it"."""
    now = int(time.time())
    failures = {
        0: _failure(tmp_path, 0, 1, report=True, timestamp=now - 5, error=RESET),  # earlier, with a report
        1: _failure(tmp_path, 1, -signal.SIGKILL, report=False, timestamp=now),
        2: _failure(tmp_path, 2, -signal.SIGTERM, report=False, timestamp=now - 10),  # the agent's stop
    }
    assert root_cause(failures) == 1
    summary = failure_summary(ChildFailedError("trainer.train", failures))
    assert summary.splitlines() == [
        "trainer.train failed on rank 1 (local rank 1, killed by SIGKILL):",
        "rank 1 was killed by SIGKILL (from outside: kill -9 or the kernel's OOM killer)",
        "stopped with it: ranks 0 (exit code 1), 2 (SIGTERM)",
    ]
    failures[1] = _failure(tmp_path, 1, -signal.SIGSEGV, report=False, timestamp=now)
    assert root_cause(failures) == 1 and "killed by SIGSEGV (a crash in native code)" in failure_summary(
        ChildFailedError("trainer.train", failures)
    )
    failures[3] = _failure(tmp_path, 3, 1, report=True, timestamp=now + 5, error="FloatingPointError: step 3")
    assert root_cause(failures) == 3  # a real error report still wins over a signal
    del failures[1], failures[3]
    assert root_cause(failures) == 0  # no signal from outside: the broken connection beats the agent's SIGTERM


@pytest.mark.e2e
def test_a_rank_killed_during_a_checkpoint_save_is_named_the_root_cause(tmp_path: Path) -> None:
    """kill -9 of rank 1 while every step saves: its peer's "Connection reset by peer" is not the cause."""
    args = [*TRAIN_ARGS, "--checkpoint.enable", "--checkpoint.interval", "1", "--job.dump_folder", str(tmp_path)]
    args[args.index("--training.steps") + 1] = "8"
    job = Job(args, NGPU="2")
    try:
        job.wait_for("step 2 |", timeout=120)
        victim = next(pid for pid in job.ranks if rank_of(pid) == 1)
        os.kill(victim, signal.SIGKILL)
        assert job.wait(timeout=60) == 1, job.output[-3000:]
        out = job.output
        summary = out[out.index("trainer.train failed on rank") :]
        assert summary.startswith("trainer.train failed on rank 1 (local rank 1, killed by SIGKILL):"), out[-3000:]
        assert "rank 1 was killed by SIGKILL (from outside: kill -9 or the kernel's OOM killer)" in summary
        assert re.search(r"stopped with it: rank 0 \((exit code 1|SIGTERM)\)", summary), summary
        assert "Connection reset" not in summary, summary
        assert wait_gone(job.ranks, 5) == []
    finally:
        job.kill()


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
    # every rank's whole output stays beside the job's other outputs (torchrun's --tee files), not in /tmp
    (attempt,) = (tmp_path / "logs").glob("*/attempt_0")
    assert sorted(p.name for p in attempt.iterdir() if p.is_dir()) == ["0", "1"]
    kept = (attempt / str(first) / "stderr.log").read_text()
    assert "trainer.metrics: step 1 |" in kept and f"rank {first} failed: FloatingPointError" in kept, kept


def test_the_launcher_keeps_rank_logs_in_the_dump_folder(tmp_path: Path) -> None:
    from torch.distributed.run import parse_args

    from trainer.launch import rank_log_dir

    trainer = ["--standalone", "--tee", "3", "-m", "trainer.train", "--job.dump_folder", str(tmp_path / "job")]
    assert rank_log_dir(parse_args(trainer)) == str(tmp_path / "job" / "logs")
    assert rank_log_dir(parse_args(["--log-dir", "/elsewhere", *trainer])) == "/elsewhere"  # the user's choice
    assert rank_log_dir(parse_args(["-m", "other.module", "--job.dump_folder", "x"])) is None  # not ours: torchrun's
    assert rank_log_dir(parse_args(["-m", "trainer.train", "--training.steps", "many"])) is None  # the pre-flight says
