"""CheckpointManager: when the trainer saves, what it resumes from, and what it keeps.

A folder of committed `step-<N>/` checkpoints (torchtitan's `[checkpoint]` semantics):
- on start, interrupted saves (`*.tmp-*`) are deleted and the job resumes from the latest resumable
  step (or `load_step`), whatever parallelism wrote it; newer folders it passes over (model-only
  exports, an incomplete step without index.json) are named with the reason. With no checkpoint yet,
  `initial_load_path` (a meshtrain checkpoint, or with `initial_load_in_hf` a Hugging Face folder,
  by default `model.hf_assets_path`) seeds the model (and, unless `initial_load_model_only`,
  everything else), also when `enable` is off (then nothing else is read or saved);
- every `interval` steps, at the last step (and after step 1 with `enable_first_step_checkpoint`) it
  saves, unless `load_only`: the last one only the model, cast to `export_dtype`, when
  `last_save_model_only` (as a Hugging Face folder `step-<N>-hf/` with `last_save_in_hf`);
  `async_mode = "async"` (or "async_with_pinned_mem") stages to CPU and writes on a background thread
  with its own gloo group, so the loop only waits for the staging copy;
- a folder in the way of a save (a model-only export where the resumable step goes, an incomplete
  or a replaced step) is renamed `step-<N>.<reason>` (kept, never deleted; never loaded again);
- after each commit the steps older than the newest `keep_latest_k` resumable ones are deleted (0: none);
  a model-only save does not count against them, so the newest resume point is always kept;
- `create_seed_checkpoint` saves the initialized model as step-0 and the trainer stops.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .distributed import async_save, load, save
from .format import CheckpointError, read_index
from .hf_adapter_protocol import HFAdapter
from .hf_state import check_hf_folder, hf_job_model_args, load_hf_model, save_hf_model
from .stateful import Stateful
from .step_folders import LOADABLE, StepKind, clear_way, report_passed_over, step_folders, step_kind, steps_to_purge
from .step_folders import committed_steps as committed_steps  # re-exported: where callers list the committed steps
from .storage import remove_leftovers, temporary_dir

logger = logging.getLogger(__name__)
ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")


@dataclass(frozen=True)
class StateRoles:
    """What the caller's states mean to the manager, which knows no trainer convention of its own: which
    state holds the weights (model-only saves, initial and HF loads), which one makes a checkpoint a
    resume point (and holds the step it continues after), and how to refuse weights of another model
    (`compatible(directory, saved_metadata, our_metadata)` raises; None: shapes only)."""

    model: str = "model"
    resumable: str = "train_state"
    compatible: Callable[[Path, dict[str, Any], dict[str, Any]], None] | None = None


class CheckpointManager:
    """Saves and resumes the trainer's `states` ({"model": ..., "optimizer": ..., ...}) in `folder`.

    The keyword arguments are torchtitan v0.2.0's `[checkpoint]` keys (see the module docstring), plus
    `hf_assets_path` (model.hf_assets_path, the Hugging Face folder `initial_load_in_hf` reads when
    `initial_load_path` is "") and `metadata` (saved with every checkpoint; `roles.compatible` compares it
    with the metadata of any weights loaded; an HF load reads its "model_args"), `roles`: what the states
    mean (StateRoles), and `hf_adapter`: the model family's Hugging Face adapter (checkpoint/hf_adapter_protocol.py;
    the caller looks it up, e.g. `models.hf_adapters.hf_adapter(model.name)`), needed by `initial_load_in_hf`
    and `last_save_in_hf`. `enable_ft_dataloader_checkpoints` and `initial_load_in_hf_quantized` are accepted and
    ignored: fault tolerance does not exist here, the pre-flight refuses the other.
    """

    def __init__(
        self,
        folder: str | Path,
        states: dict[str, Stateful],
        *,
        enable: bool = True,
        interval: int = 500,
        keep_latest_k: int = 10,
        async_mode: str = "disabled",
        last_save_model_only: bool = True,
        last_save_in_hf: bool = False,
        export_dtype: str = "float32",
        initial_load_path: str = "",
        initial_load_model_only: bool = True,
        initial_load_in_hf: bool = False,
        initial_load_in_hf_quantized: bool = False,
        hf_assets_path: str = "",
        exclude_from_loading: Sequence[str] = (),
        load_step: int = -1,
        enable_first_step_checkpoint: bool = False,
        load_only: bool = False,
        create_seed_checkpoint: bool = False,
        enable_ft_dataloader_checkpoints: bool = True,
        metadata: dict[str, Any] | None = None,
        roles: StateRoles | None = None,
        hf_adapter: HFAdapter[Any] | None = None,
    ) -> None:
        del initial_load_in_hf_quantized, enable_ft_dataloader_checkpoints  # accepted for torchtitan's configs
        _check_options(async_mode, last_save_model_only, last_save_in_hf, initial_load_model_only,
                       initial_load_in_hf, initial_load_path or hf_assets_path, hf_adapter)  # fmt: skip
        self.roles = roles or StateRoles()
        if self.roles.model not in states:
            raise ValueError(f"the checkpointed states need a {self.roles.model!r} entry (StateRoles.model)")
        self.folder, self.states, self.interval, self.keep_latest_k = Path(folder), states, interval, keep_latest_k
        self.enable, self.saving = enable, enable and not load_only  # load_only: resume as usual, never save
        self.last_save_model_only, self.last_save_in_hf = last_save_model_only, last_save_in_hf
        self.export_dtype_name, self.export_dtype = export_dtype, getattr(torch, export_dtype)
        self.initial_load_path, self.initial_load_model_only = initial_load_path, initial_load_model_only
        self.initial_load_in_hf, self.hf_assets_path = initial_load_in_hf, hf_assets_path
        self.hf_adapter = hf_adapter
        self.exclude_from_loading, self.load_step, self.metadata = list(exclude_from_loading), load_step, metadata
        self.enable_first_step_checkpoint, self.load_only = enable_first_step_checkpoint, load_only
        self.create_seed_checkpoint = create_seed_checkpoint
        self.created_seed = False  # load() saved the seed checkpoint: the trainer must not train
        self.resumed_step = 0
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self._pending: Future[Path] | None = None
        self._pre_save_hooks: list[Callable[[], None]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._group: dist.ProcessGroup | None = None
        if async_mode != "disabled" and self.saving:
            if async_mode == "async_with_pinned_mem":
                cuda = "" if torch.cuda.is_available() else " (no CUDA here: the same as 'async')"
                logger.info("checkpoint.async_mode='async_with_pinned_mem' saves as 'async' does, which stages into "
                            "pinned memory on CUDA%s", cuda)  # fmt: skip
            # the commit's collectives run on the writer thread: they need a group nothing else uses
            self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")

    def _check_compatible(self, directory: Path, saved: dict[str, Any]) -> None:
        if self.roles.compatible is not None:
            self.roles.compatible(directory, saved, self.metadata or {})

    def _dir(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    # ------------------------------------------------------------------------------- loading
    def load(self) -> int:
        """Resume from the latest resumable step (or `load_step`), else start from the initial checkpoint;
        returns the step to continue after (0 for a fresh start). With `create_seed_checkpoint` it saves
        the freshly initialized model as step-0 instead and sets `created_seed`: nothing is to train."""
        if self.create_seed_checkpoint:
            self._save_seed()
            return 0
        if self.enable:
            resumed = self._resume()
            if resumed is not None:
                self.resumed_step = resumed
                return resumed
        if self.initial_load_path or self.initial_load_in_hf:
            return self._load_initial()
        return 0

    def _resume(self) -> int | None:
        """The step resumed after (0 from a model-only one), or None when `folder` has no checkpoint."""
        if self.rank == 0 and not self.load_only:  # load_only: the folder may be read-only
            for p in remove_leftovers(self.folder):
                logger.warning("removed %s, left by an interrupted save", p)
        _barrier()
        kinds = {n: step_kind(p, self.roles.resumable) for n, p in step_folders(self.folder).items()}
        loadable = sorted(n for n, kind in kinds.items() if kind in LOADABLE)
        if self.load_step >= 0 and self.load_step not in loadable:
            found = f" (step-{self.load_step} is {kinds[self.load_step].value})" if self.load_step in kinds else ""
            raise CheckpointError(f"checkpoint.load_step={self.load_step}: {self.folder} has committed steps "
                                  f"{loadable}{found}")  # fmt: skip
        resumable = [n for n in loadable if kinds[n] is StepKind.RESUMABLE]
        if self.load_step >= 0:
            step: int | None = self.load_step
        else:  # the newest resumable one; a model-only save (the last save's export) only seeds the weights
            step = resumable[-1] if resumable else loadable[-1] if loadable else None
        if self.rank == 0:
            report_passed_over(kinds, step, self.load_step)
        if step is None:
            return None
        model_only = kinds[step] is not StepKind.RESUMABLE
        self._load(self._dir(step), model_only=model_only, exclude=self.exclude_from_loading)
        note = " (model only: training starts at step 0)" if model_only else ""
        logger.info("resumed from %s%s", self._dir(step), note)
        if self.initial_load_path or self.initial_load_in_hf:
            logger.info("the initial checkpoint is not loaded: %s holds checkpoints, which come first", self.folder)
        return 0 if model_only else step

    def _load_initial(self) -> int:
        """Load initial_load_path; the step its train_state continues after (0 when only the model loads)."""
        t0, names = time.perf_counter(), [self.roles.model]
        if self.initial_load_in_hf:
            key = "checkpoint.initial_load_path" if self.initial_load_path else "model.hf_assets_path"
            path = Path(self.initial_load_path or self.hf_assets_path)
            self._load_hf(path, key)
        else:
            path = Path(self.initial_load_path)
            names = self._load(path, model_only=self.initial_load_model_only, exclude=[])
        unsaved = "" if self.enable else f" (checkpoint.enable=false: {self.folder} is not scanned, nothing is saved)"
        logger.info("initialized from %s in %.2f s%s", path, time.perf_counter() - t0, unsaved)
        # as torchtitan's: a whole initial checkpoint (initial_load_model_only=false) continues its run
        resumable = self.roles.resumable
        return int(self.states[resumable].state_dict()["step"]) if resumable in names else 0

    def _load(self, directory: Path, *, model_only: bool, exclude: Sequence[str]) -> list[str]:
        """Load the states `names` (returned) from `directory`: the model, or all but `exclude`."""
        t0 = time.perf_counter()
        self._check_compatible(directory, read_index(directory).metadata)
        names = [self.roles.model] if model_only else [n for n in self.states if n not in exclude]
        state_dict = {name: self.states[name].state_dict() for name in names}
        load(state_dict, directory)
        for name in names:
            self.states[name].load_state_dict(state_dict[name])
        logger.info("loaded %s from %s in %.2f s", ", ".join(names), directory, time.perf_counter() - t0)
        return names

    def _load_hf(self, path: Path, key: str) -> None:
        """The model from the Hugging Face folder `path` (named by config key `key`): model only."""
        assert self.hf_adapter is not None  # _check_options
        files = check_hf_folder(path, key)
        model = self.states[self.roles.model]
        state_dict = model.state_dict()
        args = hf_job_model_args(path, self.metadata, self._check_compatible, self.hf_adapter)
        load_hf_model(state_dict, path, files, args, self.hf_adapter)
        model.load_state_dict(state_dict)

    # -------------------------------------------------------------------------------- saving
    def is_due(self, step: int, *, last: bool) -> bool:
        """Whether `save_if_due(step, last=last)` saves: every `interval` steps, at the last, after step 1
        with `enable_first_step_checkpoint`; never when saving is off (`enable` false or `load_only`)."""
        if not self.saving:
            return False
        return last or step % self.interval == 0 or (step == 1 and self.enable_first_step_checkpoint)

    def save_if_due(self, step: int, *, last: bool) -> bool:
        """Save when step `step` is due (see `is_due`); returns whether it was."""
        if not self.is_due(step, last=last):
            return False
        self.save(step, model_only=last and self.last_save_model_only)
        return True

    def add_pre_save_hook(self, hook: Callable[[], None]) -> None:
        """Run `hook` before every save; it raises to refuse one (the trainer's non-finite guard: never save
        weights a NaN step has spoilt)."""
        self._pre_save_hooks.append(hook)

    def save(self, step: int, *, model_only: bool = False) -> None:
        """Save step `step` now: resumable, or only the model (in export_dtype, or as HF with last_save_in_hf)."""
        for hook in self._pre_save_hooks:
            hook()
        directory = self._dir(step)
        waited = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - waited
        if model_only and self.last_save_in_hf:
            self._save_hf(step)
            return
        if not self._make_way(directory, step, model_only=model_only):
            return
        key = self.roles.model
        state_dict = {n: s.state_dict() for n, s in self.states.items() if not model_only or n == key}
        if model_only and self.export_dtype != torch.float32:
            state_dict[key] = {k: v.to(self.export_dtype) for k, v in state_dict[key].items()}
        t0 = time.perf_counter()
        if self._executor is not None:
            assert self._group is not None or not dist.is_initialized()
            self._pending = async_save(
                state_dict, directory, process_group=self._group, executor=self._executor, metadata=self.metadata
            )
            self._pending.add_done_callback(lambda _: self._purge(step))
            logger.info("checkpoint step %d staged in %.2f s (after %.2f s waiting for the previous save), writing in "
                        "the background", step, time.perf_counter() - t0, waited)  # fmt: skip
        else:
            save(state_dict, directory, metadata=self.metadata)
            logger.info("checkpoint step %d saved to %s in %.2f s", step, directory, time.perf_counter() - t0)
            self._purge(step)

    def _save_hf(self, step: int) -> None:
        """The model as the Hugging Face folder `step-<N>-hf/` in export_dtype (synchronous, as torchtitan's)."""
        out = self.folder / f"step-{step}-hf"
        if not self._make_way(out, step, model_only=True):
            return
        assert self.hf_adapter is not None  # _check_options
        t0 = time.perf_counter()
        model = self.states[self.roles.model].state_dict()
        save_hf_model(model, out, self.hf_adapter, dtype=self.export_dtype_name, metadata=self.metadata,
                      rank=self.rank)  # fmt: skip
        logger.info("step %d saved as the Hugging Face folder %s (model only, %s) in %.2f s", step, out,
                    self.export_dtype_name, time.perf_counter() - t0)  # fmt: skip

    def _save_seed(self) -> None:
        """create_seed_checkpoint: the initialized model as step-0 (model only, in the parameters' dtype, so any
        layout resumes from it), or with last_save_in_hf as step-0-hf; then `created_seed`."""
        if self.rank == 0:
            for p in remove_leftovers(self.folder):
                logger.warning("removed %s, left by an interrupted save", p)
        _barrier()
        if self.last_save_in_hf:
            self._save_hf(0)
        elif self._make_way(self._dir(0), 0, model_only=True):
            key = self.roles.model
            save({key: self.states[key].state_dict()}, self._dir(0), metadata=self.metadata)
            logger.info("created the seed checkpoint %s (the initialized model); not training", self._dir(0))
        self.created_seed = True

    def _make_way(self, directory: Path, step: int, *, model_only: bool) -> bool:
        """Whether to save step `step` into `directory`: rank 0 decides (and sets aside what is in the way),
        every rank follows, so a collective save starts on all of them or none."""
        decision: list[Any] = [(True, None)]
        if self.rank == 0:
            try:
                decision[0] = (
                    clear_way(
                        directory,
                        step,
                        model_only=model_only,
                        resumed=self.resumed_step,
                        resumable=self.roles.resumable,
                    ),
                    None,
                )
            except OSError as e:
                decision[0] = (False, f"cannot set aside {directory} to save step {step}: {e}")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(decision, src=0)
        go, error = decision[0]
        if error is not None:
            raise CheckpointError(error)
        return bool(go)

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

    def _purge(self, saved: int) -> None:
        """After the save of step `saved`: keep the newest `keep_latest_k` resumable steps and what is newer
        (`steps_to_purge`; rank 0 deletes)."""
        if self.rank != 0 or self.keep_latest_k <= 0:
            return
        kinds = {n: step_kind(p, self.roles.resumable) for n, p in step_folders(self.folder).items()}
        stateless = self.roles.resumable not in self.states  # nothing it saves is resumable: every save counts
        for step in steps_to_purge(kinds, self.keep_latest_k, saved=saved, count_model_only=stateless):
            # renamed first, so a crash mid-delete leaves a leftover (cleaned at start), never a
            # committed-looking directory with files missing
            doomed = temporary_dir(self._dir(step), "purge")
            self._dir(step).rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            logger.info("removed checkpoint step %d (keep_latest_k=%d)", step, self.keep_latest_k)


def _check_options(
    async_mode: str, last_model_only: bool, last_in_hf: bool, initial_model_only: bool, initial_in_hf: bool,
    hf_path: str, hf_adapter: HFAdapter[Any] | None,
) -> None:  # fmt: skip
    if async_mode not in ASYNC_MODES:
        raise ValueError(f"checkpoint.async_mode={async_mode!r}: expected one of {ASYNC_MODES}")
    if last_in_hf and not last_model_only:
        raise ValueError("checkpoint.last_save_in_hf=true writes only the model (a Hugging Face folder holds no "
                         "optimizer or data state); set checkpoint.last_save_model_only=true")  # fmt: skip
    if initial_in_hf and not initial_model_only:
        raise ValueError("checkpoint.initial_load_in_hf=true loads only the model (a Hugging Face folder holds no "
                         "optimizer or data state); set checkpoint.initial_load_model_only=true")  # fmt: skip
    if initial_in_hf and not hf_path:
        raise ValueError("checkpoint.initial_load_in_hf=true needs a Hugging Face folder; set "
                         "checkpoint.initial_load_path or model.hf_assets_path")  # fmt: skip
    if (initial_in_hf or last_in_hf) and hf_adapter is None:
        key = "initial_load_in_hf" if initial_in_hf else "last_save_in_hf"
        raise ValueError(f"checkpoint.{key}=true needs the model family's Hugging Face adapter; pass "
                         f"CheckpointManager(..., hf_adapter=models.hf_adapters.hf_adapter(model.name))")  # fmt: skip


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
