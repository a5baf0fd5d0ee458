"""Pipeline parallelism through the trainer: PP(2) with 1F1B, Interleaved1F1B and GPipe, PP(2) x FSDP(2) and
PP(2) x TP(2) train like one process on the same global batches; a checkpoint saved under PP(2) (each stage
writes its own FQNs) resumes bitwise on PP(2) and reshards into FSDP(2); Hugging Face weights load into the
stages as into one process; what is not built yet is refused in the pre-flight."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.trainer.test_train import _losses, _train_rank
from tests.world import run_world
from trainer.config import load_config
from trainer.preflight import check_config

REPO = Path(__file__).resolve().parents[2]
JOB = [
    "--job.config_file", str(REPO / "configs" / "debug_model.toml"),
    "--training.steps", "4", "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "1",
    "--training.global_batch_size", "4", "--training.local_batch_size", "4",
]  # fmt: skip
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
MB2 = ["--parallelism.pipeline_parallel_microbatch_size", "2"]
SCHEDULE = "--parallelism.pipeline_parallel_schedule"


LAST_SAVE = ["--checkpoint.enable", "--checkpoint.interval", "4"]  # the weights after the last step, model only


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], Path]:
    dump = tmp_path_factory.mktemp("one")
    return _losses(run_world(_train_rank, 1, [*JOB, *LAST_SAVE, "--job.dump_folder", str(dump)])[0]), dump


@pytest.fixture(scope="module")
def one_process(one_process_run: tuple[list[float], Path]) -> list[float]:
    return one_process_run[0]


def _last_weights(dump: Path) -> dict[str, torch.Tensor]:
    """The model a run saved after its last step, whole, read on this process (any layout reads into one)."""
    import checkpoint

    directory = dump / "checkpoint" / "step-4"
    entries = checkpoint.read_index(directory).tensors
    model = {k.removeprefix("model."): torch.empty(e.shape) for k, e in entries.items() if k.startswith("model.")}
    checkpoint.load({"model": model}, directory)
    return model


@pytest.mark.parametrize(
    "world, layout",
    [
        (2, [*PP2, "--parallelism.pipeline_parallel_schedule", "1F1B"]),
        (2, [*PP2, "--parallelism.pipeline_parallel_schedule", "interleaved1f1b"]),  # 2 stages per rank
        (2, [*PP2, "--parallelism.pipeline_parallel_schedule", "GPipe", *MB2]),
        (4, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "2"]),  # PP(2) x FSDP(2)
        (4, [*PP2, "--parallelism.tensor_parallel_degree", "2", "--compile.enable", "--compile.backend",
             "aot_eager"]),  # PP(2) x TP(2), loss parallel on the last stage; compiled blocks (eager: pp2_fsdp2_tp2)
        (4, ["--parallelism.pipeline_parallel_degree", "2", "--training.local_batch_size", "2",
             "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]),  # split backward, V placement, FSDP(2)
        (8, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2",
             "--training.local_batch_size", "2"]),  # PP(2) x FSDP(2) x TP(2)
        (4, [*PP2, "--parallelism.data_parallel_replicate_degree", "2",
             "--training.local_batch_size", "2"]),  # PP(2) x DDP(2)
        (2, [*PP2, "--parallelism.pipeline_parallel_schedule", "DualPipeV", "--activation_checkpoint.mode",
             "selective", "--activation_checkpoint.selective_ac_option", "op"]),  # V, F next to B; W recomputes
    ],
    ids=["pp2_1f1b", "pp2_interleaved", "pp2_gpipe_mb2", "pp2_fsdp2", "pp2_tp2_compiled", "pp2_zbv_fsdp2",
         "pp2_fsdp2_tp2", "pp2_ddp2", "pp2_dualpipev"],
)  # fmt: skip
def test_pipelined_training_follows_one_process(
    tmp_path: Path, one_process_run: tuple[list[float], Path], world: int, layout: list[str]
) -> None:
    """The losses of every step, and every weight after the last, equal one process's to float32 rounding."""
    one_process, one_dump = one_process_run
    losses = _losses(run_world(_train_rank, world, [*JOB, *LAST_SAVE, "--job.dump_folder", str(tmp_path), *layout])[0])
    assert len(losses) == 4 and losses == pytest.approx(one_process, abs=2e-4), (one_process, losses)
    ours, theirs = _last_weights(tmp_path), _last_weights(one_dump)
    assert ours.keys() == theirs.keys() and len(ours) > 20
    for name, weight in ours.items():
        torch.testing.assert_close(weight, theirs[name], rtol=1e-4, atol=1e-5, msg=name)


