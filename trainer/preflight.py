"""Pre-flight: reject a bad configuration before any rank starts, naming the key and the fix.

`./run_train.sh` runs `python -m trainer.preflight <its args>` before torchrun: it parses the config
(unknown keys and types fail in config.py, with a did-you-mean), checks values and the degree
arithmetic against the world that torchrun will start (NGPU x NNODES), and exits 1 with the error
on the last line. The trainer runs the same checks (`check_config`) on every rank. Degrees are
checked by ParallelDims and the accumulation split by data_files.accumulation_steps, the same code
the ranks run. Both, and the model flavors, are torch-free, so the default job's pre-flight imports
no torch and takes a quarter of a second (torch alone takes about three on 2 CPU cores); only
checks of optional features (profiling, compile, checkpoints) import what they check.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

from .config import JobConfig, load_config

# (key, check, what it must be) for values that have a valid range
_RANGES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("training.steps", lambda v: v >= 1, ">= 1"),
    ("training.local_batch_size", lambda v: v >= 1, ">= 1"),
    ("training.seq_len", lambda v: v >= 1, ">= 1"),
    ("training.global_batch_size", lambda v: v == -1 or v >= 1, "-1 (local x dp) or >= 1"),
    ("model.vocab_size", lambda v: v >= 0, ">= 0 (0: the tokenizer's)"),
    ("optimizer.lr", lambda v: v >= 0, ">= 0"),
    ("optimizer.eps", lambda v: v > 0, "> 0"),
    ("optimizer.weight_decay", lambda v: v >= 0, ">= 0"),
    ("lr_scheduler.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("lr_scheduler.min_lr_factor", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("metrics.log_freq", lambda v: v >= 1, ">= 1"),
    ("metrics.peak_tflops", lambda v: v >= 0, ">= 0 (0: from the GPU's name)"),
    ("comm.init_timeout_seconds", lambda v: v > 0, "> 0"),
    ("checkpoint.interval", lambda v: v >= 1, ">= 1"),
    ("checkpoint.keep_latest_k", lambda v: v >= 0, ">= 0 (0: keep all)"),
    ("checkpoint.load_step", lambda v: v >= -1, "-1 (the latest) or a saved step"),
    ("validation.freq", lambda v: v >= 1, ">= 1"),
    ("validation.steps", lambda v: v == -1 or v >= 1, "-1 (the whole held-out set) or >= 1"),
    ("validation.local_batch_size", lambda v: v >= 0, ">= 0 (0: training.local_batch_size)"),
    ("validation.seq_len", lambda v: v >= 0, ">= 0 (0: training.seq_len)"),
    ("profiling.profile_freq", lambda v: v >= 1, ">= 1"),
    ("profiling.profiler_warmup", lambda v: v >= 0, ">= 0"),
    ("profiling.profiler_active", lambda v: v >= 1, ">= 1"),
]
_CHECKPOINT_STATES = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")


def check_config(cfg: JobConfig, world_size: int | None = None) -> None:
    """Raise ValueError naming the first bad key: value ranges, divisibility by tp and, given the
    world size, the degree arithmetic and the global batch split."""
    for key, ok, want in _RANGES:
        section, name = key.split(".")
        if not hasattr(cfg, section) or not hasattr(getattr(cfg, section), name):
            continue
        value = getattr(getattr(cfg, section), name)
        if not ok(value):
            raise ValueError(f"{key}={value!r}: must be {want}")
    if world_size is not None:  # the degree arithmetic and the accumulation split, where they live
        from parallelisms.parallel_dims import ParallelDims

        from .data_files import accumulation_steps

        p = cfg.parallelism
        dims = ParallelDims(
            dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
            world_size=world_size,
        )  # fmt: skip
        if cfg.training.global_batch_size != -1:
            accumulation_steps(
                cfg.training.global_batch_size, cfg.training.local_batch_size, dims.dp_replicate * dims.dp_shard
            )
    _check_tp_divides_model(cfg)
    _check_data(cfg)
    _check_checkpoint(cfg)
    _check_validation(cfg)
    if cfg.profiling.enable_profiling:
        from .profiling import check_profiling

        check_profiling(cfg.profiling)
    if cfg.compile.enable:
        from models.llama3.parallelize import check_compile_supported  # NotImplementedError with TP

        check_compile_supported(cfg.parallelism.tensor_parallel_degree)


def _check_validation(cfg: JobConfig) -> None:
    """Validation sequences fit the model and the TP split, and its data is held out: local files other
    than the training files, or the embedded held-out corpus (a hub set would be read from "train")."""
    val, training = cfg.validation, cfg.training
    if not val.enable:
        return
    seq_len, tp = val.seq_len or training.seq_len, cfg.parallelism.tensor_parallel_degree
    if seq_len > training.seq_len:
        raise ValueError(
            f"validation.seq_len({val.seq_len}) must be <= training.seq_len({training.seq_len}), the model's "
            f"max_seq_len (its RoPE table); lower it, or 0 for training.seq_len"
        )
    if seq_len % tp:
        raise ValueError(
            f"validation.seq_len({seq_len}) must be divisible by parallelism.tensor_parallel_degree({tp}) (sequence "
            f"parallelism shards it); pick a multiple of {tp}"
        )
    if not val.dataset_path:
        if val.dataset != "embedded":
            raise ValueError(
                f"validation.dataset={val.dataset!r}: hub datasets are not read for validation (the loader reads "
                f"their split 'train', the training data); set validation.dataset_path to local held-out files, "
                f"or validation.dataset='embedded'"
            )
        return
    from .data_files import resolve_data_files

    try:
        files = {p.resolve() for p in resolve_data_files(val.dataset_path)[1]}
    except ValueError as e:  # data.py names the training key
        raise ValueError(str(e).replace("training.dataset_path", "validation.dataset_path")) from None
    if training.dataset_path and files & {p.resolve() for p in resolve_data_files(training.dataset_path)[1]}:
        raise ValueError(
            f"validation.dataset_path={val.dataset_path!r} shares files with training.dataset_path="
            f"{training.dataset_path!r}: a validation loss on training data is not held out; point it at other files"
        )


def _check_checkpoint(cfg: JobConfig) -> None:
    """exclude_from_loading names states the trainer saves; initial_load_path is a committed checkpoint."""
    ckpt = cfg.checkpoint
    unknown = [name for name in ckpt.exclude_from_loading if name not in _CHECKPOINT_STATES]
    if unknown:
        raise ValueError(f"checkpoint.exclude_from_loading={ckpt.exclude_from_loading}: {unknown} are not saved "
                         f"states; choose from {list(_CHECKPOINT_STATES)}")  # fmt: skip
    if ckpt.enable and ckpt.initial_load_path:
        from pathlib import Path

        if not (Path(ckpt.initial_load_path) / "index.json").is_file():
            raise ValueError(
                f"checkpoint.initial_load_path={ckpt.initial_load_path!r} is not a committed checkpoint (no "
                f"index.json); point it at a step-<N> directory or at `python -m checkpoint.convert from-hf` output"
            )


def _check_data(cfg: JobConfig) -> None:
    """The tokenizer loads, model.vocab_size covers it and tp divides the vocabulary (each TP rank
    holds an equal slice of the embedding and output), and dataset_path names data files."""
    from .tokenizer import build_tokenizer, model_vocab_size  # the tokenizers package only with a path

    vocab = model_vocab_size(build_tokenizer(cfg.model.tokenizer_path), cfg.model.vocab_size)
    tp = cfg.parallelism.tensor_parallel_degree
    if vocab % tp:
        padded = -(-vocab // tp) * tp
        raise ValueError(
            f"the model's vocabulary({vocab}) must be divisible by parallelism.tensor_parallel_degree({tp}); "
            f"set model.vocab_size={padded} (pads the embedding and output)"
        )
    if cfg.training.dataset_path:
        from .data_files import resolve_data_files

        resolve_data_files(cfg.training.dataset_path)


def _check_tp_divides_model(cfg: JobConfig) -> None:
    from models.llama3.args import llama3_configs  # dataclasses only, no torch

    tp = cfg.parallelism.tensor_parallel_degree
    if cfg.model.name != "llama3" or cfg.model.flavor not in llama3_configs:
        return  # build_model names the bad flavor
    args = llama3_configs[cfg.model.flavor]
    kv = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
    for what, n in (("n_heads", args.n_heads), ("n_kv_heads", kv)):
        if n % tp:
            raise ValueError(
                f"parallelism.tensor_parallel_degree({tp}) must divide the {cfg.model.flavor} flavor's {what}({n}): "
                f"each TP rank holds whole heads; pick a divisor of {n}"
            )
    if cfg.training.seq_len % tp:
        raise ValueError(
            f"training.seq_len({cfg.training.seq_len}) must be divisible by parallelism.tensor_parallel_degree({tp}) "
            f"(sequence parallelism shards it); pick a multiple of {tp}"
        )


def main(argv: list[str]) -> int:
    try:
        cfg = load_config(argv)
        world = int(os.environ.get("NGPU", "1")) * int(os.environ.get("NNODES", "1"))
        check_config(cfg, world)
        log_rank = os.environ.get("LOG_RANK", "0")
        for r in log_rank.split(","):
            if r.strip() and not 0 <= int(r) < world:
                raise ValueError(
                    f"LOG_RANK={log_rank!r}: rank {r} does not exist in a world of {world}; use 0..{world - 1}"
                )
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
