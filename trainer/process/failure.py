"""One report per failing job: the rank that failed first tells, the others stop quietly.

In an SPMD job an error usually strikes every rank at once (the same bad input, the same NaN), or
strikes one rank and then every peer fails in a collective ("connection closed by peer"). Either
way each rank printing its traceback buries the cause, and torchrun's summary may name a bystander
as the root cause. Here the ranks race to claim the failure in the job's store: the winner logs one
line and writes torchrun's error file (which `trainer.launch` prints once, with its traceback); the
others log who failed first and wait for the agent to stop them, so they leave no report at all.

Across nodes an agent only watches its own ranks: when the first failure is on another node (or the
rank that hosts the store, rank 0, went away there), a rank here reports that failure, naming the
node, and exits at once, so this node's launcher prints which node was lost instead of waiting.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import NoReturn

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from .nodes import Node, RankZero, this_node

logger = logging.getLogger(__name__)

# How long a bystander waits for torchrun to stop it once the first failing rank has exited; it
# exits by itself after that (e.g. on another node, whose agent only learns of it at rendezvous).
BYSTANDER_GRACE_S = 30.0
# The first failure of a rank whose agent died (trainer.process.lifeline): the rank was lost with its node.
AGENT_DIED = "its torchrun agent died"


def under_torchelastic() -> bool:
    """Launched by torchrun (or trainer.launch), which reads a per-rank error file."""
    return "TORCHELASTIC_ERROR_FILE" in os.environ


@dataclass(frozen=True)
class FirstFailure:
    """The job's first failure, as the rank that claimed it recorded it."""

    rank: int
    node: Node
    summary: str  # one line: "ValueError: ...", or AGENT_DIED

    def __str__(self) -> str:
        what = f"was lost: {self.summary}" if self.summary == AGENT_DIED else f"failed first: {self.summary}"
        return f"rank {self.rank} on {self.node} {what}"


def claim_first_failure(rank: int, summary: str) -> FirstFailure | None:
    """Record (rank, this node, summary) as the job's first failure unless one is recorded; returns
    the first failure, or None when the store cannot be reached (its host rank is gone, so it failed
    first)."""
    key = f"meshtrain/first_failure/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        store = dist.distributed_c10d._get_default_store()
        first = store.compare_set(key, "", f"{rank}\t{this_node().encode()}\t{summary}").decode()
    except Exception:
        return None
    first_rank, node, first_summary = first.split("\t", 2)
    return FirstFailure(int(first_rank), Node.decode(node), first_summary)


def claim_agent_died() -> None:
    """trainer.process.lifeline's last word: this rank's agent died, so the job lost this node. Claimed so
    that the peers on other nodes, whose collectives break next, report this node as the cause."""
    if dist.is_initialized():
        claim_first_failure(dist.get_rank(), AGENT_DIED)


def report_failure(error: Exception, rank_zero: RankZero | None = None) -> NoReturn:
    """Call in an `except` block under torchelastic, in a joined world. Never returns: exits with 1.

    `rank_zero` (trainer.process.nodes.locate_rank_zero) names the store's host when the store is gone.
    Exits without the normal teardown: a failed rank's peers may sit in collectives that will never
    complete, and destroying its process groups could wait on them. Committed checkpoints are safe
    (a save commits by rename); an interrupted one is removed at the next start.
    """
    rank = dist.get_rank()
    here = this_node()
    summary = f"{type(error).__name__}: {error}".splitlines()[0][:500]
    first = claim_first_failure(rank, summary)
    if first is not None and first.rank == rank:
        logger.error("rank %d failed: %s", rank, summary)
        ErrorHandler().record_exception(error)  # the traceback, printed once by trainer.launch / torchrun
        _exit(1)
    if first is not None:
        logger.warning("rank %d stops: rank %d failed first (%s)", rank, first.rank, first.summary)
        if first.node.group_rank != here.group_rank:  # this node's agent knows nothing of it
            _report_and_exit(str(first))
    else:
        logger.warning("rank %d stops: %s, after the job's store host (rank 0) went away", rank, summary)
        if rank_zero is not None and rank_zero.node.group_rank != here.group_rank:
            _report_and_exit(f"rank 0 on {rank_zero.node}, the host of the job's store, went away (see that node)")
    _flush()
    time.sleep(BYSTANDER_GRACE_S)  # torchrun stops this process once the first failing rank has exited
    _exit(1)


def _report_and_exit(message: str) -> NoReturn:
    """torchrun's error file with `message` alone (the failure is elsewhere; a traceback here would
    only show this rank's broken collective), then exit 1."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        report = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
        with open(error_file, "w") as f:
            json.dump(report, f)
    _exit(1)


def _flush() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()


def _exit(code: int) -> NoReturn:
    _flush()
    os._exit(code)