def test_accumulation_under_pp_is_an_outer_loop_of_whole_pipeline_steps(tmp_path: Path) -> None:
    """Global batch 8 of local batches 4 on PP(2): two whole pipeline steps (of 2 microbatches each) per
    optimizer step, the loss over the step's global target count: one process taking the 8 at once."""
    eight = ["--training.global_batch_size", "8"]
    one = [*JOB, *eight, "--training.local_batch_size", "8", "--job.dump_folder", str(tmp_path / "one")]
    pp = [*JOB, *eight, *PP2, *MB2, "--job.dump_folder", str(tmp_path / "pp")]
    whole = _losses(run_world(_train_rank, 1, one)[0])
    accumulated = _losses(run_world(_train_rank, 2, pp)[0])
    assert len(whole) == 4 and accumulated == pytest.approx(whole, abs=2e-4), (whole, accumulated)


def test_a_pipelined_checkpoint_resumes_bitwise_reshards_into_fsdp_and_converts_to_hf(tmp_path: Path) -> None:
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false"]
    straight = _losses(run_world(_train_rank, 2, [*JOB, *ckpt, *PP2, "--job.dump_folder", str(tmp_path / "pp")])[0])
    for name, world, layout in (("pp_again", 2, PP2), ("fsdp", 2, ["--training.local_batch_size", "2"])):
        shutil.copytree(tmp_path / "pp" / "checkpoint" / "step-2", tmp_path / name / "checkpoint" / "step-2")
        resumed = _losses(
            run_world(_train_rank, world, [*JOB, *ckpt, *layout, "--job.dump_folder", str(tmp_path / name)])[0]
        )
        if name == "pp_again":
            assert resumed == straight[2:], (straight, resumed)
        else:
            assert resumed == pytest.approx(straight[2:], abs=2e-4), (straight, resumed)
    # the two stages wrote disjoint FQNs: convert sees one model, there and back bitwise
    from checkpoint import convert
    from tests.checkpoint.test_convert import _assert_bitwise, _saved_model

    saved = tmp_path / "pp" / "checkpoint" / "step-2"
    assert convert.main(["to-hf", str(saved), str(tmp_path / "hf")]) == 0
    assert convert.main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    _assert_bitwise(_saved_model(tmp_path / "back"), _saved_model(saved))


@pytest.mark.parametrize("flavor", ["debugmodel", "1B"], ids=["untied", "tied"])
def test_hugging_face_weights_load_into_each_stage_as_into_one_process(tmp_path: Path, flavor: str) -> None:
    """checkpoint.initial_load_in_hf under PP(2): each stage takes its own tensors of the folder `to-hf` made of a
    short run's last save (the last stage's copy of a tied output weight is the embedding's), and trains on from
    them as one process does; the trained weights lower the first loss, so they were loaded."""
    from checkpoint import convert
    from tests.trainer.test_resume import _train_tied_rank

    train = _train_tied_rank if flavor == "1B" else _train_rank
    job = [*JOB, "--model.flavor", flavor, "--training.steps", "2"]
    trained = _losses(run_world(train, 1, [*job, *LAST_SAVE, "--job.dump_folder", str(tmp_path / "source")])[0])
    hf = tmp_path / "hf"
    assert convert.main(["to-hf", str(tmp_path / "source" / "checkpoint" / "step-2"), str(hf)]) == 0
    load = [*job, "--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf"]
    one = _losses(run_world(train, 1, [*load, "--job.dump_folder", str(tmp_path / "one")])[0])
    pp = _losses(run_world(train, 2, [*load, *PP2, "--job.dump_folder", str(tmp_path / "pp")])[0])
    assert len(one) == 2 and one[0] < trained[0] - 0.1, (trained, one)
    assert pp == pytest.approx(one, abs=2e-4), (one, pp)


