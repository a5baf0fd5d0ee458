"""Two torchrun agents (NNODES=2, c10d rendezvous on 127.0.0.1) train one job together through
./run_train.sh, and both exit 0."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_two_nodes_train_one_job(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("LOG_RANK", "CONFIG_FILE")}
    env.update(NGPU="1", NNODES="2", RDZV_ENDPOINT=endpoint)
    args = ["--training.steps", "2", "--training.seq_len", "64", "--job.dump_folder", str(tmp_path)]
    nodes = [
        subprocess.Popen(
            ["./run_train.sh", *args],
            cwd=REPO,
            env={**env, "NODE_RANK": str(n)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for n in range(2)
    ]
    outputs = [node.communicate(timeout=240)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "dp_shard" in outputs[0] and "[0, 1]" in outputs[0], outputs[0][-3000:]  # one mesh over both nodes
    assert "step 2 |" in outputs[0], outputs[0][-3000:]
