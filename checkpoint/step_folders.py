"""The `step-<N>` folders of a checkpoint folder: what each holds, which the manager passes over on
resume (and why, logged), and how a folder in the way of a save is set aside (renamed, never deleted).
"""

from __future__ import annotations

import enum
import logging
from pathlib import Path

from .format import HF_INDEX_FILE, INDEX_FILE, STEP_DIR, CheckpointError, read_index
from .storage import set_aside

logger = logging.getLogger(__name__)


class StepKind(enum.Enum):
    """What a `step-<N>` folder holds."""

    RESUMABLE = "resumable"  # the loop's whole state
    MODEL_ONLY = "model-only"  # a last save's export (or a seed)
    HF_EXPORT = "hf"  # a Hugging Face folder (our `step-<N>-hf`, or torchtitan's last_save_in_hf)
    INCOMPLETE = "incomplete"  # no index.json: never committed, or its index was deleted
    UNREADABLE = "unreadable"  # an index.json that cannot be parsed


# a folder in the way of a save is renamed `<name>.<suffix>`, and the warning says why
SET_ASIDE = {
    StepKind.RESUMABLE: ("replaced", "it holds a checkpoint of an earlier run that this run trained again"),
    StepKind.MODEL_ONLY: ("model-only", "it is a model-only export, which the resumable checkpoint replaces"),
    StepKind.HF_EXPORT: ("hf", "it is a Hugging Face export, which the checkpoint replaces"),
    StepKind.INCOMPLETE: ("incomplete", "it has no index.json (never committed, or its index was deleted)"),
    StepKind.UNREADABLE: ("unreadable", "its index.json cannot be read"),
}
LOADABLE = (StepKind.RESUMABLE, StepKind.MODEL_ONLY)


def committed_steps(folder: Path) -> list[int]:
    """Steps with a committed checkpoint in `folder`, ascending (a `.tmp-` directory never counts)."""
    return sorted(n for n, p in step_folders(folder).items() if (p / INDEX_FILE).is_file())


def step_folders(folder: Path) -> dict[int, Path]:
    """Every `step-<N>` entry of `folder` (committed or not; never a `.tmp-` or set-aside one)."""
    if not folder.is_dir():
        return {}
    return {int(m.group(1)): p for p in folder.iterdir() if (m := STEP_DIR.fullmatch(p.name))}


def step_kind(directory: Path, resumable: str = "train_state") -> StepKind:
    """What `directory` holds, judged by its index alone (a corrupt data file shows only when loaded)."""
    if (directory / HF_INDEX_FILE).is_file() and not (directory / INDEX_FILE).is_file():
        return StepKind.HF_EXPORT
    if not (directory / INDEX_FILE).is_file():
        return StepKind.INCOMPLETE
    try:
        values = read_index(directory).values
    except CheckpointError:
        return StepKind.UNREADABLE
    has_state = any(k == resumable or k.startswith(f"{resumable}.") for k in values)
    return StepKind.RESUMABLE if has_state else StepKind.MODEL_ONLY


def steps_to_purge(
    kinds: dict[int, StepKind], keep: int, *, saved: int | None = None, count_model_only: bool = False
) -> list[int]:
    """The steps `keep_latest_k=keep` removes from a folder whose steps hold `kinds`, after the save of step
    `saved`: every loadable step older than the `keep`-th newest resumable one up to `saved`. A model-only save
    (the last save's export, a seed) does not count against the resumable ones, so the newest resume point is
    always kept; the save goes once it is older than every kept resume point. Steps newer than `saved` (an
    earlier run's, passed over by checkpoint.load_step) neither count nor go, so they never push out this run's
    own saves. `count_model_only`: a job without resumable state counts its saves, all model-only. Incomplete,
    unreadable and set-aside folders are never removed."""
    if saved is not None:
        kinds = {n: kind for n, kind in kinds.items() if n <= saved}
    counted = (StepKind.RESUMABLE, StepKind.MODEL_ONLY) if count_model_only else (StepKind.RESUMABLE,)
    steps = sorted(n for n, kind in kinds.items() if kind in counted)
    if keep <= 0 or len(steps) <= keep:
        return []
    oldest_kept = steps[-keep]
    return sorted(n for n, kind in kinds.items() if n < oldest_kept and kind in LOADABLE)


def report_passed_over(kinds: dict[int, StepKind], chosen: int | None, load_step: int) -> None:
    """Name every step folder newer than the one resumed from, and why it was not (rank 0)."""
    start = "starting afresh" if chosen is None else f"resuming from step-{chosen}"
    for n in sorted(k for k in kinds if chosen is None or k > chosen):
        kind = kinds[n]
        suffix, why = SET_ASIDE[kind]
        if kind in (StepKind.MODEL_ONLY, StepKind.HF_EXPORT):
            logger.info("step-%d is a model-only export, not a resume point (%s)", n, start)
        elif kind is StepKind.RESUMABLE:
            logger.warning("checkpoint.load_step=%d: the newer step-%d is not loaded (a resumable save of step %d "
                           "keeps it as step-%d.%s)", load_step, n, n, n, suffix)  # fmt: skip
        else:
            logger.warning("skipped step-%d: %s; %s. It is kept, renamed step-%d.%s when step %d is saved again", n,
                           why.removeprefix("it has ").removeprefix("its "), start, n, suffix, n)  # fmt: skip


def clear_way(directory: Path, step: int, *, model_only: bool, resumed: int, resumable: str = "train_state") -> bool:
    """Rank 0: whether to save step `step` into `directory`, setting aside what is there. A model-only
    export never replaces a checkpoint; a resumable one sets aside whatever holds its name."""
    if not directory.exists() and not directory.is_symlink():
        return True
    kind = step_kind(directory, resumable)
    if model_only and kind in (*LOADABLE, StepKind.HF_EXPORT):
        logger.warning("%s already holds a %s checkpoint of step %d (from an earlier run): kept, and this run's "
                       "model-only save of step %d is not written", directory, kind.value, step, step)  # fmt: skip
        return False
    suffix, why = SET_ASIDE[kind]
    aside = set_aside(directory, suffix)
    since = f" (this run resumed from step {resumed})" if kind is StepKind.RESUMABLE else ""
    logger.warning("%s was in the way of saving step %d: %s%s. Kept, renamed %s", directory, step, why, since,
                   aside.name)  # fmt: skip
    return True