def test_a_csv_schedule_trains_like_the_named_one(tmp_path: Path, one_process: list[float]) -> None:
    """torchtitan's pipeline_parallel_schedule_csv: Interleaved1F1B written out as a CSV (2 stages per rank, read
    off the file) trains as one process; a file missing a microbatch is refused in the pre-flight."""
    from parallelisms.pipeline_parallel import interleaved_1f1b, write_schedule_csv

    write_schedule_csv(interleaved_1f1b(2, 2, 4), tmp_path / "schedule.csv")
    csv = ["--parallelism.pipeline_parallel_schedule_csv", str(tmp_path / "schedule.csv")]
    losses = _losses(run_world(_train_rank, 2, [*JOB, *PP2, *csv, "--job.dump_folder", str(tmp_path / "run")])[0])
    assert losses == pytest.approx(one_process, abs=2e-4), (one_process, losses)
    write_schedule_csv(interleaved_1f1b(2, 2, 2), tmp_path / "short.csv")
    cfg = load_config([*JOB, *PP2, "--parallelism.pipeline_parallel_schedule_csv", str(tmp_path / "short.csv")])
    message = r"pipeline_parallel_schedule_csv, for 4 microbatches .*: stage 0 never runs F for microbatches \[2, 3\]"
    with pytest.raises(ValueError, match=message):
        check_config(cfg, world_size=2)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--validation.enable", "--validation.seq_len", "32"], "validation.seq_len.32. under pipeline"),
        (
            [
                "--parallelism.pipeline_parallel_schedule",
                "ZBVZeroBubble",
                "--parallelism.fsdp_reshard_after_forward",
                "always",
            ],
            "fsdp_reshard_after_forward='always' with .*ZBVZeroBubble",
        ),  # fmt: skip
        (["--parallelism.pipeline_parallel_microbatch_size", "3"], "must be a multiple of"),
        (
            [SCHEDULE, "DualPipeV", "--training.local_batch_size", "2"],
            r"'DualPipeV' with 2 microbatches \(training.local_batch_size.*2 microbatches for 4 stages",
        ),
        (
            [SCHEDULE, "DualPipeV", "--validation.enable", "--validation.local_batch_size", "2"],
            r"'DualPipeV' with 2 microbatches \(validation.local_batch_size.*2 microbatches for 4 stages",
        ),
    ],
)
def test_what_pipelines_cannot_do_yet_is_refused_in_the_preflight(overrides: list[str], message: str) -> None:
    cfg = load_config(
        [*JOB, "--training.global_batch_size", "-1", "--parallelism.pipeline_parallel_degree", "2", *overrides]
    )
    with pytest.raises((ValueError, NotImplementedError), match=message):
        check_config(cfg, world_size=4)


LAYERS_PER_STAGE = "--parallelism.pipeline_parallel_layers_per_stage"
PARTS = "--parallelism.module_fqns_per_model_part"
SIX_LAYERS = ["tok_embeddings", *(f"layers.{i}" for i in range(6)), "norm", "output"]  # the debug model's modules


def _parts(*cuts: list[str]) -> str:
    return ";".join(",".join(cut) for cut in cuts)


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        # (6 layers + 1 + 1) / 3 -> 3 stages on 2 ranks (torchtitan refuses it too; we once rounded up to 2 per rank)
        ([LAYERS_PER_STAGE, "3", SCHEDULE, "Interleaved1F1B"], 2, r"= 3 stages do not divide by .*degree\(2\)"),
        ([LAYERS_PER_STAGE, "1", SCHEDULE, "ZBVZeroBubble"], 2, "'ZBVZeroBubble' runs exactly 2 stages.* is 4 per"),
        ([LAYERS_PER_STAGE, "4", SCHEDULE, "Interleaved1F1B"], 2, "runs 2 or more stages per rank.* is 1 per rank"),
        ([LAYERS_PER_STAGE, "2", SCHEDULE, "1F1B"], 2, "'1F1B' runs exactly 1 stage per rank.* is 2 per rank"),
        ([PARTS, _parts(SIX_LAYERS[:3], SIX_LAYERS[3:6], SIX_LAYERS[6:])], 2, "3 parts do not divide"),
        ([PARTS, _parts(SIX_LAYERS[:4], SIX_LAYERS[5:])], 2, r"\['layers.3'\] are in no part"),
        ([PARTS, _parts(SIX_LAYERS[:4], SIX_LAYERS[5:6] + SIX_LAYERS[4:5] + SIX_LAYERS[6:])], 2, "in the order"),
        ([PARTS, _parts(SIX_LAYERS[:4], SIX_LAYERS[4:] + ["layers.9"])], 2, r"\['layers.9'\] are not modules"),
        (["--parallelism.pipeline_parallel_degree", "8", SCHEDULE, "Interleaved1F1B", "--training.local_batch_size",
          "16"], 8, "16 pipeline stages over 6 layers .* every stage needs a layer"),
    ],
    ids=["stages_not_divisible", "v_needs_two", "multi_needs_two", "single_needs_one", "parts_not_divisible",
         "part_missing", "parts_out_of_order", "unknown_module", "empty_stage"],
)  # fmt: skip
def test_a_split_the_schedule_cannot_run_is_refused_in_the_preflight_with_the_arithmetic(
    overrides: list[str], world_size: int, message: str
) -> None:
    pp2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]
    cfg = load_config([*JOB, "--training.global_batch_size", "-1", *pp2, *overrides])
    with pytest.raises(ValueError, match=message):
        check_config(cfg, world_size=world_size)


