"""One live job per dump folder: two jobs writing one `config.toml`, `tb/` and `checkpoint/` would
silently interleave their outputs (and their checkpoints' steps).

Rank 0 holds an exclusive `flock` on `<dump_folder>/.meshtrain.lock` for the job's life. The kernel
drops it when the process ends however it ends, so a crashed job never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist

LOCK_FILE = ".meshtrain.lock"


class DumpFolderLock:
    """Exclusive use of a dump folder by this process (rank 0 of a job)."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_FILE
        self._fd: int | None = None

    def try_acquire(self) -> str | None:
        """Take the lock; None on success, else who holds it (as its holder wrote it)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            return holder
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def lock_dump_folder(folder: str | Path) -> DumpFolderLock:
    """Rank 0 takes the folder's lock and every rank learns whether it got it; raises on every rank
    when another live job holds it (one all_reduce, so no rank runs on alone)."""
    lock = DumpFolderLock(folder)
    holder = lock.try_acquire() if dist.get_rank() == 0 else None
    refused = torch.tensor([0 if holder is None else 1])
    if dist.get_world_size() > 1:
        dist.all_reduce(refused)
    if refused.item():
        raise RuntimeError(
            f"job.dump_folder={str(folder)!r} is in use by a running job ({holder or 'see rank 0'}); "
            f"wait for it to finish or give this job its own --job.dump_folder"
        )
    return lock
