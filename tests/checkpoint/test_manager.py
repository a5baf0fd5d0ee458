"""CheckpointManager's folder policy, one process: a step whose folder exists (a model-only export, a
corrupt or index-less step, an earlier run's) is saved again and the old one kept under a name that says
why; skipped steps are named; the initial checkpoint loads without `enable`; torchtitan's other
[checkpoint] keys (first-step save, load_only, seed checkpoint, pinned async, Hugging Face in and out)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint import CheckpointError
from checkpoint.manager import CheckpointManager, committed_steps
from checkpoint.stateful import ModelState
from checkpoint.storage import set_aside
from models.llama3 import Transformer, TransformerModelArgs
from models.llama3.hf_adapter import LLAMA3_HF_ADAPTER
from trainer.train_state import TrainState

ARGS = TransformerModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=41, multiple_of=16, max_seq_len=8)


class _Job:
    """A stand-in trainer: a tiny model and its train state, checkpointed in `folder`."""

    def __init__(self, folder: Path, seed: int = 0, **options: object) -> None:
        torch.manual_seed(seed)
        self.model, self.state = Transformer(ARGS), TrainState()
        meta = {"model_args": dataclasses.asdict(ARGS)}
        states = {"model": ModelState(self.model), "train_state": self.state}
        options = {"hf_adapter": LLAMA3_HF_ADAPTER, "keep_latest_k": 0, **options}  # as the trainer passes its family's
        self.manager = CheckpointManager(folder, states, metadata=meta, **options)  # type: ignore[arg-type]

    def run(self, steps: int) -> int:
        """Resume, then 'train' to `steps` (each step nudges the weights), saving as the trainer does."""
        start = self.state.step = self.manager.load()
        for step in range(start + 1, steps + 1):
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(0.01)
            self.state.step = step
            self.manager.save_if_due(step, last=step == steps)
        self.manager.close()
        return start


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_extending_a_run_past_its_model_only_last_save_resumes_from_the_newest_step(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    assert _Job(folder, interval=2).run(10) == 0  # step-10: the model-only last save
    assert _Job(folder, interval=2).run(12) == 8  # step 10 is saved again, resumable
    assert _Job(folder, interval=2).run(14) == 10, _names(folder)  # not 8 again
    assert {"step-10.model-only", "step-12.model-only", "step-14"} <= set(_names(folder)), _names(folder)
    kept = checkpoint.read_index(folder / "step-10.model-only")
    assert not any(k.startswith("train_state") for k in kept.values)  # the export, intact
    assert committed_steps(folder) == [2, 4, 6, 8, 10, 12, 14]


def test_keep_latest_k_counts_resumable_steps_so_a_model_only_last_save_never_removes_the_resume_point(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ckpt"
    assert _Job(folder, interval=2, keep_latest_k=1).run(6) == 0  # step-6: the model-only last save
    assert committed_steps(folder) == [4, 6]
    assert _Job(folder, interval=2, keep_latest_k=1).run(8) == 4, _names(folder)  # extended: after step 4, not 0
    assert committed_steps(folder) == [6, 8] and (folder / "step-6.model-only").is_dir()  # the first export, kept
    assert _Job(folder / "k2", interval=2, keep_latest_k=2).run(9) == 0
    assert committed_steps(folder / "k2") == [6, 8, 9]


def test_keep_latest_k_never_removes_the_step_just_saved_for_an_earlier_run_s_newer_one(tmp_path: Path) -> None:
    """A run resumed from an older step (checkpoint.load_step) keeps an earlier run's newer steps, passed over:
    before, with keep_latest_k 1 they counted as the newest and each of this run's saves was deleted at once."""
    folder = tmp_path / "ckpt"
    _Job(folder, interval=2, last_save_model_only=False).run(10)  # steps 2 .. 10, all resumable
    assert _Job(folder, interval=2, keep_latest_k=1, load_step=4, last_save_model_only=False).run(6) == 4
    assert 6 in committed_steps(folder) and 10 in committed_steps(folder), _names(folder)
    assert 4 not in committed_steps(folder), _names(folder)  # older than this run's newest save: purged


