"""A checkpoint never costs more than the work since the last commit: corrupt files are named, a
rank killed mid-save leaves every committed checkpoint loadable and the partial one ignored."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import checkpoint
from checkpoint import CheckpointError
from checkpoint.manager import CheckpointManager, committed_steps
from checkpoint.stateful import ModelState


def _save(sd: dict, path: Path) -> Path:
    return checkpoint.save(sd, path)  # no process group: a world of one


def test_a_truncated_file_is_named(tmp_path) -> None:
    path = _save({"w": torch.randn(64, 64)}, tmp_path / "step-1")
    data = path / "rank-0.safetensors"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"rank-0\.safetensors is \d+ bytes, the index says .* truncated"):
        checkpoint.load({"w": torch.zeros(64, 64)}, path)


def test_a_flipped_bit_is_detected_and_named(tmp_path) -> None:
    path = _save({"w": torch.randn(64, 64), "v": torch.randn(3)}, tmp_path / "step-1")
    data = path / "rank-0.safetensors"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(raw)
    with pytest.raises(CheckpointError, match=r"rank-0\.safetensors: checksum mismatch .* corrupt"):
        checkpoint.load({"w": torch.zeros(64, 64)}, path)
    checkpoint.load({"w": torch.zeros(64, 64)}, path, verify=False)  # the speed option skips the check


def test_an_index_pointing_outside_the_directory_is_refused(tmp_path) -> None:
    path = _save({"w": torch.ones(2)}, tmp_path / "step-1")
    index = path / "index.json"
    index.write_text(index.read_text().replace('"rank-0.safetensors"', '"../../etc/passwd"'))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        checkpoint.load({"w": torch.zeros(2)}, path)


_KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    import checkpoint, checkpoint.distributed as cd

    rank, store, folder = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=20))
    sd = {"model": {"w": torch.arange(1000.0), "v": torch.ones(1000)}}  # owners balance: one file per rank
    checkpoint.save(sd, f"{folder}/step-1")
    if rank == 1:  # dies half-way through writing its file of step 2
        def dying_write(path, tensors, metadata=None):
            with open(path, "wb") as f:
                f.write(b"partial")
            os.kill(os.getpid(), signal.SIGKILL)
        cd.write_safetensors = dying_write
    checkpoint.save({"model": {k: v * 2 for k, v in sd["model"].items()}}, f"{folder}/step-2")
    """
)


def test_a_rank_killed_mid_save_leaves_committed_checkpoints_and_is_ignored(tmp_path) -> None:
    store, folder = tmp_path / "store", tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "GLOO_SOCKET_IFNAME": "lo"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _KILLED_SAVE, str(r), str(store), str(folder)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for r in range(2)
    ]
    codes = [p.wait(timeout=120) for p in procs]
    assert codes[1] == -9 and codes[0] != 0, (codes, procs[0].stdout.read().decode()[-2000:])  # type: ignore[union-attr]
    assert committed_steps(folder) == [1]
    assert [p.name.split(".tmp-")[0] for p in folder.glob("*.tmp-*")] == ["step-2"]
    model = nn.Linear(10, 100, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    manager = CheckpointManager(folder, {"model": _Weight(model)}, last_save_model_only=False)
    assert manager.load() == 0  # model-only: training restarts at step 0 from its weights
    assert torch.equal(model.weight.reshape(-1), torch.arange(1000.0)), "step 1 was not the one loaded"
    assert not list(folder.glob("*.tmp-*")), "the interrupted save was not cleaned up"


class _Weight(ModelState):
    """The killed job saved {"model": {"w": ...}}; present a Linear's weight under that key."""

    def state_dict(self) -> dict:
        return {"w": self.model.weight.detach().view(-1)}


def test_keep_latest_k_purges_only_older_committed_steps(tmp_path) -> None:
    model = nn.Linear(2, 2)
    manager = CheckpointManager(tmp_path, {"model": ModelState(model)}, interval=1, keep_latest_k=2)
    (tmp_path / "step-9.tmp-abc").mkdir()  # someone else's save in progress is not ours to purge
    for step in range(1, 5):
        manager.save_if_due(step, last=False)
    assert committed_steps(tmp_path) == [3, 4]
    assert (tmp_path / "step-9.tmp-abc").is_dir()


def _async_save_then_mutate(folder: str) -> bool:
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    manager = CheckpointManager(folder, {"model": ModelState(model)}, interval=1, async_mode="async",
                                last_save_model_only=False)  # fmt: skip
    manager.save_if_due(1, last=False)  # returns once staged
    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on while the writer thread works
    manager.close()  # waits for the commit
    fresh = nn.Linear(64, 64)
    checkpoint.load({"model": ModelState(fresh).state_dict()}, Path(folder) / "step-1")
    return all(torch.equal(fresh.state_dict()[k], saved[k]) for k in saved)


def test_async_save_writes_the_staged_state_while_training_goes_on(tmp_path) -> None:
    from tests.world import run_world

    assert run_world(_async_save_then_mutate, 2, str(tmp_path)) == [True, True]
    assert committed_steps(tmp_path) == [1]


def test_resume_prefers_the_newest_resumable_step_over_a_model_only_export(tmp_path) -> None:
    from trainer.train_state import TrainState

    model, state = nn.Linear(2, 2), TrainState()
    manager = CheckpointManager(tmp_path, {"model": ModelState(model), "train_state": state}, interval=2)
    for step in range(1, 5):
        state.step = step
        manager.save_if_due(step, last=step == 4)  # step 4, the last, is model-only (torchtitan's default)
    assert committed_steps(tmp_path) == [2, 4]
    fresh = TrainState()
    resumed = CheckpointManager(tmp_path, {"model": ModelState(nn.Linear(2, 2)), "train_state": fresh}).load()
    assert resumed == 2 and fresh.step == 2


def test_an_index_whose_checksums_cannot_cover_its_file_is_refused(tmp_path) -> None:
    import json

    path = _save({"w": torch.ones(2)}, tmp_path / "step-1")
    raw = json.loads((path / "index.json").read_text())
    raw["files"]["rank-0.safetensors"]["crc32"] = []
    (path / "index.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="cannot cover"):
        checkpoint.load({"w": torch.zeros(2)}, path)
