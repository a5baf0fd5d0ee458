"""trainer.host_memory: after `keep_freed_host_memory()`, glibc serves a 20 MiB tensor from its heap (not a
fresh mmap) and keeps it after the free; without the call it maps and unmaps it. Each case runs in a fresh
interpreter, since the setting is process-wide."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import ctypes, json, sys, torch
from trainer.host_memory import keep_freed_host_memory

class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
kept = keep_freed_host_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2()
block = torch.ones(5 << 20)  # 20 MiB
during = libc.mallinfo2()
del block
after = libc.mallinfo2()
print(json.dumps({"kept": kept, "mapped_growth": during.hblkhd - before.hblkhd,
                  "heap_growth": during.arena - before.arena, "heap_after_free": after.arena - before.arena}))
"""


def probe(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, mode], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_host_memory_stays_in_the_heap() -> None:
    try:
        plain = probe("plain")
    except subprocess.CalledProcessError as error:  # no mallinfo2: not glibc, or older than 2.33
        pytest.skip(f"glibc >= 2.33 needed to observe malloc: {error.stderr[-300:]}")
    assert plain["mapped_growth"] >= 20 << 20  # the default: a fresh mmap per large block
    kept = probe("keep")
    assert kept["kept"] is True
    assert kept["mapped_growth"] == 0
    assert kept["heap_growth"] >= 20 << 20
    assert kept["heap_after_free"] >= 20 << 20  # not trimmed: the next step reuses it without page faults


def test_user_tunables_win(monkeypatch: pytest.MonkeyPatch) -> None:
    from trainer.host_memory import keep_freed_host_memory

    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert keep_freed_host_memory() is False