def _flip_a_byte(step_dir: Path) -> None:
    data = step_dir / "rank-0.safetensors"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(raw)


def test_after_recovering_from_a_corrupt_step_the_next_restart_uses_the_new_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "ckpt"
    _Job(folder, interval=2, last_save_model_only=False).run(8)
    _flip_a_byte(folder / "step-8")
    with pytest.raises(CheckpointError, match=r"checksum mismatch.*checkpoint.load_step"):
        _Job(folder, interval=2).run(10)
    caplog.set_level(logging.INFO, logger="checkpoint")
    assert _Job(folder, interval=2, load_step=6, last_save_model_only=False).run(8) == 6
    assert "the newer step-8 is not loaded (a resumable save of step 8 keeps it as step-8.replaced)" in caplog.text
    assert "step-8 was in the way of saving step 8: it holds a checkpoint of an earlier run" in caplog.text
    assert (folder / "step-8.replaced" / "index.json").is_file()  # the user's (corrupt) data is kept
    assert _Job(folder, interval=2).run(10) == 8  # the plain restart loads the new step 8


def test_a_step_without_index_is_named_when_skipped_and_kept_when_saved_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "ckpt"
    _Job(folder, interval=2, last_save_model_only=False).run(8)
    (folder / "step-8" / "index.json").unlink()
    caplog.set_level(logging.INFO, logger="checkpoint")
    assert _Job(folder, interval=2, last_save_model_only=False).run(8) == 6
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "skipped" in r.getMessage()]
    assert warning == ["skipped step-8: no index.json (never committed, or its index was deleted); resuming from "
                       "step-6. It is kept, renamed step-8.incomplete when step 8 is saved again"], warning  # fmt: skip
    assert (folder / "step-8.incomplete" / "rank-0.safetensors").is_file()
    assert committed_steps(folder)[-1] == 8 and _Job(folder, interval=2).run(10) == 8