def test_splits_the_schedule_runs_pass_the_preflight() -> None:
    from trainer.config.pipeline_setup import resolve_pipeline

    for overrides, per_rank in (
        ([LAYERS_PER_STAGE, "2", SCHEDULE, "Interleaved1F1B"], 2),  # (6 + 2) / 2 = 4 stages
        ([LAYERS_PER_STAGE, "2", SCHEDULE, "ZBVZeroBubble"], 2),
        ([LAYERS_PER_STAGE, "4", SCHEDULE, "GPipe"], 1),
        ([PARTS, _parts(SIX_LAYERS[:4], SIX_LAYERS[4:])], 1),
        ([PARTS, _parts(SIX_LAYERS[:2], SIX_LAYERS[2:4], SIX_LAYERS[4:6], SIX_LAYERS[6:]), SCHEDULE, "LoopedBFS"], 2),
    ):
        cfg = load_config([*JOB, "--training.global_batch_size", "-1", *PP2, *overrides])
        check_config(cfg, world_size=2)
        assert resolve_pipeline(cfg).stages_per_rank == per_rank, overrides


def _validate_rank(argv: list[str]) -> list[str]:
    return _train_rank(argv, logger_name="trainer.validate")


def test_validation_under_pp_gives_one_process_loss(tmp_path: Path) -> None:
    """The forward-only schedule: the held-out loss of PP(2) equals one process's, training unaffected."""
    val = ["--validation.enable", "--validation.freq", "2", "--validation.steps", "2"]
    one = run_world(_validate_rank, 1, [*JOB, *val, "--job.dump_folder", str(tmp_path / "one")])[0]
    pp = run_world(_validate_rank, 2, [*JOB, *val, *PP2, *MB2, "--job.dump_folder", str(tmp_path / "pp")])[0]
    losses = [
        [float(line.split("| loss ")[1].split()[0]) for line in lines if "validate step" in line] for lines in (one, pp)
    ]
    assert len(losses[0]) == 2 and losses[1] == pytest.approx(losses[0], abs=2e-4), losses


def _run_train_sh(*args: str) -> tuple[list[float], str]:
    """`./run_train.sh` on 2 CPU ranks (it must exit 0): the losses rank 0 logged, and the output."""
    import os
    import subprocess

    run = subprocess.run(["./run_train.sh", *JOB, *args], cwd=REPO, env={**os.environ, "NGPU": "2"},
                         capture_output=True, text=True, timeout=180)  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    lines = [line.split("trainer.metrics: ", 1)[1] for line in out.splitlines() if "trainer.metrics: step " in line]
    assert lines, out[-3000:]
    return _losses(lines), out


@pytest.mark.e2e
def test_run_train_sh_trains_a_two_stage_pipeline_like_one_process_and_fsdp_resumes_it(
    tmp_path: Path, one_process: list[float]
) -> None:
    """Through the script: PP(2) follows one process's losses and saves at step 2; FSDP(2) resumes that
    checkpoint (each stage wrote its own FQNs) and goes on like one process."""
    save = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false"]
    pipelined, out = _run_train_sh(*PP2, *save, "--job.dump_folder", str(tmp_path / "pp"))
    assert "mesh_dim_names=('pp',)" in out and pipelined == pytest.approx(one_process, abs=2e-4), out[-3000:]
    shutil.copytree(tmp_path / "pp" / "checkpoint" / "step-2", tmp_path / "fsdp" / "checkpoint" / "step-2")
    fsdp2 = ["--training.local_batch_size", "2", "--checkpoint.enable"]  # the same global batch of 4
    resumed, out = _run_train_sh(*fsdp2, "--job.dump_folder", str(tmp_path / "fsdp"))
    assert "mesh_dim_names=('dp_shard',)" in out and "step-2" in out, out[-3000:]
    assert resumed == pytest.approx(one_process[2:], abs=2e-4), (one_process, resumed)


