"""trainer.process.host_memory: after `keep_freed_host_memory()` glibc serves three 30 MiB tensors from its heap and
keeps them there after the free; with glibc's own settings they are mapped and unmapped, or (once its
dynamic threshold has risen) trimmed off the heap's top on free. Both cases run in fresh interpreters (the
setting is process-wide); a third checks that the trainer's `main` makes the setting on a CPU rank."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.world import run_world

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
BLOCKS, BLOCK_MIB = 3, 30  # under the 32 MiB threshold each; together over glibc's dynamic trim threshold

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")


_MALLINFO2 = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()


class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2]


def heap_probe() -> dict[str, int]:
    """Bytes malloc mapped for BLOCKS tensors, and bytes it took off its heap when they were freed."""
    import torch

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    before = libc.mallinfo2()
    blocks = [torch.ones(BLOCK_MIB * MIB // 4) for _ in range(BLOCKS)]
    during = libc.mallinfo2()
    del blocks
    after = libc.mallinfo2()
    return {"mapped": during.hblkhd - before.hblkhd, "trimmed": during.arena - after.arena}


PROBE = """
import json, sys
from tests.trainer.test_host_memory import heap_probe
from trainer.process.host_memory import keep_freed_host_memory
kept = keep_freed_host_memory() if sys.argv[1] == "keep" else None
print(json.dumps({"kept": kept, **heap_probe()}))
"""


def probe(mode: str) -> dict:
    try:
        done = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, check=True)
    except subprocess.CalledProcessError as error:  # no mallinfo2: not glibc, or older than 2.33
        pytest.skip(f"glibc >= 2.33 needed to observe malloc: {error.stderr[-300:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_host_memory_stays_in_the_heap() -> None:
    plain = probe("plain")
    assert plain["mapped"] + plain["trimmed"] >= BLOCK_MIB * MIB  # glibc's own: unmapped or trimmed on free
    kept = probe("keep")
    assert kept == {"kept": True, "mapped": 0, "trimmed": 0}  # the next step reuses it without page faults


def _train_then_probe(argv: list[str]) -> dict[str, int]:
    from trainer.train import main

    assert main(argv) == 0
    return heap_probe()


def test_the_trainer_keeps_freed_host_memory_on_cpu(tmp_path: Path) -> None:
    probe("plain")  # skips where malloc cannot be observed
    argv = [
        "--job.config_file", str(ROOT / "configs" / "debug_model.toml"), "--job.dump_folder", str(tmp_path),
        "--training.steps", "1", "--training.seq_len", "32", "--lr_scheduler.warmup_steps", "0",
    ]  # fmt: skip
    (rank0,) = run_world(_train_then_probe, 1, argv)
    assert rank0 == {"mapped": 0, "trimmed": 0}


def test_user_tunables_win(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.process.host_memory import keep_freed_host_memory

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert keep_freed_host_memory() is False
