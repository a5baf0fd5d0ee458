"""Pre-flight: ./run_train.sh rejects bad configs before torchrun starts, in about a second,
with the key and the fix on the last line, and leaves an earlier run's outputs alone."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.config import load_config
from trainer.preflight import check_config

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], **env: str) -> tuple[int, str, float]:
    start = time.perf_counter()
    done = subprocess.run(
        ["./run_train.sh", *args], cwd=REPO, env={**os.environ, "NGPU": "2", **env},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, lines[-1] if lines else "", time.perf_counter() - start


@pytest.mark.parametrize(
    "args, env, message",
    [
        (["--training.steps", "0"], {}, "training.steps=0: must be >= 1"),
        (["--training.local_batch_size", "0"], {}, "training.local_batch_size=0: must be >= 1"),
        (["--training.seq_len", "0"], {}, "training.seq_len=0: must be >= 1"),
        (["--metrics.log_freq", "0"], {}, "metrics.log_freq=0: must be >= 1"),
        (["--optimizer.lr", "-1"], {}, "optimizer.lr=-1.0: must be >= 0"),
        (["--training.stepz", "3"], {}, "did you mean 'steps'"),
        (["--model.flavor", "debugmodle"], {}, "'debugmodle' is not a llama3 flavor (did you mean 'debugmodel'?)"),
        (["--model.name", "llama4"], {}, "model.name='llama4' is not a model family here (did you mean 'llama3'?)"),
        (["--optimizer.name", "SGD"], {}, "optimizer.name='SGD': only 'AdamW' is available"),
        (["--parallelism.tensor_parallel_degree", "3"], {}, "world_size(2) is not divisible by tp_degree(3)"),
        (
            ["--parallelism.tensor_parallel_degree", "3"],
            {"NGPU": "3"},
            "must divide the debugmodel flavor's n_heads(16)",
        ),
        (["--training.global_batch_size", "6"], {}, "x data-parallel degree(2) = 4; 6 / 4 = 1.5 micro-batches"),
        ([], {"LOG_RANK": "5"}, "LOG_RANK='5': rank 5 does not exist in a world of 2"),
        (["--checkpoint.interval", "0"], {}, "checkpoint.interval=0: must be >= 1"),
        (["--checkpoint.exclude_from_loading", "optimiser"], {}, "['optimiser'] are not saved states"),
        (["--checkpoint.enable", "--checkpoint.initial_load_path", "/no"], {}, "is not a committed checkpoint"),
    ],
)
def test_bad_config_fails_before_torchrun(tmp_path: Path, args: list[str], env: dict[str, str], message: str) -> None:
    earlier = tmp_path / "config.toml"
    earlier.write_text("# an earlier run's config\n")
    rc, last, seconds = _run([*args, "--job.dump_folder", str(tmp_path)], **env)
    assert rc == 1 and message in last, (rc, last)
    assert seconds < 20, seconds
    assert earlier.read_text() == "# an earlier run's config\n"  # nothing written


def test_check_config_accepts_the_debug_job() -> None:
    check_config(load_config(["--job.config_file", str(REPO / "configs" / "debug_model.toml")]), world_size=2)


def test_preflight_of_the_default_job_imports_no_torch() -> None:
    """Every launch runs pre-flight first: without torch it costs a quarter of a second, not three. The whole
    config room (trainer/config/) is torch-free, and a pipeline job's setup is resolved without torch too."""
    rooms = sorted(
        f"trainer.config.{p.stem}" for p in (REPO / "trainer" / "config").glob("*.py") if p.stem != "__init__"
    )
    assert "trainer.config.pipeline_setup" in rooms, rooms
    code = (
        "import importlib, sys\n"
        f"for name in {rooms!r}: importlib.import_module(name)\n"
        "from trainer.config import load_config\n"
        "from trainer.preflight import check_config\n"
        "check_config(load_config(['--job.config_file', 'configs/debug_model.toml']), world_size=2)\n"
        "pp2 = ['--parallelism.pipeline_parallel_degree', '2', '--parallelism.data_parallel_shard_degree', '1']\n"
        "check_config(load_config(['--job.config_file', 'configs/debug_model.toml', *pp2]), world_size=2)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def _preflight(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer.preflight", *args], cwd=REPO, env={**os.environ, "NGPU": "2"},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_a_warmup_longer_than_the_run_is_warned_and_clamped() -> None:
    done = _preflight("--lr_scheduler.warmup_steps", "100", "--training.steps", "3")
    assert done.returncode == 0, done.stderr
    assert "config warning: lr_scheduler.warmup_steps(100) >= training.steps(3)" in done.stderr
    from trainer.lr_schedule import lr_factor

    factors = [lr_factor(s, warmup_steps=100, total_steps=3, decay_type="linear", min_lr_factor=0.0) for s in range(3)]
    assert factors[-1] == 1.0 and factors[0] < factors[1] < 1.0  # the last step trains at the peak


