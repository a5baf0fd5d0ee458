"""Where a rank runs, in the terms a multi-node user knows: the node (its agent's rank in the
rendezvous, torchrun's GROUP_RANK), the host, and the NODE_RANK its agent was started with.

The c10d rendezvous ignores NODE_RANK: it numbers the agents by sorting (host name, pid)
(`sorted(state.participants)` in torch/distributed/elastic/rendezvous/dynamic_rendezvous.py), and
torch 2.13 has no option to pin that order (only the static backend honours --node_rank, and it
gives up the re-rendezvous that MAX_RESTARTS relies on). So global rank 0, which writes the job's
INFO logs, TensorBoard and checkpoint commits, can run on the agent started with NODE_RANK=1, and
node 0's console then shows none of it. Every node therefore logs once where rank 0 runs.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger(__name__)

# Rank 0 publishes its place right after joining the world; the others wait this long for it (it
# only fails to come when rank 0 died at start, which brings the job down anyway).
RANK_ZERO_WAIT = timedelta(seconds=60)


@dataclass(frozen=True)
class Node:
    """One agent's node, as its workers see it."""

    group_rank: int | None  # torchrun's GROUP_RANK: the agent's rank in the rendezvous
    host: str
    node_rank: str | None  # NODE_RANK from the environment, as the user started the agent

    def __str__(self) -> str:
        name = "a node" if self.group_rank is None else f"node {self.group_rank}"
        started = "" if self.node_rank in (None, str(self.group_rank)) else f", started with NODE_RANK={self.node_rank}"
        return f"{name} ({self.host}{started})"

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> Node:
        return cls(**json.loads(text))


def this_node() -> Node:
    group_rank = os.environ.get("GROUP_RANK", "")
    return Node(int(group_rank) if group_rank.isdigit() else None, socket.gethostname(), os.environ.get("NODE_RANK"))


@dataclass(frozen=True)
class RankZero:
    """Where global rank 0 runs and where its output goes."""

    node: Node
    log_file: str | None  # torchrun's copy of its stderr (--tee), on that node

    def describe(self, here: Node) -> str:
        where = f"this node, {self.node}" if self.node == here else str(self.node)
        logs = f"that agent's console and {self.log_file}" if self.log_file else "that agent's console"
        return f"global rank 0 (INFO logs, TensorBoard, checkpoint commits) runs on {where}; its logs go to {logs}"


def locate_rank_zero(store: dist.Store, rank: int) -> RankZero | None:
    """Rank 0 publishes where it runs; every rank returns it (None if it never came). On a job that
    spans nodes, each node's local rank 0 logs it, at WARNING so that it shows on every console."""
    key = f"meshtrain/rank0/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if rank == 0:
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        log_file = os.path.join(os.path.dirname(error_file), "stderr.log") if error_file else None
        store.set(key, json.dumps({"node": this_node().encode(), "log_file": log_file}))
    try:
        store.wait([key], RANK_ZERO_WAIT)
        record = json.loads(store.get(key))
    except Exception as error:  # rank 0 is gone; its node's agent reports why
        logger.warning("could not learn where global rank 0 runs: %s", str(error).splitlines()[0])
        return None
    rank_zero = RankZero(Node.decode(record["node"]), record["log_file"])
    spans_nodes = os.environ.get("WORLD_SIZE") != os.environ.get("LOCAL_WORLD_SIZE")
    if spans_nodes and os.environ.get("LOCAL_RANK") == "0":
        logger.warning("%s", rank_zero.describe(this_node()))
    return rank_zero
