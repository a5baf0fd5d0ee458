"""One report per failing job: the rank that failed first tells, the others stop quietly.

In an SPMD job an error usually strikes every rank at once (the same bad input, the same NaN), or
strikes one rank and then every peer fails in a collective ("connection closed by peer"). Either
way each rank printing its traceback buries the cause, and torchrun's summary may name a bystander
as the root cause. Here the ranks race to claim the failure in the job's store: the winner logs one
line and writes torchrun's error file (which `trainer.launch` prints once, with its traceback); the
others log who failed first and wait for the agent to stop them, so they leave no report at all.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import NoReturn

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

logger = logging.getLogger(__name__)

# How long a bystander waits for torchrun to stop it once the first failing rank has exited; it
# exits by itself after that (e.g. on another node, whose agent only learns of it at rendezvous).
BYSTANDER_GRACE_S = 30.0


def under_torchelastic() -> bool:
    """Launched by torchrun (or trainer.launch), which reads a per-rank error file."""
    return "TORCHELASTIC_ERROR_FILE" in os.environ


def claim_first_failure(rank: int, summary: str) -> tuple[int, str] | None:
    """Record (rank, summary) as the job's first failure unless one is recorded; returns the first
    failure, or None when the store cannot be reached (its host rank is gone, so it failed first)."""
    key = f"meshtrain/first_failure/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        store = dist.distributed_c10d._get_default_store()
        first = store.compare_set(key, "", f"{rank}\t{summary}").decode()
    except Exception:
        return None
    first_rank, _, first_summary = first.partition("\t")
    return int(first_rank), first_summary


def report_failure(error: Exception) -> NoReturn:
    """Call in an `except` block under torchelastic, in a joined world. Never returns: exits with 1.

    Exits without the normal teardown: a failed rank's peers may sit in collectives that will never
    complete, and destroying its process groups could wait on them. Committed checkpoints are safe
    (a save commits by rename); an interrupted one is removed at the next start.
    """
    rank = dist.get_rank()
    summary = f"{type(error).__name__}: {error}".splitlines()[0][:500]
    first = claim_first_failure(rank, summary)
    if first is not None and first[0] == rank:
        logger.error("rank %d failed: %s", rank, summary)
        ErrorHandler().record_exception(error)  # the traceback, printed once by trainer.launch / torchrun
        _exit(1)
    if first is not None:
        logger.warning("rank %d stops: rank %d failed first (%s)", rank, first[0], first[1])
    else:
        logger.warning("rank %d stops: %s, after the job's store host (rank 0) went away", rank, summary)
    _flush()
    time.sleep(BYSTANDER_GRACE_S)  # torchrun stops this process once the first failing rank has exited
    _exit(1)


def _flush() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()


def _exit(code: int) -> NoReturn:
    _flush()
    os._exit(code)