@pytest.mark.parametrize("inside", [False, True])
def test_a_dump_folder_that_is_a_file_names_the_key(tmp_path: Path, inside: bool) -> None:
    blocker = tmp_path / "outputs"
    blocker.write_text("a file, not a folder")
    folder = blocker / "run" if inside else blocker
    done = _preflight("--job.dump_folder", str(folder))
    assert done.returncode == 1
    assert done.stderr.strip().startswith(f"config error: job.dump_folder='{folder}': {folder} "), done.stderr
    assert "is a file, not a folder" in done.stderr or "is an existing file" in done.stderr


def test_a_checkpoint_folder_that_cannot_be_created_names_the_key(tmp_path: Path) -> None:
    (tmp_path / "checkpoint").write_text("in the way")
    done = _preflight("--job.dump_folder", str(tmp_path), "--checkpoint.enable")
    assert done.returncode == 1 and "config error: checkpoint.folder='checkpoint':" in done.stderr, done.stderr


def test_initial_load_path_is_checked_without_checkpoint_enable(tmp_path: Path) -> None:
    done = _preflight("--checkpoint.initial_load_path", str(tmp_path / "nowhere"))
    assert done.returncode == 1 and "is not a committed checkpoint" in done.stderr, done.stderr


def test_a_model_whose_state_cannot_fit_host_memory_is_refused_before_launch() -> None:
    """On CPU ranks the model's state (parameters, gradients, AdamW's moments: 16 bytes a float32 parameter,
    split over the ranks that shard it) must fit in the memory the kernel reports available; 8B on 2 ranks
    needs 60 GiB a rank, which would otherwise allocate for minutes and end in the OOM killer."""
    from trainer.config.state_floor import GIB, check_host_memory
    from trainer.preflight import build_parallel_dims

    eight_b = load_config(["--model.flavor", "8B", "--model.vocab_size", "128256"])
    with pytest.raises(ValueError, match=r"model.flavor='8B' does not fit this machine: its 8,030,261,248 "
                                         r"parameters.* 59.8 GiB a rank .*119.7 GiB for the 2 ranks here"):  # fmt: skip
        check_host_memory(eight_b, build_parallel_dims(eight_b.parallelism, 2), 2, available=24 * GIB)
    on_16 = build_parallel_dims(eight_b.parallelism, 16)
    check_host_memory(eight_b, on_16, 2, available=24 * GIB)  # 7.5 GiB a rank: fits
    default = load_config([])
    check_host_memory(default, build_parallel_dims(default.parallelism, 2), 2, available=GIB)


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="reads Linux's MemAvailable")
def test_run_train_sh_refuses_a_model_no_machine_here_can_hold() -> None:
    """run_train.sh tells the pre-flight how many GPUs it found (CUDA_VISIBLE_DEVICES=-1 hides any): none, so
    the ranks would hold 405B's state in host memory, which no machine running this suite has."""
    rc, last, seconds = _run(["--model.flavor", "405B", "--model.vocab_size", "128256"], CUDA_VISIBLE_DEVICES="-1")
    assert rc == 1 and "model.flavor='405B' does not fit this machine" in last and "train a smaller" in last, last
    assert seconds < 20, seconds
    # with a GPU (as told), host memory is not the limit: the same job passes on to the dry run's territory
    told = {**os.environ, "NGPU": "2", "GPUS_HERE": "8"}
    command = [sys.executable, "-m", "trainer.preflight", "--model.flavor", "405B"]
    done = subprocess.run(command, cwd=REPO, env=told, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# ------------------------------------------------------------- faults found in the second probing round
_PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1"]


def _checked(tmp_path: Path, *args: str) -> list[str]:
    return check_config(load_config(["--job.dump_folder", str(tmp_path), *args]), world_size=2)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_layers_per_stage_is_range_checked(tmp_path: Path, value: str) -> None:
    """Before: 0 was silently taken as unset, and -1 said "-8 stages"."""
    with pytest.raises(ValueError, match=rf"pipeline_parallel_layers_per_stage={value}: must be unset \(None\) or"):
        _checked(tmp_path, *_PP2, "--parallelism.pipeline_parallel_layers_per_stage", value)


def test_a_csv_schedule_that_deadlocks_fails_the_preflight_naming_the_waits(tmp_path: Path) -> None:
    """Before: it passed, and the ranks started and failed at step 1. Rank 1 starts with microbatch 1, whose
    forward rank 0 runs only after microbatch 0's backward."""
    csv = tmp_path / "cyclic.csv"
    csv.write_text("0F0,0B0,0F1,0B1\n1F1,1B1,1F0,1B0\n")
    two = ["--training.local_batch_size", "2", "--parallelism.pipeline_parallel_microbatch_size", "1"]
    with pytest.raises(ValueError, match=r"cyclic.csv' cannot run 2 microbatches: .*ranks 0, 1 wait forever"):
        _checked(tmp_path, *_PP2, *two, "--parallelism.pipeline_parallel_schedule_csv", str(csv))


@pytest.mark.parametrize(
    ("args", "folder", "key"),
    [
        (["--profiling.enable_profiling"], "profile_traces", "profiling.save_traces_folder"),
        (["--metrics.enable_tensorboard"], "tb", "metrics.save_tb_folder"),
        ([], "logs", "job.dump_folder"),
    ],
)
def test_an_output_sub_folder_that_is_a_file_fails_the_preflight(
    tmp_path: Path, args: list[str], folder: str, key: str
) -> None:
    """Before: every rank failed with a traceback (at step 2 for the traces)."""
    (tmp_path / folder).write_text("a file where the job writes a folder\n")
    with pytest.raises(ValueError, match=rf"{key}=.*{folder} is an existing file, not a folder"):
        _checked(tmp_path, *args)


def test_a_compile_backend_typo_fails_the_preflight_with_a_suggestion(tmp_path: Path) -> None:
    """Before: torch's InvalidBackend traceback on every rank after launch."""
    with pytest.raises(ValueError, match=r"compile.backend='inductr' is not a torch.compile backend.*'inductor'"):
        _checked(tmp_path, "--compile.enable", "--compile.backend", "inductr")
    _checked(tmp_path, "--compile.enable", "--compile.backend", "aot_eager")


def test_profiling_that_can_never_record_is_warned(tmp_path: Path) -> None:
    """Before: with profile_freq past the last step no trace was written and nothing said why."""
    warnings = _checked(tmp_path, "--profiling.enable_profiling", "--profiling.profile_freq", "10",
                        "--training.steps", "5")  # fmt: skip
    assert any("profiling.profile_freq(10) > training.steps(5)" in w for w in warnings), warnings
    assert not any("profile_freq" in w for w in _checked(tmp_path, "--profiling.enable_profiling"))


def test_an_hf_folder_as_initial_load_path_is_pointed_at_initial_load_in_hf(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    (hf / "model.safetensors").write_bytes(b"")
    with pytest.raises(
        ValueError,
        match=r"is a Hugging Face model folder, not a meshtrain checkpoint; set checkpoint.initial_load_in_hf=true",
    ):
        _checked(tmp_path, "--checkpoint.initial_load_path", str(hf))


@pytest.mark.parametrize(
    "args, world, message",
    [
        (["--parallelism.expert_parallel_degree", "2"], 2,
         r"^parallelism.expert_parallel_degree\(2\): the llama3 debugmodel flavor has no MoE layers, .* set it to 1"),
        (["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", "--parallelism.expert_parallel_degree", "3"],
         3, r"^parallelism.expert_parallel_degree\(3\) must divide the debugmodel flavor's num_experts\(8\): .* "
            r"pick one of \[1, 2, 4, 8\]"),
        (["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "4"],
         2, r"^expert_parallel_degree\(4\) must divide dp_shard_degree\(2\) = 2, the ranks expert parallelism "
            r"borrows"),
        (["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree", "2",
          "--parallelism.tensor_parallel_degree", "2", "--parallelism.expert_tensor_parallel_degree", "3"],
         4, r"^expert_tensor_parallel_degree\(3\) must be 1 .* or tensor_parallel_degree\(2\)"),
    ],
)  # fmt: skip
def test_expert_parallel_degrees_that_do_not_fit_fail_the_preflight(args: list[str], world: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_config(load_config(args), world)


def test_expert_parallel_layouts_pass_the_preflight() -> None:
    moe = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--parallelism.expert_parallel_degree"]
    check_config(load_config([*moe, "8"]), 8)
    check_config(load_config([*moe, "2", "--parallelism.tensor_parallel_degree", "2"]), 4)
    check_config(load_config([*moe, "2", "--parallelism.tensor_parallel_degree", "2",
                              "--parallelism.expert_tensor_parallel_degree", "2"]), 4)  # fmt: skip
