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
