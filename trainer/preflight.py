"""Pre-flight: reject a bad configuration before any rank starts, naming the key and the fix.

`./run_train.sh` runs `python -m trainer.preflight <its args>` before torchrun: it parses the config
(unknown keys and types fail in config.py, with a did-you-mean), checks values and the degree
arithmetic against the world that torchrun will start (NGPU x NNODES), and exits 1 with the error
on the last line, in about a second. The trainer runs the same checks (`check_config`) on every rank.
Degrees are checked by ParallelDims and the accumulation split by data.accumulation_steps, the
same code the ranks run; importing them (and torch) keeps it at about a second.
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
    ("comm.init_timeout_seconds", lambda v: v > 0, "> 0"),
    ("checkpoint.interval", lambda v: v >= 1, ">= 1"),
    ("checkpoint.keep_latest_k", lambda v: v >= 0, ">= 0 (0: keep all)"),
    ("checkpoint.load_step", lambda v: v >= -1, "-1 (the latest) or a saved step"),
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

        from .data import accumulation_steps

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
        from .data import resolve_data_files

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
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
