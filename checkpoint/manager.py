"""CheckpointManager: when the trainer saves, what it resumes from, and what it keeps.

A folder of committed `step-<N>/` checkpoints (torchtitan's `[checkpoint]` semantics):
- on start, interrupted saves (`*.tmp-*`) are deleted and the job resumes from the latest committed
  step (or `load_step`), whatever parallelism wrote it; with no checkpoint yet, `initial_load_path`
  seeds the model (and, unless `initial_load_model_only`, everything else);
- every `interval` steps and at the last step it saves (the last one only the model, cast to
  `export_dtype`, when `last_save_model_only`); `async_mode = "async"` stages to CPU and writes on a
  background thread with its own gloo group, so the loop only waits for the staging copy;
- after each commit only the newest `keep_latest_k` committed steps are kept (0: all).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .distributed import async_save, load, save
from .format import INDEX_FILE, CheckpointError, read_index
from .stateful import Stateful
from .storage import remove_leftovers, temporary_dir

logger = logging.getLogger(__name__)
_STEP_DIR = re.compile(r"step-(\d+)")
ASYNC_MODES = ("disabled", "async")


def committed_steps(folder: Path) -> list[int]:
    """Steps with a committed checkpoint in `folder`, ascending (a `.tmp-` directory never counts)."""
    if not folder.is_dir():
        return []
    found = [(m, p) for p in folder.iterdir() if (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(int(m.group(1)) for m, p in found if (p / INDEX_FILE).is_file())


class CheckpointManager:
    """Saves and resumes the trainer's `states` ({"model": ..., "optimizer": ..., ...}) in `folder`."""

    def __init__(
        self,
        folder: str | Path,
        states: dict[str, Stateful],
        *,
        interval: int = 500,
        keep_latest_k: int = 10,
        async_mode: str = "disabled",
        last_save_model_only: bool = True,
        export_dtype: str = "float32",
        initial_load_path: str = "",
        initial_load_model_only: bool = True,
        exclude_from_loading: Sequence[str] = (),
        load_step: int = -1,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        if async_mode not in ASYNC_MODES:
            raise ValueError(f"checkpoint.async_mode={async_mode!r}: expected one of {ASYNC_MODES}")
        if "model" not in states:
            raise ValueError("the checkpointed states need a 'model' entry")
        self.folder, self.states, self.interval, self.keep_latest_k = Path(folder), states, interval, keep_latest_k
        self.last_save_model_only, self.export_dtype = last_save_model_only, getattr(torch, export_dtype)
        self.initial_load_path, self.initial_load_model_only = initial_load_path, initial_load_model_only
        self.exclude_from_loading, self.load_step, self.metadata = list(exclude_from_loading), load_step, metadata
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._pending: Future[Path] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._group: dist.ProcessGroup | None = None
        if async_mode == "async":
            # the commit's collectives run on the writer thread: they need a group nothing else uses
            self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")

    # ------------------------------------------------------------------------------- loading
    def load(self) -> int:
        """Resume from the latest committed step (or `load_step`); returns the step to continue
        after (0 for a fresh start)."""
        if self.rank == 0:
            for p in remove_leftovers(self.folder):
                logger.warning("removed %s, left by an interrupted save", p)
        _barrier()
        steps = committed_steps(self.folder)
        if self.load_step >= 0 and self.load_step not in steps:
            raise CheckpointError(f"checkpoint.load_step={self.load_step}: {self.folder} has committed steps {steps}")
        candidates = [self.load_step] if self.load_step >= 0 else steps[::-1]
        # the newest resumable one; a model-only save (the last save's export) only seeds the weights
        resumable = [s for s in candidates if _is_resumable(self.folder / f"step-{s}")]
        if candidates:
            step = resumable[0] if resumable else candidates[0]
            directory = self.folder / f"step-{step}"
            self._load(directory, model_only=not resumable, exclude=self.exclude_from_loading)
            logger.info("resumed from %s%s", directory, "" if resumable else " (model only: training starts at step 0)")
            return step if resumable else 0
        if self.initial_load_path:
            self._load(Path(self.initial_load_path), model_only=self.initial_load_model_only, exclude=[])
            logger.info("initialized from %s", self.initial_load_path)
        return 0

    def _load(self, directory: Path, *, model_only: bool, exclude: Sequence[str]) -> None:
        t0 = time.perf_counter()
        check_model_args(directory, read_index(directory).metadata, self.metadata or {})
        names = ["model"] if model_only else [n for n in self.states if n not in exclude]
        state_dict = {name: self.states[name].state_dict() for name in names}
        load(state_dict, directory)
        for name in names:
            self.states[name].load_state_dict(state_dict[name])
        logger.info("loaded %s from %s in %.2f s", ", ".join(names), directory, time.perf_counter() - t0)

    # -------------------------------------------------------------------------------- saving
    def is_due(self, step: int, *, last: bool) -> bool:
        """Whether `save_if_due(step, last=last)` saves (every `interval` steps and at the last)."""
        return last or step % self.interval == 0

    def save_if_due(self, step: int, *, last: bool) -> None:
        if not self.is_due(step, last=last):
            return
        directory = self.folder / f"step-{step}"
        waited = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - waited
        if directory.exists():  # e.g. a resumed job's last step was already saved
            logger.info("%s exists; not saving step %d again", directory, step)
            return
        model_only = last and self.last_save_model_only
        state_dict = {n: s.state_dict() for n, s in self.states.items() if not model_only or n == "model"}
        if model_only and self.export_dtype != torch.float32:
            state_dict["model"] = {k: v.to(self.export_dtype) for k, v in state_dict["model"].items()}
        t0 = time.perf_counter()
        if self._executor is not None:
            assert self._group is not None or not dist.is_initialized()
            self._pending = async_save(
                state_dict, directory, process_group=self._group, executor=self._executor, metadata=self.metadata
            )
            self._pending.add_done_callback(lambda _: self._purge())
            logger.info("checkpoint step %d staged in %.2f s (after %.2f s waiting for the previous save), writing in "
                        "the background", step, time.perf_counter() - t0, waited)  # fmt: skip
        else:
            save(state_dict, directory, metadata=self.metadata)
            logger.info("checkpoint step %d saved to %s in %.2f s", step, directory, time.perf_counter() - t0)
            self._purge()

    def wait(self) -> None:
        """Block until the background save (if any) has committed; re-raise its failure."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            logger.info("checkpoint %s committed", pending.result())

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def _purge(self) -> None:
        """Keep the newest `keep_latest_k` committed steps (rank 0 deletes; only committed ones)."""
        if self.rank != 0 or self.keep_latest_k <= 0:
            return
        for step in committed_steps(self.folder)[: -self.keep_latest_k]:
            # renamed first, so a crash mid-delete leaves a leftover (cleaned at start), never a
            # committed-looking directory with files missing
            doomed = temporary_dir(self.folder / f"step-{step}", "purge")
            (self.folder / f"step-{step}").rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            logger.info("removed checkpoint step %d (keep_latest_k=%d)", step, self.keep_latest_k)


def _is_resumable(directory: Path) -> bool:
    """A checkpoint with the loop's state (not a model-only export)."""
    return any(k == "train_state" or k.startswith("train_state.") for k in read_index(directory).values)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# Model args the weights do not depend on: the context length (the rotary table is rebuilt for it),
# the vocabulary (its shapes are checked with every tensor) and the init scheme.
_SHAPE_OR_INIT_ARGS = frozenset({"max_seq_len", "vocab_size", "depth_init"})


def check_model_args(directory: Path, saved: dict[str, Any], ours: dict[str, Any]) -> None:
    """Refuse weights saved by a model that computes differently from this job's (e.g. Llama 3.1's
    RoPE scaling into a flavor without it): the shapes would match and the logits silently not."""
    theirs, mine = saved.get("model_args"), ours.get("model_args")
    if not isinstance(theirs, dict) or not isinstance(mine, dict):
        return  # not saved by the trainer (or by a tool that records no model args): shapes only
    mine = json.loads(json.dumps(mine))  # compare as saved (tuples as lists, dataclasses as dicts)
    shared = sorted((set(theirs) & set(mine)) - _SHAPE_OR_INIT_ARGS)  # a field newer than the checkpoint: skipped
    differ = [k for k in shared if theirs[k] != mine[k]]
    if not differ:
        return
    flavor = saved.get("job_config", {}).get("model", {}).get("flavor")
    details = "; ".join(f"{k}: checkpoint {theirs[k]!r}, this job {mine[k]!r}" for k in differ)
    hint = f" (it was saved as model.flavor={flavor!r})" if flavor else ""
    raise CheckpointError(
        f"{directory} holds a model with other architecture than this job's: {details}. Its weights would "
        f"compute other outputs; set model.flavor to the flavor it was trained as{hint}"
    )