@pytest.mark.e2e
def test_run_train_sh_trains_a_two_stage_pipeline_from_a_hugging_face_folder(
    tmp_path: Path, one_process_run: tuple[list[float], Path]
) -> None:
    """The user's command: `to-hf` of a run's last save, then PP(2) with checkpoint.initial_load_in_hf through the
    script; it trains on from those weights as one process does."""
    from checkpoint import convert

    hf = tmp_path / "hf"
    assert convert.main(["to-hf", str(one_process_run[1] / "checkpoint" / "step-4"), str(hf)]) == 0
    load = ["--training.steps", "2", "--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_in_hf"]
    pipelined, out = _run_train_sh(*PP2, *load, "--job.dump_folder", str(tmp_path / "pp"))
    one = _losses(run_world(_train_rank, 1, [*JOB, *load, "--job.dump_folder", str(tmp_path / "one")])[0])
    assert f"initialized from {hf}" in out and pipelined == pytest.approx(one, abs=2e-4), (one, pipelined)


def test_tied_embeddings_across_the_first_and_last_stage_train_like_one_process(tmp_path: Path) -> None:
    """The 1B flavor's tied embedding (torchtitan refuses this layout): both stages hold a copy, their
    gradients are summed before clipping and the step; the checkpoint holds the one tied weight and
    resumes on one process. Under ZBVZeroBubble's V placement the two stages are on one rank (the copy's
    gradient is added locally, the copy refreshed after each step and each load): it trains like one
    process too, and resumes the looped run's checkpoint."""
    from tests.trainer.test_resume import _train_tied_rank

    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.last_save_model_only", "false"]
    job = [*JOB, *ckpt, "--model.flavor", "1B"]
    one = _losses(run_world(_train_tied_rank, 1, [*job, "--job.dump_folder", str(tmp_path / "one")])[0])
    pp = _losses(run_world(_train_tied_rank, 2, [*job, *PP2, "--job.dump_folder", str(tmp_path / "pp")])[0])
    assert len(one) == 4 and pp == pytest.approx(one, abs=2e-4), (one, pp)
    import checkpoint

    index = checkpoint.read_index(tmp_path / "pp" / "checkpoint" / "step-2")
    assert "model.tok_embeddings.weight" in index.tensors and "model.output.weight" not in index.tensors
    shutil.copytree(tmp_path / "pp" / "checkpoint" / "step-2", tmp_path / "resumed" / "checkpoint" / "step-2")
    resumed = _losses(run_world(_train_tied_rank, 1, [*job, "--job.dump_folder", str(tmp_path / "resumed")])[0])
    assert resumed == pytest.approx(pp[2:], abs=2e-4), (pp, resumed)
    zbv = [*job, *PP2, "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"]
    v = _losses(run_world(_train_tied_rank, 2, [*zbv, "--job.dump_folder", str(tmp_path / "v")])[0])
    assert v == pytest.approx(one, abs=2e-4), (one, v)
    shutil.copytree(tmp_path / "pp" / "checkpoint" / "step-2", tmp_path / "v_resumed" / "checkpoint" / "step-2")
    v_resumed = _losses(run_world(_train_tied_rank, 2, [*zbv, "--job.dump_folder", str(tmp_path / "v_resumed")])[0])
    assert v_resumed == pytest.approx(pp[2:], abs=2e-4), (pp, v_resumed)


def test_fewer_microbatches_than_stages_is_warned_with_the_bubble() -> None:
    cfg = load_config([*JOB, *PP2, "--training.local_batch_size", "1", "--training.global_batch_size", "-1"])
    warnings = check_config(cfg, world_size=2)
    assert any("1 pipeline microbatches" in w and "for 2 stages" in w and "= 50%" in w for w in warnings), warnings
