"""The job's processes end the way a cluster ends them: a rank whose agent died stops (trainer.process.lifeline),
a signal to the launcher stops the job with one line and 128+signal, an error of torchrun's own agent
is one line, and run_train.sh counts GPUs without importing torch.

`Job` (a ./run_train.sh under test: its output as it comes, its ranks, everything killed at the end)
is shared with test_multinode.py and test_failure_report.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from tests.trainer.test_resume import _children as children
from trainer import launch

REPO = Path(__file__).resolve().parents[2]
# The shortest job that is still training when the test strikes: tiny windows, and more steps than
# it can reach before the test kills or signals it (so a broken fix shows as a timeout, not a pass).
TRAIN_ARGS = ["--training.seq_len", "64", "--training.steps", "2000"]


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its new parent, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive after up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=", 1)[1])


class Job:
    """One ./run_train.sh (its agent once it has exec'd), its output collected as it comes."""

    def __init__(self, args: list[str], **env: str) -> None:
        base = {k: v for k, v in os.environ.items() if k not in ("LOG_RANK", "CONFIG_FILE", "NGPU")}
        self.proc = subprocess.Popen(
            ["./run_train.sh", *args], cwd=REPO, env={**base, **env},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.lines: list[str] = []
        self.ranks: list[int] = []  # the rank pids, once noted: killed at the end
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        self._reader.join(0.5 if self.proc.poll() is not None else 0)
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float) -> None:
        """Until `text` is in the output, then note the ranks running."""
        deadline = time.monotonic() + timeout
        while text not in "".join(self.lines):
            assert self.proc.poll() is None and time.monotonic() < deadline, f"no {text!r}:\n{self.output[-3000:]}"
            time.sleep(0.05)
        self.ranks = children(self.proc.pid)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {timeout:.0f} s later:\n{self.output[-3000:]}")

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.ranks]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


