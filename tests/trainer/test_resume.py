"""Resuming through the trainer: 4 steps straight equal 2 + restart + 2, bitwise on the same layout
and within fp32 tolerance on another parallelism (same data order), from the checkpoints' tensors; an
initial checkpoint without checkpoint.enable, a seed checkpoint, Hugging Face weights on every layout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch

import checkpoint
from checkpoint.manager import committed_steps
from tests.trainer.test_train import REPO, _losses, _train_rank
from tests.world import run_world

_JOB = [
    "--job.config_file", str(REPO / "configs" / "debug_model.toml"),
    "--training.steps", "4", "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "1",
    "--training.global_batch_size", "4", "--training.local_batch_size", "2",
    "--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "0",
    "--checkpoint.last_save_model_only", "false",
]  # fmt: skip
_LAYOUTS = {  # name -> (world size, overrides); the global batch stays 4 sequences
    "fsdp2": (2, []),
    "one": (1, []),
    "fsdp_tp": (4, ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2"]),
}


def _run(layout: str, dump: Path) -> list[float]:
    world_size, overrides = _LAYOUTS[layout]
    return _losses(run_world(_train_rank, world_size, [*_JOB, *overrides, "--job.dump_folder", str(dump)])[0])


def _tensors(step_dir: Path) -> dict[str, torch.Tensor]:
    index = checkpoint.read_index(step_dir)
    return {k: checkpoint.read_tensor(step_dir, k, index=index) for k in index.tensors}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, list[float]]:
    dump = tmp_path_factory.mktemp("straight")
    losses = _run("fsdp2", dump)
    assert committed_steps(dump / "checkpoint") == [2, 4]
    return dump, losses


def _resume_from_step_2(straight_dump: Path, dump: Path) -> None:
    """A job that stopped after its step-2 save: only that checkpoint exists."""
    shutil.copytree(straight_dump / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")


def test_resume_on_the_same_layout_is_bitwise(straight, tmp_path) -> None:
    dump, losses = straight
    _resume_from_step_2(dump, tmp_path)
    resumed = _run("fsdp2", tmp_path)
    assert resumed == losses[2:], (losses, resumed)  # only steps 3 and 4 ran
    want, got = _tensors(dump / "checkpoint" / "step-4"), _tensors(tmp_path / "checkpoint" / "step-4")
    assert want.keys() == got.keys() and any(k.startswith("optimizer.state.") for k in want)
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, f"not bitwise after resuming: {differ[:5]}"
    values = checkpoint.read_index(tmp_path / "checkpoint" / "step-4").values
    assert values["train_state"]["step"] == 4 and values["dataloader"]["position"] == 4


@pytest.mark.parametrize("layout", ["one", "fsdp_tp"])
def test_resume_on_another_layout_continues_the_same_run(straight, tmp_path, layout) -> None:
    dump, losses = straight
    _resume_from_step_2(dump, tmp_path)
    resumed = _run(layout, tmp_path)
    assert resumed == pytest.approx(losses[2:], abs=2e-4), (losses, resumed)  # logged to 4 decimals
    want, got = _tensors(dump / "checkpoint" / "step-4"), _tensors(tmp_path / "checkpoint" / "step-4")
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def _children(pid: int) -> list[int]:
    """Direct child processes of `pid` (from /proc; torchrun's rank workers)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@pytest.mark.e2e
def test_torchrun_restarts_a_killed_job_from_its_checkpoint(tmp_path) -> None:
    """./run_train.sh with MAX_RESTARTS=1: a rank SIGKILLed after step 3 brings the job down, torchrun
    restarts it, it resumes from the latest committed step and finishes like an uninterrupted run."""
    argv = [a for a in _JOB if a not in ("--job.config_file", str(REPO / "configs" / "debug_model.toml"))]
    argv[argv.index("--training.steps") + 1] = "5"
    env = {k: v for k, v in os.environ.items() if k not in ("LOG_RANK", "CONFIG_FILE")}
    env.update(NGPU="2", MAX_RESTARTS="1", LOG_RANK="0,1")
    job = subprocess.Popen(["./run_train.sh", *argv, "--job.dump_folder", str(tmp_path)], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines, killed = [], False
    assert job.stdout is not None
    for line in job.stdout:
        lines.append(line)
        if not killed and "step 3 |" in line:
            ranks = _children(job.pid)
            assert len(ranks) == 2, (ranks, "".join(lines))
            os.kill(ranks[1], signal.SIGKILL)
            killed = True
    output = "".join(lines)
    (tmp_path / "output.log").write_text(output)
    assert job.wait(timeout=300) == 0, output[-4000:]
    assert killed and "resumed from" in output, output[-4000:]
    assert committed_steps(tmp_path / "checkpoint")[-1] == 5
    resumed_step = int(output.split("resumed from")[1].split("step-")[1].split()[0].rstrip(")"))
    assert resumed_step in (2, 3), output[-4000:]  # the last commit before the kill (2, or 3 if it beat it)


def _save_initial_weights(argv: list[str], directory: str) -> None:
    import torch.distributed as dist

    from checkpoint.stateful import ModelState
    from trainer.build import build_model_and_optimizer
    from trainer.config import load_config
    from trainer.preflight import build_parallel_dims
    from trainer.runtime import build_runtime

    cfg = load_config(argv)
    dims = build_parallel_dims(cfg.parallelism, dist.get_world_size())
    runtime = build_runtime(cfg, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    model = build_model_and_optimizer(cfg, runtime, 258)[0]
    checkpoint.save({"model": ModelState(model).state_dict()}, directory)


def test_initial_weights_are_bitwise_the_same_on_every_layout(tmp_path) -> None:
    layouts = {
        **_LAYOUTS, "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
        "hsdp": (4, ["--parallelism.data_parallel_replicate_degree", "2",
                     "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "1"]),
    }  # fmt: skip
    weights = {}
    for name, (world_size, overrides) in layouts.items():
        directory = tmp_path / name
        run_world(_save_initial_weights, world_size, [*_JOB, *overrides], str(directory))
        weights[name] = _tensors(directory)
    reference = weights.pop("one")
    for name, got in weights.items():
        assert got.keys() == reference.keys(), name
        differ = [k for k in reference if not torch.equal(got[k], reference[k])]
        assert not differ, f"{name}: initial {differ[:3]} differ from one process's"


def _train_tied_rank(argv: list[str]) -> list[str]:
    """_train_rank with the 1B flavor's options (tied embeddings, GQA, RoPE scaling) at a test's size."""
    import dataclasses

    from models.llama3 import llama3_configs

    real = llama3_configs["1B"]
    llama3_configs["1B"] = dataclasses.replace(real, dim=64, n_layers=2, n_heads=4, n_kv_heads=2)
    try:
        return _train_rank(argv)
    finally:
        llama3_configs["1B"] = real


def test_a_tied_model_saves_its_weight_once_and_resumes_bitwise(tmp_path) -> None:
    job = [*_JOB, "--model.flavor", "1B"]
    straight = _losses(run_world(_train_tied_rank, 2, [*job, "--job.dump_folder", str(tmp_path / "a")])[0])
    saved = _tensors(tmp_path / "a" / "checkpoint" / "step-4")
    assert "model.tok_embeddings.weight" in saved and not any("output.weight" in k for k in saved)
    assert any(k.startswith("optimizer.state.tok_embeddings.weight.") for k in saved)
    _resume_from_step_2(tmp_path / "a", tmp_path / "b")
    resumed = _losses(run_world(_train_tied_rank, 2, [*job, "--job.dump_folder", str(tmp_path / "b")])[0])
    assert resumed == straight[2:], (straight, resumed)
    got = _tensors(tmp_path / "b" / "checkpoint" / "step-4")
    assert saved.keys() == got.keys() and all(torch.equal(saved[k], got[k]) for k in saved)


def test_keep_latest_k_1_keeps_the_resume_point_next_to_the_model_only_last_save(tmp_path) -> None:
    """With keep_latest_k=1 and the default model-only last save, a longer run resumes after the last resumable
    step (and goes on from its state), not from step 0 on the export's weights."""
    argv = [a for a in _JOB if a not in ("--checkpoint.last_save_model_only", "false")]
    argv[argv.index("--checkpoint.keep_latest_k") + 1] = "1"
    argv += ["--job.dump_folder", str(tmp_path)]
    first = _losses(run_world(_train_rank, 2, argv)[0])
    assert committed_steps(tmp_path / "checkpoint") == [2, 4]  # step-4: the export
    argv[argv.index("--training.steps") + 1] = "6"
    longer = _losses(run_world(_train_rank, 2, argv)[0])
    assert len(longer) == 4 and longer[0] == first[2], (first, longer)  # steps 3 to 6, step 3 as before


# ------------------------------------------------------------------ torchtitan's [checkpoint] keys
def test_an_initial_checkpoint_loads_without_checkpoint_enable(straight, tmp_path) -> None:
    """initial_load_path with enable=false (initial_load_model_only=false: the whole state) continues the
    run it names exactly, and nothing is saved."""
    dump, losses = straight
    argv = [a for a in _JOB if a != "--checkpoint.enable"]
    argv += ["--checkpoint.initial_load_path", str(dump / "checkpoint" / "step-2"),
             "--checkpoint.initial_load_model_only", "false", "--job.dump_folder", str(tmp_path)]  # fmt: skip
    assert _losses(run_world(_train_rank, 2, argv)[0]) == losses[2:]
    assert not (tmp_path / "checkpoint").exists()


def test_a_seed_checkpoint_is_saved_without_training_and_starts_the_same_run(straight, tmp_path) -> None:
    dump, losses = straight
    seed = [*_JOB, "--checkpoint.create_seed_checkpoint", "--job.dump_folder", str(tmp_path)]
    assert _losses(run_world(_train_rank, 2, seed)[0]) == []
    assert committed_steps(tmp_path / "checkpoint") == [0]
    assert _tensors(tmp_path / "checkpoint" / "step-0").keys() == {k for k in _tensors(dump / "checkpoint" / "step-2")
                                                                   if k.startswith("model.")}  # fmt: skip
    assert _run("fsdp2", tmp_path) == losses  # resumed from step-0, model only: the run from its init


def _load_hf_rank(argv: list[str], hf_dir: str) -> dict[str, torch.Tensor]:
    """This layout's model, filled from the Hugging Face folder `hf_dir` (initial_load_in_hf, enable=false),
    gathered whole."""
    import dataclasses

    from checkpoint.manager import CheckpointManager
    from checkpoint.stateful import ModelState
    from models.llama3.hf_adapter import LLAMA3_HF_ADAPTER
    from parallelisms.dtensor import DTensor
    from trainer.build import build_model_and_optimizer
    from trainer.config import load_config
    from trainer.preflight import build_parallel_dims
    from trainer.runtime import build_runtime

    cfg = load_config(argv)
    dims = build_parallel_dims(cfg.parallelism, torch.distributed.get_world_size())
    runtime = build_runtime(cfg, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    model = build_model_and_optimizer(cfg, runtime, 258)[0]
    meta = {"model_args": dataclasses.asdict(model.model_args)}
    manager = CheckpointManager(Path(hf_dir).parent / "unused", {"model": ModelState(model)}, enable=False,
                                initial_load_in_hf=True, initial_load_path=hf_dir, metadata=meta,
                                hf_adapter=LLAMA3_HF_ADAPTER)  # fmt: skip
    assert manager.load() == 0
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in ModelState(model).state_dict().items()}


def test_initial_load_in_hf_fills_every_layout_with_the_converted_weights(tmp_path) -> None:
    """FSDP over 3 ranks cuts wq / wk rows across heads (256 rows: 86, 86, 84), TP by whole heads."""
    from checkpoint import hf_conversion
    from models.llama3.hf_adapter import LLAMA3_HF_ADAPTER

    job = ["--job.config_file", str(REPO / "configs" / "debug_model.toml"), "--training.seq_len", "64"]
    run_world(_save_initial_weights, 1, [*job, "--training.seed", "7"], str(tmp_path / "source"))
    hf_conversion.to_hf(tmp_path / "source", tmp_path / "hf", LLAMA3_HF_ADAPTER, flavor="debugmodel")
    want = _tensors(tmp_path / "source")
    layouts = {"fsdp3": (3, []), "tp2": (2, ["--parallelism.tensor_parallel_degree", "2",
                                              "--parallelism.data_parallel_shard_degree", "1"])}  # fmt: skip
    for name, (world_size, overrides) in layouts.items():
        got = run_world(_load_hf_rank, world_size, [*job, *overrides], str(tmp_path / "hf"))[0]
        assert {f"model.{k}" for k in got} == want.keys(), name
        differ = [k for k in got if not torch.equal(got[k], want[f"model.{k}"])]
        assert not differ, f"{name}: {differ[:3]} differ from the converted weights"


def test_first_step_save_hf_last_save_and_load_only_through_the_trainer(tmp_path) -> None:
    from checkpoint import hf_conversion
    from models.llama3.hf_adapter import LLAMA3_HF_ADAPTER

    argv = [a for a in _JOB if a not in ("--checkpoint.last_save_model_only", "false")]
    argv[argv.index("--training.steps") + 1] = "2"
    argv[argv.index("--checkpoint.interval") + 1] = "100"
    argv += ["--checkpoint.enable_first_step_checkpoint", "--checkpoint.last_save_in_hf", "--checkpoint.export_dtype",
             "bfloat16", "--job.dump_folder", str(tmp_path)]  # fmt: skip
    run_world(_train_rank, 2, argv)
    folder = tmp_path / "checkpoint"
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-2-hf"]
    config = hf_conversion.hf_model_metadata(folder / "step-2-hf", LLAMA3_HF_ADAPTER)[1]
    assert config["job_config"]["model"]["flavor"] == "debugmodel"
    argv[argv.index("--training.steps") + 1] = "3"
    lines = run_world(_train_rank, 2, [*argv, "--checkpoint.load_only"])[0]
    assert len(_losses(lines)) == 2  # resumed after step 1, saved nothing
    assert sorted(p.name for p in folder.iterdir()) == ["step-1", "step-2-hf"]
