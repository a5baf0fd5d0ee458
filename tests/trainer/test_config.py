"""Config: precedence (defaults < TOML < CLI), typed parsing, did-you-mean errors, saving."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from trainer.config import JobConfig, load_config, parse_value, save_config

REPO = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return str(path)


def test_precedence_defaults_toml_cli(tmp_path: Path) -> None:
    path = _write(tmp_path, "[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1e-3\n")
    cfg = load_config(["--job.config_file", path, "--training.steps", "3"])
    assert cfg.training.steps == 3  # CLI beats TOML
    assert cfg.training.seq_len == 64  # TOML beats default
    assert cfg.optimizer.lr == 1e-3
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default kept
    assert cfg.job.config_file == path


def test_cli_without_file_and_equals_syntax() -> None:
    cfg = load_config(["--training.seed=5", "--lr_scheduler.decay_type", "cosine"])
    assert cfg.training.seed == 5 and cfg.lr_scheduler.decay_type == "cosine"


def test_debug_config_loads() -> None:
    cfg = load_config(["--job.config_file", str(REPO / "configs" / "debug_model.toml")])
    assert cfg.model.flavor == "debugmodel" and cfg.parallelism.data_parallel_shard_degree == -1


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--trainig.steps", "3"], "did you mean 'training'"),
        (["--training.step", "3"], "did you mean 'steps'"),
        (["--parallelism.tensor_parallel", "2"], "did you mean 'tensor_parallel_degree'"),
    ],
)
def test_unknown_cli_key_suggests(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(argv)


def test_unknown_toml_key_suggests(tmp_path: Path) -> None:
    path = _write(tmp_path, "[optimizer]\nweight_decy = 0.1\n")
    with pytest.raises(ValueError, match="did you mean 'weight_decay'"):
        load_config(["--job.config_file", path])
    path = _write(tmp_path, "[optimiser]\nlr = 0.1\n")
    with pytest.raises(ValueError, match="did you mean 'optimizer'"):
        load_config(["--job.config_file", path])


def test_bool_parsing() -> None:
    assert load_config(["--metrics.enable_tensorboard", "true"]).metrics.enable_tensorboard is True
    assert load_config(["--parallelism.enable_loss_parallel", "False"]).parallelism.enable_loss_parallel is False
    assert load_config(["--metrics.enable_tensorboard"]).metrics.enable_tensorboard is True  # bare flag
    with pytest.raises(TypeError, match="expected a bool"):
        load_config(["--checkpoint.enable", "yes-please"])


def test_int_float_parsing() -> None:
    cfg = load_config(
        ["--training.steps", "12", "--optimizer.lr", "3e-4", "--parallelism.data_parallel_shard_degree", "-1"]
    )
    assert cfg.training.steps == 12 and isinstance(cfg.training.steps, int)
    assert cfg.optimizer.lr == 3e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.parallelism.data_parallel_shard_degree == -1
    with pytest.raises(TypeError, match="training.steps='1.5': expected an int"):
        load_config(["--training.steps", "1.5"])
    with pytest.raises(TypeError, match="expected a float"):
        load_config(["--optimizer.lr", "fast"])
    assert parse_value(2, float, "x") == 2.0  # TOML ints are fine for float fields


def test_literal_rejects_unknown_choice() -> None:
    with pytest.raises(ValueError, match=r"expected one of \['linear', 'sqrt', 'cosine'\]"):
        load_config(["--lr_scheduler.decay_type", "step"])


def test_save_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(["--training.steps", "4", "--job.dump_folder", str(tmp_path)])
    path = save_config(cfg, tmp_path)
    assert (tmp_path / "config.json").is_file()
    reloaded = load_config(["--job.config_file", str(path)])
    reloaded.job.config_file = cfg.job.config_file
    assert reloaded == cfg
    assert tomllib.loads(path.read_text())["training"]["steps"] == 4


def test_nested_sections_round_trip_through_toml(tmp_path: Path) -> None:
    cfg = load_config(["--quantize.linear.float8.filter_fqns", "output,norm", "--training.seed", "none"])
    assert cfg.quantize.linear.float8.filter_fqns == ["output", "norm"] and cfg.training.seed is None
    path = save_config(cfg, tmp_path)
    assert "[quantize.linear.float8]" in path.read_text()
    reloaded = load_config(["--job.config_file", str(path), "--training.seed", "none"])
    reloaded.job.config_file = None
    assert reloaded == cfg


@pytest.mark.parametrize("raw", ["inf", "nan", "-inf", "1e999"])
def test_nonfinite_numbers_are_config_errors(tmp_path: Path, raw: str) -> None:
    """`--optimizer.lr inf` used to pass the pre-flight and crash in the metrics line."""
    with pytest.raises(ValueError, match=rf"optimizer.lr='{raw}': expected a finite number"):
        load_config(["--optimizer.lr", raw])
    toml = _write(tmp_path, "[training]\nmax_norm = nan\n")
    with pytest.raises(ValueError, match=r"training.max_norm=nan: expected a finite number"):
        load_config(["--job.config_file", toml])


def test_list_of_lists_from_the_command_line() -> None:
    cfg = load_config(["--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0;layers.1,norm,output"])
    parts = cfg.parallelism.module_fqns_per_model_part
    assert parts == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]


def test_lists_written_as_in_toml_on_the_command_line() -> None:
    """torchtitan's configs spell these values as TOML arrays; the same text works on the command line (where
    it used to be split at its commas into bracketed, quoted names), and a malformed one names the key."""
    parts = '[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]'
    cfg = load_config(["--parallelism.module_fqns_per_model_part", parts, "--model.converters", '["float8"]'])
    expected = [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]
    assert cfg.parallelism.module_fqns_per_model_part == expected
    assert cfg.model.converters == ["float8"]
    with pytest.raises(ValueError, match=r"module_fqns_per_model_part=.*not a TOML array.*quote every string"):
        load_config(["--parallelism.module_fqns_per_model_part", "[[tok_embeddings]]"])
    with pytest.raises(TypeError, match=r"model.converters=1: expected a string"):
        load_config(["--model.converters", "[1]"])


def test_the_config_reference_page_is_the_code_s() -> None:
    from trainer.config.help_text import config_reference

    page = Path(__file__).resolve().parents[2] / "docs" / "config_reference.md"
    assert page.read_text() == config_reference(), (
        "docs/config_reference.md is stale: python -m trainer.config.help_text > docs/config_reference.md"
    )
