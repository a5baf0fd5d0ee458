"""Two torchrun agents (NNODES=2, c10d rendezvous on 127.0.0.1) train one job together through
multinode_trainer.slurm's srun line (./run_train.sh on each node) and both exit 0; every node says where global
rank 0 runs; and a job that loses a node ends within seconds, non-zero, saying which node it lost."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.trainer.test_processes import TRAIN_ARGS, Job, children, wait_gone

REPO = Path(__file__).resolve().parents[2]
RANK_ZERO = "global rank 0 (INFO logs, TensorBoard, checkpoint commits) runs on "


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Stand-ins for SLURM's commands: `scontrol show hostnames` names this host, `srun` starts one task per node
# (SLURM_NNODES of them, SLURM_NODEID set) and keeps each node's output apart, as SLURM's per-task files do.
FAKE_SCONTROL = "#!/usr/bin/env bash\necho 127.0.0.1\n"
FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  SLURM_NODEID=$node "$@" > "$SRUN_LOGS/node$node.log" 2>&1 &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
exit $rc
"""


@pytest.mark.e2e
def test_two_nodes_train_one_job_through_the_slurm_script(tmp_path: Path) -> None:
    """multinode_trainer.slurm as sbatch runs it, SLURM's commands stood in for: two agents (NNODES=2, a c10d
    rendezvous on 127.0.0.1) train one job and both exit 0; every node says where global rank 0 runs."""
    bin_dir, logs = tmp_path / "bin", tmp_path / "logs"
    bin_dir.mkdir()
    logs.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("LOG_RANK", "CONFIG_FILE", "NNODES", "RDZV_ENDPOINT")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SRUN_LOGS=str(logs), SLURM_NNODES="2", SLURM_JOB_NODELIST="node[0-1]",
               RDZV_PORT=str(_free_port()), NGPU="1")  # fmt: skip
    args = ["--training.steps", "2", "--training.seq_len", "64", "--job.dump_folder", str(tmp_path / "job")]
    done = subprocess.run(["bash", "multinode_trainer.slurm", *args], cwd=REPO, env=env, timeout=240,
                          capture_output=True, text=True)  # fmt: skip
    outputs = [(logs / f"node{n}.log").read_text() for n in range(2)]
    assert done.returncode == 0, done.stderr[-2000:] + outputs[0][-3000:] + outputs[1][-3000:]
    assert "dp_shard" in outputs[0] + outputs[1] and "[0, 1]" in outputs[0] + outputs[1]  # one mesh, both nodes
    assert "step 2 |" in outputs[0] + outputs[1], outputs[0][-3000:]
    # c10d may give rank 0 to either agent: each node's console says where it runs and where its logs go
    for output in outputs:
        line = next((line for line in output.splitlines() if RANK_ZERO in line), None)
        assert line is not None and re.search(r"runs on (this node, )?node \d \(", line), output[-3000:]
        assert "stderr.log" in line, line
    assert sum(f"{RANK_ZERO}this node" in output for output in outputs) == 1, outputs


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _two_nodes(tmp_path: Path) -> tuple[list[Job], str]:
    """Node 0 first, and node 1 once node 0 listens at the endpoint: as on a cluster, where only the
    endpoint's host can bind it, node 0 hosts the rendezvous (on loopback either agent could), and
    it joins first, so the c10d rendezvous (which orders by host, then pid) gives it rank 0."""
    port = _free_port()
    args = [*TRAIN_ARGS, "--job.dump_folder", str(tmp_path)]
    env = dict(NGPU="1", NNODES="2", RDZV_ENDPOINT=f"127.0.0.1:{port}")
    node0 = Job(args, **env, NODE_RANK="0")
    deadline = time.monotonic() + 60
    while not _listening(port):
        assert node0.proc.poll() is None and time.monotonic() < deadline, node0.output[-3000:]
        time.sleep(0.05)
    return [node0, Job(args, **env, NODE_RANK="1")], env["RDZV_ENDPOINT"]


def _training(nodes: list[Job]) -> None:
    """Until a step is logged (on whichever node rank 0 landed), then note each node's rank."""
    deadline = time.monotonic() + 180
    while not any("step 1 |" in "".join(node.lines) for node in nodes):
        running = all(node.proc.poll() is None for node in nodes)
        assert running and time.monotonic() < deadline, nodes[0].output[-2000:] + nodes[1].output[-2000:]
        time.sleep(0.05)
    for node in nodes:
        node.ranks = children(node.proc.pid)
        assert len(node.ranks) == 1, node.ranks


@pytest.mark.e2e
def test_a_job_that_loses_a_node_fails_within_seconds_naming_it(tmp_path: Path) -> None:
    """kill -9 of node 1's agent. Before: its rank trained on as an orphan, and node 0 waited 300 s in
    torchrun's exit barrier, then exited 0."""
    nodes, _ = _two_nodes(tmp_path)
    try:
        _training(nodes)
        nodes[1].proc.send_signal(signal.SIGKILL)
        assert wait_gone(nodes[1].ranks, 5) == [], "node 1's rank outlived its agent"
        assert nodes[0].wait(timeout=30) == 1, nodes[0].output[-3000:]
        out = nodes[0].output
        summary = out[out.index("trainer.train failed on rank") :]
        assert re.search(r"\nrank 1 on node 1 \([^)]*\) was lost: its torchrun agent died", summary), out[-3000:]
    finally:
        for node in nodes:
            node.kill()


@pytest.mark.e2e
def test_losing_the_rendezvous_host_ends_the_other_node_with_one_line(tmp_path: Path) -> None:
    """kill -9 of node 0's agent, which hosts the rendezvous store. Before: 81 lines of C++ frames on
    node 1, and a traceback instead of a summary."""
    nodes, endpoint = _two_nodes(tmp_path)
    try:
        _training(nodes)
        before = len(nodes[1].lines)
        nodes[0].proc.send_signal(signal.SIGKILL)
        assert wait_gone(nodes[0].ranks, 5) == [], "node 0's rank outlived its agent"
        assert nodes[1].wait(timeout=30) != 0, nodes[1].output[-3000:]
        after = nodes[1].output.splitlines()[before:]
        said = "\n".join(after)
        assert "frame #" not in said and "Traceback" not in said, said
        assert len(after) < 12, said
        store_lost = f"the job stopped: the rendezvous store at {endpoint} went away or cannot be reached"
        store_host_lost = re.search(r"rank 0 on node \d \(.*\), the host of the job's store, went away", said)
        assert store_lost in said or store_host_lost, said  # the agent's loss, or its rank's, whichever came first
    finally:
        for node in nodes:
            node.kill()
