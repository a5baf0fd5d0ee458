"""checkpoint.initial_load_path: a fresh job starts from another run's (or from-hf's) weights, and
refuses weights whose model computes differently (same shapes, other RoPE scaling or tying)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint import CheckpointError
from checkpoint.manager import CheckpointManager
from checkpoint.stateful import ModelState
from models.llama3 import RoPEScalingArgs, Transformer, llama3_configs
from trainer.checkpointing import TRAINER_ROLES

ARGS = dataclasses.replace(llama3_configs["debugmodel"], dim=32, n_layers=1, n_heads=4, vocab_size=41, max_seq_len=8)


def _saved(tmp_path: Path) -> tuple[Transformer, Path]:
    torch.manual_seed(0)
    source = Transformer(ARGS)
    meta = {"job_config": {"model": {"flavor": "debugmodel"}}, "model_args": dataclasses.asdict(ARGS)}
    return source, checkpoint.save({"model": ModelState(source).state_dict()}, tmp_path / "source", metadata=meta)


def _manager(tmp_path: Path, model: Transformer, initial: Path) -> CheckpointManager:
    meta = {"model_args": dataclasses.asdict(model.model_args)}
    states = {"model": ModelState(model)}
    return CheckpointManager(
        tmp_path / "job", states, initial_load_path=str(initial), metadata=meta, roles=TRAINER_ROLES
    )


def test_a_fresh_job_starts_from_the_initial_weights(tmp_path: Path) -> None:
    source, saved = _saved(tmp_path)
    torch.manual_seed(1)
    target = Transformer(dataclasses.replace(ARGS, max_seq_len=16))  # another context length is fine
    assert _manager(tmp_path, target, saved).load() == 0
    for (name, want), got in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(got, want), name


@pytest.mark.parametrize(
    "change, field",
    [({"rope_scaling": RoPEScalingArgs()}, "rope_scaling"), ({"rope_theta": 10000.0}, "rope_theta")],
)
def test_weights_of_a_model_that_computes_differently_are_refused(tmp_path: Path, change: dict, field: str) -> None:
    _, saved = _saved(tmp_path)
    target = Transformer(dataclasses.replace(ARGS, **change))
    with pytest.raises(CheckpointError, match=rf"other architecture than this job's: {field}: checkpoint .*"
                                              r"set model.flavor to the flavor it was trained as \(it was saved as "
                                              r"model.flavor='debugmodel'\)"):  # fmt: skip
        _manager(tmp_path, target, saved).load()
