"""The data settings pre-flight checks before any rank starts: which files `training.dataset_path`
names (each of its comma-separated entries), their mixing weights (`training.dataset_weights`), and
how `training.global_batch_size` splits into micro-batches. Torch-free, so
`trainer.preflight` checks them in milliseconds; `trainer.data` builds the loader on them.
"""

from __future__ import annotations

import glob
import math
from pathlib import Path

# file kind -> the `datasets` builder that reads it; compressed files keep the kind of their inner suffix
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")


def accumulation_steps(global_batch_size: int, local_batch_size: int, dp_size: int) -> int:
    """Micro-batches per optimizer step: global / (local x dp), which must divide exactly."""
    per_step = local_batch_size * dp_size
    if global_batch_size <= 0 or global_batch_size % per_step:
        raise ValueError(
            f"training.global_batch_size({global_batch_size}) must be a positive multiple of "
            f"training.local_batch_size({local_batch_size}) x data-parallel degree({dp_size}) = {per_step}; "
            f"{global_batch_size} / {per_step} = {global_batch_size / per_step:g} micro-batches per step"
        )
    return global_batch_size // per_step


def _kind(path: Path) -> str | None:
    """The builder for `path` ("text", "json", "parquet"), looking through a compression suffix."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSIONS:
        suffixes = suffixes[:-1]
    return _BUILDERS.get(suffixes[-1]) if suffixes else None


def resolve_data_files(dataset_path: str, key: str = "training.dataset_path") -> tuple[str, list[Path]]:
    """(builder, files in a fixed order) of `training.dataset_path` (errors name `key`): a file, a folder
    (searched recursively, hidden entries skipped) or a glob; every file must be of one kind. Empty
    (0-byte) files hold no documents and are left out; when every file is empty this refuses, since
    `datasets` would stop in a bare StopIteration (JSON) or ArrowInvalid (parquet)."""
    path = Path(dataset_path).expanduser()
    if path.is_file():
        files = [path]
    elif path.is_dir():
        # hidden entries below the folder are skipped, not the folder's own path (~/.cache/... is fine)
        files = [
            p for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ]  # fmt: skip
        files = [p for p in files if _kind(p)]
    elif glob.has_magic(dataset_path):
        files = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
    else:
        raise ValueError(f"{key}={dataset_path!r} does not exist; point it at a file, folder or glob")
    files = sorted(files)
    supported = ", ".join(_BUILDERS)
    if not files:
        raise ValueError(f"{key}={dataset_path!r} holds no data files; expected {supported} files")
    kinds = {p: _kind(p) for p in files}
    unknown = [str(p) for p, k in kinds.items() if k is None]
    if unknown:
        raise ValueError(f"{key}={dataset_path!r}: {unknown[:3]} are not {supported} files")
    if len(set(kinds.values())) > 1:
        found = sorted({p.suffix for p in files})
        raise ValueError(f"{key}={dataset_path!r} mixes file kinds {found}; point it at files of one kind")
    nonempty = [p for p in files if p.stat().st_size > 0]
    if not nonempty:
        names = ", ".join(map(str, files[:3])) + (", ..." if len(files) > 3 else "")
        shown = names if len(files) == 1 else f"all {len(files)} files ({names})"
        raise ValueError(
            f"{key}={dataset_path!r}: {shown} {'is' if len(files) == 1 else 'are'} empty (0 bytes), so there are no "
            f"documents to train on; point {key} at files holding documents"
        )
    return next(iter(kinds.values())), nonempty  # type: ignore[return-value]


def split_dataset_paths(dataset_path: str, weights: list[float]) -> tuple[list[str], list[float]]:
    """training.dataset_path's comma-separated entries and their mixing weights, normalized to sum to 1
    (training.dataset_weights; empty: equal). Each bad input fails in one line naming the key and the fix."""
    paths = [p.strip() for p in dataset_path.split(",")]
    if len(paths) > 1 and not all(paths):
        raise ValueError(f"training.dataset_path={dataset_path!r}: entry {paths.index('') + 1} is empty; separate "
                         f"the paths by single commas, with no trailing comma")  # fmt: skip
    if not weights:
        return paths, [1.0 / len(paths)] * len(paths)
    shown = f"training.dataset_weights={list(weights)!r}"
    if len(weights) != len(paths):
        raise ValueError(f"{shown} has {len(weights)} weight(s) for {len(paths)} training.dataset_path entries "
                         f"{paths}; give one weight per path, in their order")  # fmt: skip
    for path, w in zip(paths, weights, strict=True):
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
            raise TypeError(f"{shown}: the weight of {path!r} is {w!r}, not a finite number")
        if w < 0:
            raise ValueError(f"{shown}: the weight of {path!r} is negative ({w}); weights must be >= 0 (they are "
                             f"normalized to sum to 1)")  # fmt: skip
    total = sum(weights)
    if total <= 0:
        raise ValueError(f"{shown} sum to 0: no dataset would be read; give at least one path a positive weight")
    return paths, [w / total for w in weights]


def check_dataset_mix(dataset_path: str, weights: list[float], *, files: bool = True) -> None:
    """The pre-flight's check of training.dataset_path and training.dataset_weights: the entries and weights
    agree (`split_dataset_paths`) and, with `files` (not for a dry run planned away from the data), every
    entry names data files (`resolve_data_files`)."""
    if weights and not dataset_path:
        raise ValueError(
            f"training.dataset_weights={list(weights)!r} is set but training.dataset_path is empty: the weights "
            f"mix local datasets; set training.dataset_path to comma-separated paths"
        )
    if not dataset_path:
        return
    paths, _ = split_dataset_paths(dataset_path, weights)
    for path in paths if files else []:
        resolve_data_files(path)


def dataset_files(dataset_path: str) -> list[Path]:
    """Every data file of training.dataset_path's entries."""
    return [f for path in dataset_path.split(",") if path.strip() for f in resolve_data_files(path.strip())[1]]
