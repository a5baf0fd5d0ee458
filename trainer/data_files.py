"""The data settings pre-flight checks before any rank starts: which files `training.dataset_path`
names, and how `training.global_batch_size` splits into micro-batches. Torch-free, so
`trainer.preflight` checks them in milliseconds; `trainer.data` builds the loader on them.
"""

from __future__ import annotations

import glob
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


def resolve_data_files(dataset_path: str) -> tuple[str, list[Path]]:
    """(builder, files in a fixed order) of `training.dataset_path`: a file, a folder (searched
    recursively, hidden entries skipped) or a glob; every file must be of one kind."""
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
        raise ValueError(f"training.dataset_path={dataset_path!r} does not exist; point it at a file, folder or glob")
    files = sorted(files)
    supported = ", ".join(_BUILDERS)
    if not files:
        raise ValueError(f"training.dataset_path={dataset_path!r} holds no data files; expected {supported} files")
    kinds = {p: _kind(p) for p in files}
    unknown = [str(p) for p, k in kinds.items() if k is None]
    if unknown:
        raise ValueError(f"training.dataset_path={dataset_path!r}: {unknown[:3]} are not {supported} files")
    if len(set(kinds.values())) > 1:
        found = sorted({p.suffix for p in files})
        raise ValueError(
            f"training.dataset_path={dataset_path!r} mixes file kinds {found}; point it at files of one kind"
        )
    return next(iter(kinds.values())), files  # type: ignore[return-value]