def test_a_model_only_save_keeps_an_existing_resumable_step_and_cleanup_keeps_set_aside_folders(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "ckpt"
    _Job(folder, interval=5, last_save_model_only=False).run(10)
    before = checkpoint.read_index(folder / "step-10").values["train_state"]
    (folder / "step-3.model-only").mkdir()
    (folder / "step-4.tmp-0123").mkdir()  # an interrupted save
    caplog.set_level(logging.WARNING, logger="checkpoint")
    assert _Job(folder, interval=5, load_step=5).run(10) == 5  # its last save is model-only
    assert "step-10 already holds a resumable checkpoint of step 10 (from an earlier run): kept" in caplog.text
    assert checkpoint.read_index(folder / "step-10").values["train_state"] == before
    assert "step-3.model-only" in _names(folder) and "step-4.tmp-0123" not in _names(folder)


def test_set_aside_names_are_unique(tmp_path: Path) -> None:
    for _ in range(3):
        (tmp_path / "step-10").mkdir()
        set_aside(tmp_path / "step-10", "model-only")
    assert _names(tmp_path) == ["step-10.model-only", "step-10.model-only-2", "step-10.model-only-3"]


def test_the_initial_checkpoint_loads_without_enable_and_nothing_else_happens(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = _Job(tmp_path / "source", seed=1)
    checkpoint.save({"model": ModelState(source.model).state_dict()}, tmp_path / "init")
    folder = tmp_path / "ckpt"
    _Job(folder, seed=2, interval=1).run(2)  # a checkpoint the job must not resume from
    caplog.set_level(logging.INFO, logger="checkpoint")
    job = _Job(folder, seed=3, enable=False, initial_load_path=str(tmp_path / "init"), interval=1)
    assert job.manager.load() == 0
    assert all(torch.equal(a, b) for a, b in zip(job.model.state_dict().values(), source.model.state_dict().values()))
    assert f"checkpoint.enable=false: {folder} is not scanned, nothing is saved" in caplog.text
    assert not job.manager.is_due(3, last=True)
    job.run(3)
    assert committed_steps(folder) == [1, 2]


def test_first_step_checkpoint_load_only_and_pinned_async(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _Job(folder, interval=4, enable_first_step_checkpoint=True, async_mode="async_with_pinned_mem").run(4)
    assert committed_steps(folder) == [1, 4]
    assert _Job(folder, interval=1, load_only=True).run(6) == 1  # step-4 is model-only; never saves
    assert committed_steps(folder) == [1, 4]


def test_a_seed_checkpoint_is_the_initialized_model_at_step_0(tmp_path: Path) -> None:
    job = _Job(tmp_path, create_seed_checkpoint=True)
    assert job.manager.load() == 0 and job.manager.created_seed
    index = checkpoint.read_index(tmp_path / "step-0")
    assert list(index.values) == [] and all(k.startswith("model.") for k in index.tensors)
    fresh = _Job(tmp_path, seed=9)
    assert fresh.manager.load() == 0 and not fresh.manager.created_seed  # model only: from step 0
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(), job.model.state_dict().values()))


def test_the_last_save_in_hf_and_an_initial_load_in_hf_round_trip(tmp_path: Path) -> None:
    job = _Job(tmp_path / "a", interval=100, last_save_in_hf=True, export_dtype="bfloat16")
    job.run(2)
    hf_dir = tmp_path / "a" / "step-2-hf"
    assert _names(hf_dir) == ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert committed_steps(tmp_path / "a") == [] and not list((tmp_path / "a").glob("*.tmp-*"))
    loaded = _Job(tmp_path / "b", seed=5, initial_load_in_hf=True, hf_assets_path=str(hf_dir))
    assert loaded.run(0) == 0
    for (name, want), got in zip(job.model.state_dict().items(), loaded.model.state_dict().values()):
        assert torch.equal(got, want.to(torch.bfloat16).float()), name


def test_an_initial_load_in_hf_refuses_a_folder_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"pickle")
    job = _Job(tmp_path / "ckpt", initial_load_in_hf=True, initial_load_path=str(tmp_path / "hf"))
    refused = r"initial_load_path='.*hf' holds no .safetensors files .* point checkpoint.initial_load_path at a"
    with pytest.raises(CheckpointError, match=refused):
        job.run(0)
    with pytest.raises(ValueError, match="needs a Hugging Face folder; set checkpoint.initial_load_path or model.hf"):
        _Job(tmp_path / "ckpt", initial_load_in_hf=True)
    with pytest.raises(ValueError, match="initial_load_in_hf=true needs the model family's Hugging Face adapter"):
        _Job(tmp_path / "ckpt", initial_load_in_hf=True, initial_load_path=str(tmp_path / "hf"), hf_adapter=None)


def test_the_caller_names_the_weights_and_the_resume_marker(tmp_path: Path) -> None:
    """The manager knows no trainer convention: with other state names it resumes, exports and refuses as well."""
    from checkpoint.manager import StateRoles

    refused: list[Path] = []
    roles = StateRoles(model="weights", resumable="progress", compatible=lambda d, saved, ours: refused.append(d))
    torch.manual_seed(0)
    model, progress = Transformer(ARGS), TrainState()
    states = {"weights": ModelState(model), "progress": progress}
    manager = CheckpointManager(tmp_path, states, interval=2, keep_latest_k=0, roles=roles)  # type: ignore[arg-type]
    for step in (1, 2, 3, 4):
        progress.step = step
        manager.save_if_due(step, last=step == 4)
    manager.close()
    assert committed_steps(tmp_path) == [2, 4]
    assert not any(k.startswith("progress") for k in checkpoint.read_index(tmp_path / "step-4").values)  # export
    again = CheckpointManager(tmp_path, {"weights": ModelState(model), "progress": TrainState()}, roles=roles)  # type: ignore[arg-type]
    assert again.load() == 2 and refused == [tmp_path / "step-2"]  # the newest resume point, checked by the caller
    with pytest.raises(ValueError, match=r"need a 'weights' entry \(StateRoles.model\)"):
        CheckpointManager(tmp_path, {"model": ModelState(model)}, roles=roles)  # type: ignore[arg-type]
