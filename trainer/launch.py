"""`python -m trainer.launch` is torchrun (same arguments), with a failure summary that names the
one real error instead of listing every rank, and one line instead of a traceback for the ways a
launcher itself ends (a signal, a lost rendezvous).

torchrun's own summary lists every rank that exited non-zero, including the peers it stopped
(SIGTERM) after the first failure, and picks its "root cause" by a timestamp in whole seconds, so a
bystander without an error file often wins the tie. Here the root cause is, in this order: a rank
that wrote a real error report (`trainer.process.failure` makes only the first failing rank write one); a
rank killed from outside (SIGKILL, SIGSEGV, ...: it could write nothing, and its peers' collectives
broke because of it); a rank whose report is only such a broken connection; then exit codes, then
the ranks the agent stopped. The rest are one line.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError, RendezvousTimeoutError
from torch.distributed.run import parse_args, run

from .process.log_prefix import prefix_teed_lines

# The signal the agent stops a job's other ranks with (torchrun's default death signal): a rank
# that died by it is a bystander, one that died by any other signal was killed by something else.
AGENT_STOP_SIGNAL = signal.SIGTERM

# A report with one of these is a follow-on: a peer went away mid-collective (gloo, NCCL, TCPStore).
BROKEN_CONNECTION = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Connection refused",
    "remote process exited or there was a network error",  # NCCL
)

# Why a rank died by a signal other than the agent's, as the summary says it.
SIGNAL_CAUSES = {
    signal.SIGKILL: "from outside: kill -9 or the kernel's OOM killer",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGBUS: "a bad memory access: often a truncated memory-mapped file or a full /dev/shm",
    signal.SIGABRT: "aborted by native code, e.g. a failed C++ check",
    signal.SIGINT: "interrupted",
}


def _killed_from_outside(failure: ProcessFailure) -> bool:
    return failure.exitcode < 0 and -failure.exitcode != AGENT_STOP_SIGNAL


def _report_text(failure: ProcessFailure) -> str:
    if not isinstance(failure.message, dict):
        return ""
    extra = failure.message.get("extraInfo", {})
    return str(extra.get("py_callstack") or failure.message.get("message", ""))


def _blame_tier(failure: ProcessFailure) -> int:
    """0 a real error report, 1 killed from outside, 2 a broken-connection report, 3 an error exit
    code, 4 stopped by the agent."""
    report = _report_text(failure)
    if report and not any(text in report for text in BROKEN_CONNECTION):
        return 0
    if _killed_from_outside(failure):
        return 1
    if report:
        return 2
    return 3 if failure.exitcode > 0 else 4


def root_cause(failures: dict[int, ProcessFailure]) -> int:
    """The rank to blame: a real error report, a rank killed from outside, a broken-connection
    report, an error exit code, a rank the agent stopped; the earliest within each."""
    return min(failures, key=lambda rank: (_blame_tier(failures[rank]), failures[rank].timestamp, rank))


def _exit_reason(failure: ProcessFailure) -> str:
    return f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"


def _signal_detail(rank: int, failure: ProcessFailure) -> str:
    try:
        cause = SIGNAL_CAUSES.get(signal.Signals(-failure.exitcode))
    except ValueError:
        cause = None
    return f"rank {rank} was killed by {failure.signal_name()}" + (f" ({cause})" if cause else "")


def failure_summary(error: ChildFailedError) -> str:
    rank = root_cause(error.failures)
    failure = error.failures[rank]
    tier = _blame_tier(failure)
    if tier == 1:  # its report, if any, is a follow-on: the signal is the news
        detail = _signal_detail(rank, failure)
    elif tier in (0, 2):
        detail = _report_text(failure)
    else:
        detail = f"{failure.message} (it left no error report)"
    lines = [f"{error.name} failed on rank {rank} (local rank {failure.local_rank}, {_exit_reason(failure)}):"]
    lines.append(detail.rstrip("\n"))
    others = {r: f for r, f in error.failures.items() if r != rank}
    if others:
        how = ", ".join(
            f"{r} ({f.signal_name()})" if f.exitcode < 0 else f"{r} (exit code {f.exitcode})"
            for r, f in sorted(others.items())
        )
        lines.append(f"stopped with it: rank {how}" if len(others) == 1 else f"stopped with it: ranks {how}")
    return "\n".join(lines)


def _first_line(error: BaseException) -> str:
    first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def launcher_error_summary(error: Exception, endpoint: str) -> str:
    """One line for an error of the agent itself (not of a rank): most often the rendezvous store,
    hosted by the agent of the first node, went away with that node. The C++ frames that store
    errors carry ("frame #0: ...") say nothing to a user, so only the first line is kept."""
    what = _first_line(error)
    if error.__cause__ is not None:  # "The connection to the C10d store has failed. See inner exception"
        what += f" ({_first_line(error.__cause__)})"
    if isinstance(error, RendezvousTimeoutError):
        return f"the job stopped: the rendezvous at {endpoint} timed out (did every node start?): {what}"
    if isinstance(error, RendezvousClosedError):
        return f"the job stopped: the rendezvous at {endpoint} was closed by another node: {what}"
    if isinstance(error, (RendezvousError, dist.DistError)):
        return f"the job stopped: the rendezvous store at {endpoint} went away or cannot be reached: {what}"
    return f"the job stopped: torchrun's agent failed: {what}"


def rank_log_dir(args: Any) -> str | None:
    """Where torchrun keeps every rank's stdout and stderr (`--tee`): `<job.dump_folder>/logs` for the
    trainer, beside the job's other outputs, instead of an anonymous /tmp/torchelastic_* folder that
    outlives it; each launch adds its own `<run id>_<suffix>/attempt_<n>/<rank>/` under it. None (torchrun's
    default) for another script, or when the config cannot be read (the pre-flight has said why)."""
    script_args = list(args.training_script_args)
    if args.log_dir or not (args.module and args.training_script == "trainer.train") or "--help" in script_args:
        return args.log_dir
    from .config import load_config

    try:
        cfg = load_config(script_args)
    except (ValueError, TypeError, OSError):
        return None
    return str(Path(cfg.job.dump_folder) / "logs")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.log_dir = rank_log_dir(args)
    if args.tee not in (None, "", "0"):  # only teed streams are prefixed
        prefix_teed_lines()
    endpoint = "(the local one of --standalone)" if args.standalone else args.rdzv_endpoint
    try:
        run(args)
    except ChildFailedError as error:
        print(failure_summary(error), file=sys.stderr)
        return 1
    except SignalException as error:  # the agent stopped the ranks, then re-raised the signal it got
        print(f"stopped by {error.sigval.name}: the ranks were stopped", file=sys.stderr)
        return 128 + error.sigval
    except Exception as error:
        print(launcher_error_summary(error, endpoint), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