# -------------------------------------------------------------------- run_train.sh counts GPUs
_STUB_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "{calls}"
"""


@pytest.mark.parametrize(
    ("gpus", "visible", "nproc"),
    [(None, None, 2), (4, None, 4), (4, "1,3", 2), (4, "", 2), (4, "0,-1,2", 1), (2, "0,1,2,3", 2)],
)
def test_run_train_counts_gpus_without_importing_torch(
    tmp_path: Path, gpus: int | None, visible: str | None, nproc: int
) -> None:
    """NGPU unset: nvidia-smi's GPUs (narrowed by CUDA_VISIBLE_DEVICES), else 2 CPU ranks, and no
    `python -c "import torch"` (5-15 s) before the pre-flight. `python` and `nvidia-smi` are stubs."""
    calls = tmp_path / "calls"
    (tmp_path / "python").write_text(_STUB_PYTHON.format(calls=calls))
    listing = "".join(f"GPU {i}: Stub GPU (UUID: GPU-{i})\\n" for i in range(gpus or 0))
    smi = f"printf '{listing}'" if gpus else "echo 'NVIDIA-SMI has failed: no driver' >&2; exit 9"
    (tmp_path / "nvidia-smi").write_text(f"#!/usr/bin/env bash\n{smi}\n")
    for stub in ("python", "nvidia-smi"):
        (tmp_path / stub).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("NGPU", "CUDA_VISIBLE_DEVICES", "NNODES")}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    run = subprocess.run(["./run_train.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    invocations = calls.read_text().splitlines()
    assert [line.split()[:2] for line in invocations] == [["-m", "trainer.preflight"], ["-m", "trainer.launch"]]
    assert f"--nproc_per_node={nproc} " in invocations[1], invocations[1]


# ------------------------------------------------------------------------- 13: the lifeline
_ORPHAN = """
import os, subprocess, sys, time
log = open({log!r}, "w")
child = subprocess.Popen([sys.executable, "-c", {rank!r}], start_new_session=True, stdout=log, stderr=log)
print(child.pid, flush=True)
time.sleep(120)
"""
_RANK = """
import time
from trainer.process.lifeline import watch_agent
watch_agent(on_lost=lambda: print("last word", flush=True))
print("training", flush=True)
time.sleep(120)
"""


def test_a_rank_stops_within_seconds_when_its_agent_is_killed(tmp_path: Path) -> None:
    """kill -9 of the agent (here a stand-in parent) stops the rank: before, it ran on as an orphan."""
    log = tmp_path / "rank.log"
    code = textwrap.dedent(_ORPHAN).format(rank=textwrap.dedent(_RANK), log=str(log))
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "test", "PYTHONPATH": str(REPO)}
    agent = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None
        rank = int(agent.stdout.readline())
        deadline = time.monotonic() + 30
        while "training" not in (log.read_text() if log.exists() else ""):
            assert alive(rank) and time.monotonic() < deadline, "the stand-in rank never started"
            time.sleep(0.05)
        agent.kill()
        agent.wait()
        assert wait_gone([rank], 5) == [], "the rank outlived its agent by 5 s"
        said = log.read_text()
        assert "its torchrun agent (pid" in said and "died" in said and "last word" in said, said
    finally:
        agent.kill()
        if alive(rank):
            os.kill(rank, signal.SIGKILL)


# --------------------------------------------------------- 15, 17: how the launcher itself ends
def _launch_raising(monkeypatch: pytest.MonkeyPatch, error: BaseException, *argv: str) -> int:
    def run(args: object) -> None:
        raise error

    monkeypatch.setattr(launch, "run", run)
    return launch.main([*argv, "--nproc_per_node=1", "train.py"])


def test_a_signal_to_the_launcher_exits_128_plus_it_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for sig, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
        error = SignalException(f"Process 1 got signal: {sig}", sigval=sig)
        assert _launch_raising(monkeypatch, error, "--standalone") == code
        assert capsys.readouterr().err == f"stopped by {sig.name}: the ranks were stopped\n"


def test_a_lost_rendezvous_store_is_one_line_without_cpp_frames(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As torchrun's agent sees node 0 go: a RendezvousConnectionError caused by a store error that
    carries C++ frames. Before, a traceback with both (and the frames)."""
    frames = "".join(f"frame #{i}: c10::DistError::DistError(...) + 0x72\n" for i in range(20))
    error = RendezvousConnectionError("The connection to the C10d store has failed. See inner exception for details.")
    error.__cause__ = dist.DistNetworkError(f"Broken pipe\nException raised from sendBytes at Utils.hpp:758:\n{frames}")
    argv = ("--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=10.0.0.1:29400")
    assert _launch_raising(monkeypatch, error, *argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "frame #" not in err, err
    assert "the rendezvous store at 10.0.0.1:29400 went away or cannot be reached" in err, err
    assert "RendezvousConnectionError: The connection to the C10d store has failed" in err, err
    assert "(DistNetworkError: Broken pipe)" in err, err


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["fsdp2", "pp2"])
def test_sigterm_to_the_launcher_saves_a_last_checkpoint_and_exits_143_with_one_line(
    tmp_path: Path, layout: str
) -> None:
    """A scheduler's preemption: before, a 28-line SignalException traceback, exit code 1 and the steps since
    the last save lost. Now every rank saves the step it was in (one agreed step) and the job exits 143,
    holding no process group past its teardown (PP's once warned that the default group was still referenced)."""
    from checkpoint.manager import committed_steps
    from checkpoint.step_folders import StepKind, step_kind

    args = [*TRAIN_ARGS, "--job.dump_folder", str(tmp_path), "--checkpoint.enable", "--checkpoint.interval", "1000"]
    args += _POINT_TO_POINT["pp2"] if layout == "pp2" else []
    job = Job(args, NGPU="2", LOG_RANK="0,1")
    try:
        job.wait_for("step 2 |", timeout=120)
        job.proc.send_signal(signal.SIGTERM)
        assert job.wait(timeout=30) == 128 + signal.SIGTERM, job.output[-3000:]
        out = job.output
        assert "stopped by SIGTERM: the ranks were stopped" in out, out[-3000:]
        assert "Traceback" not in out and "SignalException" not in out, out[-3000:]  # not the agent's, nor a rank's
        assert wait_gone(job.ranks, 5) == []
        steps = committed_steps(tmp_path / "checkpoint")
        assert len(steps) == 1 and steps[0] >= 2, (steps, out[-3000:])
        assert step_kind(tmp_path / "checkpoint" / f"step-{steps[0]}") == StepKind.RESUMABLE
        assert f"SIGTERM: stopping after step {steps[0]}, its checkpoint saved" in out, out[-3000:]
        assert "still referenced after destroy_process_group()" not in out, out[-3000:]
    finally:
        job.kill()


# ------------------------------------------------------------- a hung rank under point-to-point transfers
_POINT_TO_POINT = {
    "pp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    "cp2_ring": ["--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                 "--parallelism.context_parallel_rotate_method", "alltoall"],
}  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize("layout", list(_POINT_TO_POINT))
def test_a_hung_rank_fails_the_job_at_the_train_timeout_under_point_to_point(tmp_path: Path, layout: str) -> None:
    """SIGSTOP of one rank after the first steps. Before: gloo's sends and receives waited on the timeout their
    group was made with (comm.init_timeout_seconds, 300 s) and ignored comm.train_timeout_seconds."""
    args = [*TRAIN_ARGS, *_POINT_TO_POINT[layout], "--comm.train_timeout_seconds", "5",
            "--comm.init_timeout_seconds", "600", "--job.dump_folder", str(tmp_path)]  # fmt: skip
    job = Job(args, NGPU="2")
    try:
        job.wait_for("step 3 |", timeout=180)  # the train timeout holds from the second step on
        hung = job.ranks[-1]
        os.kill(hung, signal.SIGSTOP)
        start = time.monotonic()
        while "did not complete within 5 s" not in "".join(job.lines):  # the other rank gives up at the timeout
            assert time.monotonic() - start < 60, job.output[-3000:]
            time.sleep(0.05)
        os.kill(hung, signal.SIGCONT)  # so the agent's SIGTERM ends it now, not after its grace period
        assert job.wait(timeout=60) != 0, job.output[-3000:]
    finally:
        for pid in job.ranks:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
        job.kill()
