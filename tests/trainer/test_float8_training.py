"""model.converters = ["float8"] through the trainer: every layout trains like one process under float8
(tensorwise scales are whole-tensor, so every rank casts the one device's bytes), and the float8 run stays
with the high-precision one."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.trainer.test_pipeline_training import JOB
from tests.trainer.test_train import _losses, _train_rank
from tests.world import run_world

REPO = Path(__file__).resolve().parents[2]
FLOAT8 = ["--model.converters", "float8", "--quantize.linear.float8.filter_fqns", "output"]


_ONE_PROCESS: dict[int, list[float]] = {}


def one_process_float8(tmp_path: Path, local_batch: int) -> list[float]:
    """One process's float8 losses, its batch split into sequences of `local_batch` (accumulated): the
    microbatches a layout casts. An activation's scale is its microbatch's amax on its rank (torchao's rule):
    FSDP(2) casts two sequences at a time, a PP microbatch one, so each is compared with the one process
    that casts the same groups."""
    if local_batch not in _ONE_PROCESS:
        argv = [*JOB, *FLOAT8, "--training.local_batch_size", str(local_batch), "--job.dump_folder", str(tmp_path)]
        _ONE_PROCESS[local_batch] = _losses(run_world(_train_rank, 1, argv)[0])
    return _ONE_PROCESS[local_batch]


@pytest.mark.parametrize(
    "world, layout, microbatch",
    [
        (2, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], 4),
        (4, ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "2"], 2),  # FSDP x TP
        (2, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"], 1),
    ],
    ids=["tp2", "fsdp2_tp2", "pp2"],
)  # fmt: skip
def test_float8_training_follows_one_process(tmp_path: Path, world: int, layout: list[str], microbatch: int) -> None:
    """Under TP a sharded weight's or gradient's amax is all-reduced, so each rank casts the one device's bytes
    (shown op by op, bitwise, in tests/models/test_float8.py). What is left are float32 sums in another order
    (TP's partial products, FSDP's reduce-scatter), 1e-7 apart; a float8 rounding they tip moves a value by
    one float8 step (6%), so four steps of losses agree to 1e-3 where float32 layouts agree to 2e-4."""
    reference = one_process_float8(tmp_path / "one", microbatch)
    lines = run_world(_train_rank, world, [*JOB, *FLOAT8, "--job.dump_folder", str(tmp_path), *layout])[0]
    losses = _losses(lines)
    assert len(losses) == 4 and losses == pytest.approx(reference, abs=1e-3), (reference, losses)


def test_float8_stays_with_the_high_precision_run(tmp_path: Path) -> None:
    float8 = one_process_float8(tmp_path / "float8", 4)
    reference = _losses(run_world(_train_rank, 1, [*JOB, "--job.dump_folder", str(tmp_path)])[0])
    assert float8 != reference  # the matmuls did run in float8
    assert float8 == pytest.approx(reference, rel=0.02), (reference, float8)


FSDP_FLOAT8 = [  # torchtitan's 405B settings: float8 all-gathers, their scales precomputed after each step
    "--quantize.linear.float8.enable_fsdp_float8_all_gather", "true",
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp", "true",
]  # fmt: skip
_NUMBERS = re.compile(r"loss [\d.]+ \| grad_norm [\d.]+")


def test_float8_all_gather_trains_bitwise_like_gathering_then_casting(tmp_path: Path) -> None:
    """FSDP(2): a weight's shards cast with the whole weight's scale, then gathered, are the bytes of the
    gathered weight cast (tests/fsdp/test_float8_all_gather.py), so every logged loss and gradient norm is
    the same to the last printed digit with the keys on as off."""
    runs = [
        run_world(_train_rank, 2, [*JOB, *FLOAT8, *keys, "--training.local_batch_size", "2",
                                   "--job.dump_folder", str(tmp_path / str(i))])[0]
        for i, keys in enumerate(([], FSDP_FLOAT8))
    ]  # fmt: skip
    plain, cast = ([m.group(0) for line in lines if (m := _NUMBERS.search(line))] for lines in runs)
    assert len(plain) == 4 and plain == cast, (plain, cast)


@pytest.mark.e2e
def test_run_train_sh_trains_fsdp2_in_float8_like_one_process(tmp_path: Path) -> None:
    """The default job (FSDP over 2 CPU ranks) with float8 linears gathered in float8, through torchrun: exit
    0, the linears converted and the output left out, and one process's float8 losses (two sequences a rank,
    as its)."""
    reference = one_process_float8(tmp_path / "one", 2)
    run = subprocess.run(
        ["./run_train.sh", *JOB, *FLOAT8, *FSDP_FLOAT8, "--training.local_batch_size", "2",
         "--job.dump_folder", str(tmp_path)],
        cwd=REPO, env={**os.environ, "NGPU": "2"}, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert "float8 (tensorwise): 42 linears converted; left in high precision: ['output']" in out, out[-3000:]
    lines = [line.split("trainer.metrics: ", 1)[1] for line in out.splitlines() if "trainer.metrics: step " in line]
    assert _losses(lines) == pytest.approx(reference, abs=1e-3), (reference, _losses(lines))


def test_rowwise_float8_training_follows_one_process_and_the_high_precision_run(tmp_path: Path) -> None:
    """recipe_name="rowwise" on FSDP(2) x TP(2): each rank casts one device's bytes (a row's or a column's amax
    over a sharded dim is all-reduced); the one process accumulates two sequences at a time, the groups FSDP
    casts the weight gradient's columns over. The kernel writes bfloat16, so TP's partial sums round there."""
    rowwise = [*FLOAT8, "--quantize.linear.float8.recipe_name", "rowwise", "--training.local_batch_size", "2"]
    one = _losses(run_world(_train_rank, 1, [*JOB, *rowwise, "--job.dump_folder", str(tmp_path / "one")])[0])
    layout = ["--parallelism.tensor_parallel_degree", "2", "--job.dump_folder", str(tmp_path / "fsdp_tp")]
    losses = _losses(run_world(_train_rank, 4, [*JOB, *rowwise, *layout])[0])
    assert len(losses) == 4 and losses == pytest.approx(one, abs=1e-3), (one, losses)
    reference = _losses(run_world(_train_rank, 1, [*JOB, "--job.dump_folder", str(tmp_path / "high")])[0])
    assert one != reference and one == pytest.approx(reference, rel=0.02), (reference, one)
