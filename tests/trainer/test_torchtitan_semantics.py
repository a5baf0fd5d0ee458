"""torchtitan v0.2.0 keys with a meaning here do what torchtitan's do: the optimizer's betas and kernel,
warmup-stable-decay, training.dtype, layer-selective AC, reshard-after-forward, gc_freq, a random seed shared
by every rank, the consecutive-skip cap, tensorboard folders, print_config and the post-first-step timeout."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from parallelisms.activation_checkpoint import apply_ac
from tests.trainer.test_train import _train_rank
from tests.world import run_world
from trainer.lr_schedule import lr_factor
from trainer.process.garbage import GarbageCollection

REPO = Path(__file__).resolve().parents[2]
SHORT = ["--job.config_file", str(REPO / "configs" / "debug_model.toml"), "--training.seq_len", "64"]


def _built(argv: list[str]) -> dict:
    """On each rank: the model, optimizer and scheduler the trainer builds for `argv`, described."""
    import torch.distributed as dist

    from trainer.build import build_model_and_optimizer
    from trainer.config import load_config
    from trainer.preflight import build_parallel_dims
    from trainer.runtime import build_runtime

    cfg = load_config(argv)
    dims = build_parallel_dims(cfg.parallelism, dist.get_world_size())
    runtime = build_runtime(cfg, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    model, optimizer, scheduler = build_model_and_optimizer(cfg, runtime, 258)
    group = optimizer.param_groups[0]
    blocks = list(model.layers.values())  # type: ignore[operator]
    lrs = []
    for _ in range(cfg.training.steps):
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.step()
    fsdp_states = [getattr(b, "_fsdp_state", None) for b in blocks]
    reshard = [bool(s.reshard_after_forward) if s is not None else None for s in fsdp_states]
    return {
        "betas": group["betas"], "fused": group["fused"], "foreach": group["foreach"],
        "dtypes": {p.dtype for p in model.parameters()},
        "buffers": {name: b.dtype for name, b in model.named_buffers()},
        "checkpointed": [b.__dict__.get("_ac_checkpointed", False) for b in blocks],
        "lrs": lrs, "reshard": reshard,
    }  # fmt: skip


def test_optimizer_schedule_dtype_and_ac_keys_take_effect() -> None:
    argv = [
        *SHORT, "--optimizer.beta1", "0.8", "--optimizer.beta2", "0.99", "--optimizer.implementation", "for-loop",
        "--training.dtype", "bfloat16", "--activation_checkpoint.mode", "selective",
        "--activation_checkpoint.selective_ac_option", "2", "--training.steps", "10",
        "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0.5", "--lr_scheduler.min_lr_factor", "0",
    ]  # fmt: skip
    built = run_world(_built, 1, argv)[0]
    assert built["betas"] == (0.8, 0.99) and built["foreach"] is False and not built["fused"]
    assert built["dtypes"] == {torch.bfloat16}
    assert built["buffers"] == {"freqs_cis": torch.complex64}  # before: bfloat16, its imaginary part dropped
    assert built["checkpointed"] == [False, True] * 3  # every 2nd of the debug model's 6 blocks
    lrs = built["lrs"]  # warmup 2, stable 3, decay 5 (decay_ratio 0.5 of 10 steps)
    assert lrs[2] == lrs[3] == lrs[4] == pytest.approx(8e-4) and lrs[0] < lrs[1] < lrs[2]
    assert lrs[5] == pytest.approx(8e-4) and lrs[-1] == pytest.approx(0.0) and lrs[6] < lrs[5]


def test_warmup_stable_decay_and_sqrt_shapes() -> None:
    f = [lr_factor(s, warmup_steps=0, total_steps=5, decay_type="sqrt", min_lr_factor=0.0) for s in range(5)]
    assert f == pytest.approx([1.0, 1 - 0.25**0.5, 1 - 0.5**0.5, 1 - 0.75**0.5, 0.0])
    wsd = [lr_factor(s, warmup_steps=0, total_steps=4, decay_type="linear", min_lr_factor=0.0, decay_ratio=0.5)
           for s in range(4)]  # fmt: skip
    assert wsd == [1.0, 1.0, 1.0, 0.0]


def test_gc_freq_collects_on_the_cadence_only() -> None:
    collections: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        with GarbageCollection(3) as collector:
            assert not gc.isenabled()
            collections.clear()
            for step in range(1, 7):
                collector.step(step)
            assert collections == [1, 1]  # steps 3 and 6, young generations only
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(count)


def _seed_and_lines(argv: list[str]) -> tuple[int, list[str]]:
    import torch.distributed as dist

    lines = _train_rank(argv, logger_name="trainer.train")
    seed = torch.tensor(torch.initial_seed() % 2**62)
    seeds = [torch.zeros_like(seed) for _ in range(dist.get_world_size())]
    dist.all_gather(seeds, seed)
    assert len({int(s) for s in seeds}) == 1, seeds  # the data order and init agree on every rank
    return int(seed), lines


def test_a_none_seed_is_drawn_once_and_shared_and_the_run_logs_its_config(tmp_path: Path) -> None:
    argv = [
        *SHORT, "--job.dump_folder", str(tmp_path), "--training.steps", "2", "--training.seed", "none",
        "--job.print_config", "--metrics.enable_tensorboard", "--metrics.save_tb_folder", "board",
        "--metrics.save_for_all_ranks", "--comm.train_timeout_seconds", "30", "--training.gc_freq", "1",
    ]  # fmt: skip
    (seed0, lines), _ = run_world(_seed_and_lines, 2, argv)
    assert any(line.startswith("training.seed is None: drew seed") for line in lines), lines
    assert any(line.startswith("resolved config:\n[job]") for line in lines), lines
    saved = (tmp_path / "config.toml").read_text()
    assert "seed = " in saved  # the drawn seed, so the run can be repeated
    assert sorted(p.name for p in (tmp_path / "board").iterdir()) == ["rank_0", "rank_1"]


def test_consecutive_nonfinite_steps_stop_a_skipping_run(tmp_path: Path) -> None:
    """`skip_nonfinite_steps` with every step non-finite used to skip them all and exit 0 with a NaN loss."""
    argv = [
        *SHORT, "--job.dump_folder", str(tmp_path), "--training.steps", "6", "--optimizer.lr", "1e12",
        "--lr_scheduler.warmup_steps", "0", "--training.skip_nonfinite_steps", "--training.max_norm", "0",
        "--training.max_consecutive_skipped_steps", "2",
    ]  # fmt: skip
    with pytest.raises(AssertionError, match=r"FloatingPointError: step \d: 2 steps in a row had a non-finite"):
        run_world(_train_rank, 1, argv)


def test_selective_option_op_checkpoints_every_block() -> None:
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(4)])
    apply_ac(model, "selective", selective_option="op")
    assert all(b.__dict__["_ac_checkpointed"] for b in model.layers)


@pytest.mark.parametrize("policy, blocks", [("default", [True] * 5 + [False]), ("never", [False] * 6)])
def test_fsdp_reshard_after_forward(policy: str, blocks: list[bool]) -> None:
    """ "default"/"always" free the unsharded blocks after forward (but the last, which backward needs first)."""
    argv = [*SHORT, "--parallelism.fsdp_reshard_after_forward", policy]
    assert run_world(_built, 2, argv)[0]["reshard"] == blocks
