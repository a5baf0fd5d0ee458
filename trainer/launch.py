"""`python -m trainer.launch` is torchrun (same arguments), with a failure summary that names the
one real error instead of listing every rank.

torchrun's own summary lists every rank that exited non-zero, including the peers it stopped
(SIGTERM) after the first failure, and picks its "root cause" by a timestamp in whole seconds, so a
bystander without an error file often wins the tie. Here the root cause is the rank that wrote an
error file (`trainer.failure` makes only the first failing rank write one), and the rest are one
line.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import parse_args, run


def root_cause(failures: dict[int, ProcessFailure]) -> int:
    """The rank to blame: the earliest with an error file, else the earliest that exited with an
    error code rather than a signal, else the earliest."""

    def blame_order(rank: int) -> tuple[bool, bool, int, int]:
        failure = failures[rank]
        return (not isinstance(failure.message, dict), failure.exitcode < 0, failure.timestamp, rank)

    return min(failures, key=blame_order)


def failure_summary(error: ChildFailedError) -> str:
    rank = root_cause(error.failures)
    failure = error.failures[rank]
    if isinstance(failure.message, dict):
        extra = failure.message.get("extraInfo", {})
        detail = extra.get("py_callstack") or failure.message.get("message", "")
    else:
        detail = f"{failure.message} (it left no error report)\n"
    lines = [f"{error.name} failed on rank {rank} (local rank {failure.local_rank}, exit code {failure.exitcode}):"]
    lines.append(detail.rstrip("\n"))
    others = {r: f for r, f in error.failures.items() if r != rank}
    if others:
        how = ", ".join(
            f"{r} ({f.signal_name()})" if f.exitcode < 0 else f"{r} (exit code {f.exitcode})"
            for r, f in sorted(others.items())
        )
        lines.append(f"stopped with it: rank {how}" if len(others) == 1 else f"stopped with it: ranks {how}")
    return "\n".join(lines)


def _exit_reason(failure: ProcessFailure) -> str:
    return failure.signal_name() if failure.exitcode < 0 else f"exit code {failure.exitcode}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as error:
        print(failure_summary(error), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
