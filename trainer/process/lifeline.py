"""A rank lives only as long as its torchrun agent.

torchrun starts each rank in a session of its own (so that it can signal the rank's process group),
so when the agent is killed (`kill -9`, a lost node) nothing stops its ranks: they train on as
orphans, their output lost, writing checkpoints nobody asked for, and on a multi-node job the other
nodes never learn that this one is gone. Here a daemon thread polls the parent pid recorded at
start; once the parent changes (the orphan was re-parented to init or a subreaper), the rank logs
one line, gives the job its last word (`on_lost`, e.g. claiming the job's first failure so that
peers on other nodes name this node), and exits.

Polling rather than prctl(PR_SET_PDEATHSIG): the death signal fires when the *thread* that forked
the rank exits, not the agent, and a signal would kill the rank before it can tell its peers why.
This module imports no torch, so a test can watch it in a bare interpreter.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often the parent pid is checked: the ranks stop within about this long
LAST_WORD_S = 5.0  # at most this long for on_lost (a store on a dead host may not answer)
EXIT_CODE = 1


def watch_agent(on_lost: Callable[[], None] | None = None) -> threading.Thread | None:
    """Exit this process when its agent (the parent now) dies; a no-op outside torchelastic.
    Call early, before anything that can block (the rendezvous of the process group)."""
    if "TORCHELASTIC_ERROR_FILE" not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
        return None  # started by hand or by a test's world: its parent is no agent
    thread = threading.Thread(
        target=_watch, args=(os.getppid(), on_lost), name="meshtrain-lifeline", daemon=True
    )  # fmt: skip
    thread.start()
    return thread


def _watch(agent_pid: int, on_lost: Callable[[], None] | None) -> None:
    while os.getppid() == agent_pid:
        time.sleep(POLL_S)
    rank = os.environ.get("RANK", "?")
    logger.error("rank %s stops: its torchrun agent (pid %d) died", rank, agent_pid)
    if on_lost is not None:
        last_word = threading.Thread(target=on_lost, name="meshtrain-lifeline-last-word", daemon=True)
        last_word.start()
        last_word.join(LAST_WORD_S)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the agent held the other end of a pipe
            pass
    os._exit(EXIT_CODE)  # not sys.exit: the main thread may sit in a collective that never returns
