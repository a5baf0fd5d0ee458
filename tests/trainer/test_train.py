"""Integration: trainer.train.main() for 3 steps in a 2-rank gloo world, with FSDP and with TP."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from tests.world import run_world

REPO = Path(__file__).resolve().parents[2]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train_rank(argv: list[str], logger_name: str = "trainer.metrics") -> list[str]:
    """Run main(argv) on this rank (it must return 0); the messages `logger_name` logged. The process groups the
    job made are destroyed after it, as its own teardown would in a job of its own: every gloo group keeps a
    thread that wakes each 10 ms, and a test world's ranks would otherwise collect hundreds of them (a core's
    worth of idle wake-ups on a 2-core machine)."""
    import torch.distributed as dist

    from trainer.train import main

    handler = _Lines()
    watched = logging.getLogger(logger_name)
    watched.addHandler(handler)
    groups_before = set(dist.distributed_c10d._world.pg_map)
    try:
        assert main(argv) == 0
    finally:
        watched.removeHandler(handler)
        destroy_groups_since(groups_before)
    return handler.lines


def destroy_groups_since(groups_before: set) -> None:
    """Destroy this rank's process groups not in `groups_before` (the job's meshes are gone with it)."""
    import gc

    import torch.distributed as dist

    gc.collect()
    for group in [g for g in dist.distributed_c10d._world.pg_map if g not in groups_before]:
        dist.destroy_process_group(group)


def _losses(lines: list[str]) -> list[float]:
    return [float(line.split(" | ")[1].split()[1]) for line in lines if line.startswith("step ")]


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # FSDP over 2 ranks (dp_shard = -1 -> 2)
        ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"],
    ],
    ids=["fsdp2", "tp2"],
)
def test_main_trains_in_2_rank_world(tmp_path: Path, overrides: list[str]) -> None:
    argv = [
        "--job.config_file", str(REPO / "configs" / "debug_model.toml"),
        "--job.dump_folder", str(tmp_path),
        "--training.steps", "3", "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "0",
        *overrides,
    ]  # fmt: skip
    per_rank = run_world(_train_rank, 2, argv)
    losses = _losses(per_rank[0])
    assert len(losses) == 3, per_rank[0]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert (tmp_path / "config.toml").is_file()


# the debug model for 3 steps of 64 tokens without warmup, every step logged
_SHORT_DEBUG_JOB = [
    "--job.config_file", str(REPO / "configs" / "debug_model.toml"),
    "--training.steps", "3", "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "0",
    "--metrics.log_freq", "1",
]  # fmt: skip


def test_hsdp_trains_exactly_like_fsdp_on_4_ranks(tmp_path: Path) -> None:
    # same global batch, same initial weights: HSDP(2 replicas x 2 shards) must follow FSDP(4) step for step
    argv = _SHORT_DEBUG_JOB
    fsdp = _losses(run_world(_train_rank, 4, [*argv, "--job.dump_folder", str(tmp_path / "fsdp")])[0])
    hsdp_args = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
    hsdp = _losses(run_world(_train_rank, 4, [*argv, "--job.dump_folder", str(tmp_path / "hsdp"), *hsdp_args])[0])
    assert len(fsdp) == 3 and hsdp == pytest.approx(fsdp, rel=1e-5, abs=1e-5), (fsdp, hsdp)


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
         "--parallelism.enable_async_tensor_parallel"],
        ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
         "--parallelism.tensor_parallel_degree", "2"],
    ],
    ids=["fsdp2_async_tp2", "replicate2_tp2"],
)  # fmt: skip
def test_tp_layouts_train_like_fsdp2(tmp_path: Path, layout: list[str]) -> None:
    """Same data-parallel degree, same data, and the meta-device init gives every layout the same
    weights: FSDP x async TP (collective matmuls) and data-parallel x TP on 4 ranks follow FSDP(2) on 2 ranks
    step for step (fp32; TP reorders sums, hence the tolerance)."""
    argv = _SHORT_DEBUG_JOB
    fsdp = _losses(run_world(_train_rank, 2, [*argv, "--job.dump_folder", str(tmp_path / "fsdp")])[0])
    other = _losses(run_world(_train_rank, 4, [*argv, "--job.dump_folder", str(tmp_path / "tp"), *layout])[0])
    assert len(fsdp) == 3 and other == pytest.approx(fsdp, abs=2e-4), (fsdp, other)  # logged to 4 decimals


def test_accumulation_through_the_trainer(tmp_path: Path) -> None:
    """global_batch_size 8 on 2 ranks: 2 micro-batches of 2 follow 1 batch of 4 step for step."""
    argv = [*_SHORT_DEBUG_JOB, "--training.global_batch_size", "8"]
    whole = _losses(run_world(_train_rank, 2, [*argv, "--job.dump_folder", str(tmp_path / "a"),
                                               "--training.local_batch_size", "4"])[0])  # fmt: skip
    micro = _losses(run_world(_train_rank, 2, [*argv, "--job.dump_folder", str(tmp_path / "b"),
                                               "--training.local_batch_size", "2"])[0])  # fmt: skip
    assert len(whole) == 3 and micro == pytest.approx(whole, abs=2e-4), (whole, micro)


def test_accumulation_under_tensor_parallelism(tmp_path: Path) -> None:
    """TP(2) with 2 micro-batches of 2 follows 1 batch of 4 (loss_parallel entered once per micro-batch)."""
    argv = [*_SHORT_DEBUG_JOB, "--training.global_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
            "--parallelism.data_parallel_shard_degree", "1"]  # fmt: skip
    whole = _losses(run_world(_train_rank, 2, [*argv, "--job.dump_folder", str(tmp_path / "a"),
                                               "--training.local_batch_size", "4"])[0])  # fmt: skip
    micro = _losses(run_world(_train_rank, 2, [*argv, "--job.dump_folder", str(tmp_path / "b"),
                                               "--training.local_batch_size", "2"])[0])  # fmt: skip
    assert len(whole) == 3 and micro == pytest.approx(whole, abs=2e-4), (whole, micro)


def test_pure_data_parallel_is_ddp_and_trains_exactly_like_fsdp2(tmp_path: Path) -> None:
    """data_parallel_replicate_degree 2 alone replicates (DDP) rather than sharding; with accumulation too.
    Averaging two gradients is exact in either order, so the losses are FSDP(2)'s to the last digit."""
    argv = [*_SHORT_DEBUG_JOB, "--training.global_batch_size", "8"]
    ddp = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    fsdp = _losses(run_world(_train_rank, 2, [*argv, "--job.dump_folder", str(tmp_path / "fsdp")])[0])
    lines = run_world(_train_rank, 2, [*argv, "--job.dump_folder", str(tmp_path / "ddp"), *ddp], "trainer.train")[0]
    assert any("mesh_dim_names=('dp_replicate',)" in line for line in lines), lines
    replicated = _losses(run_world(_train_rank, 2, [*argv, "--job.dump_folder", str(tmp_path / "ddp2"), *ddp])[0])
    assert len(fsdp) == 3 and replicated == fsdp, (fsdp, replicated)
