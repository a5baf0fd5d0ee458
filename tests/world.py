"""Persistent multi-process "worlds" for distributed tests.

This module owns the rank processes that tests run collectives on. Spawning N
processes and rendezvousing costs ~1 s per test, which the suite cannot afford,
so a ``World`` forks its ranks once, calls ``init_process_group`` once per rank,
and then serves many ``run(fn, ...)`` calls over pipes. ``get_world(n)`` caches
one world per size for the whole session; a world that a failed, hung or crashed
run may have left mid-collective is killed and transparently rebuilt on next use.

``fn`` and its arguments are pickled *by reference*: pass module-level functions
(lambdas, closures and nested functions raise ``TypeError`` in the test process).
Results must be picklable too. Every rank gets ``torch.set_num_threads(1)``.
Rank output is flushed after every call, so pytest attributes it to the test.
"""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
# The first op on meta tensors loads torch's meta kernels (~1.5 s, much more on a busy machine).
# Load them once here, before any world forks, so every rank inherits them instead of loading
# them on one thread each (the dispatcher runs ops on meta tensors to learn output shapes).
torch.cat([torch.empty(1, device="meta")] * 2)
_GRACE_S = 3.0  # after one rank fails, how long the others get to answer
_KILL_WAIT_S = 1.0  # how long SIGTERM gets before SIGKILL


class WorldError(AssertionError):
    """A run failed on some rank(s), hung, or a rank died. Subclass of AssertionError so
    pytest reports it as a test failure rather than an error in the harness."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent_pid: int) -> None:
    # PR_SET_PDEATHSIG makes the kernel SIGKILL us when the parent dies, even by SIGKILL,
    # so a crashed pytest never leaves ranks behind. The getppid check closes the race
    # where the parent died before the prctl call; _rank_main also polls getppid as backup.
    # Caveat: it fires when the *thread* that forked exits; worlds fork from _FORKER's thread,
    # which lives for the session (a world forked from a short-lived thread would die with it).
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent_pid:
        os._exit(1)


def _rank_main(
    rank: int, size: int, backend: str, store_file: str, port: int, conn: Connection, timeout: float, parent_pid: int
) -> None:
    _die_with_parent(parent_pid)
    # Ctrl-C goes to the whole process group; let the parent decide (it kills us at exit).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Required: libgomp's thread pool is not fork-safe, so a forked child must never
    # enter an OpenMP parallel region. One thread per rank also avoids oversubscription.
    torch.set_num_threads(1)
    # Write straight to fds 1/2 (pytest's capture files while a test runs, so rank output
    # lands in that test's report) one whole line per write(), so ranks interleave by line.
    # pytest's faulthandler targets a dup of the terminal; send crash dumps to fd 2 too.
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.enable(file=2, all_threads=False)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        # A FileStore rendezvous cannot race with other test sessions for a port.
        dist.init_process_group(
            backend, init_method=f"file://{store_file}", rank=rank, world_size=size, timeout=timedelta(seconds=timeout)
        )
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        # Poll with a timeout so we notice an orphaning even without PDEATHSIG.
        if not conn.poll(1.0):
            if os.getppid() != parent_pid:
                os._exit(1)
            continue
        try:
            msg = conn.recv_bytes()
        except EOFError:
            break
        if not msg:  # empty message = orderly shutdown
            break
        try:
            fn, args, kwargs = pickle.loads(msg)
            reply = pickle.dumps(("ok", fn(*args, **kwargs)))
        except BaseException:  # includes pytest.fail/skip outcomes and unpicklable results
            reply = pickle.dumps(("error", traceback.format_exc()))
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send_bytes(reply)
    dist.destroy_process_group()


class _ShallowForker:
    """Starts rank processes from one thread with a shallow stack, alive for the session.

    A forked child keeps the stack of the thread that forked it: from pytest's main thread that
    is ~70 frames, and rank code that formats the stack pays for every one of them on each call
    (torch.manual_seed records three tracebacks for torch.cuda/xpu/mtia's lazy init; OpInfo's
    sample generators call inspect.stack()), which made the OpInfo sweep 4x slower. The thread
    lives as long as the worlds do: PR_SET_PDEATHSIG kills the ranks when it exits.
    """

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, name="world-forker", daemon=True).start()

    def _serve(self) -> None:
        while True:
            job, answer = self._jobs.get()
            try:
                answer.put((True, job()))
            except BaseException as e:  # re-raised on the caller's thread
                answer.put((False, e))

    def run(self, job: Callable[[], T]) -> T:
        answer: queue.Queue = queue.Queue(maxsize=1)
        self._jobs.put((job, answer))
        ok, value = answer.get()
        if not ok:
            raise value
        return value


_FORKER = _ShallowForker()


class World:
    """``world_size`` rank processes with an initialized default process group."""

    def __init__(self, world_size: int, *, timeout: float = 120.0, backend: str = "gloo") -> None:
        self.world_size, self.timeout, self.backend = world_size, timeout, backend
        self.broken = False  # set once a run may have left ranks out of sync
        # Fork is ~100x cheaper than spawn and inherits every imported test module; CUDA
        # cannot survive a fork, so NCCL worlds spawn.
        ctx = mp.get_context("spawn" if backend == "nccl" else "fork")
        fd, self._store_file = tempfile.mkstemp(prefix="meshtrain-world-")
        os.close(fd)
        port = _free_port()  # only exported as MASTER_PORT for code that reads env://
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe()
            p = ctx.Process(
                target=_rank_main,
                name=f"world{world_size}-rank{rank}",
                daemon=True,
                args=(rank, world_size, backend, self._store_file, port, child_conn, timeout, os.getpid()),
            )
            if backend == "nccl":
                p.start()
            else:
                _FORKER.run(p.start)
            # Close our copy so a dead rank reads as EOF, and later forks don't inherit it.
            child_conn.close()
            self._procs.append(p)
            self._conns.append(parent_conn)
        self._collect("init_process_group", timeout)  # raises WorldError if rendezvous fails

    @property
    def pids(self) -> list[int]:
        return [p.pid or -1 for p in self._procs]

    def alive(self) -> bool:
        return not self.broken and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., T], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[T]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self.alive():
            raise WorldError(f"world {self.world_size} is closed or broken; use get_world()")
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            msg = pickle.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(
                f"world.run({name}, ...): fn and its arguments must be picklable by "
                f"reference -- use module-level functions, not lambdas, closures or "
                f"nested functions ({type(e).__name__}: {e})"
            ) from e
        try:
            for conn in self._conns:
                conn.send_bytes(msg)
        except OSError:  # a rank died between runs
            pass  # _collect reports it via EOF
        return self._collect(name, self.timeout if timeout is None else timeout)

    def _collect(self, name: str, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        try:
            while pending and (left := deadline - time.monotonic()) > 0:
                for conn in wait(list(pending.values()), timeout=left):
                    rank = self._conns.index(conn)  # type: ignore[arg-type]
                    del pending[rank]
                    try:
                        status, payload = conn.recv()
                    except (EOFError, OSError):
                        status, payload = "error", self._death_note(rank)
                    if status == "ok":
                        results[rank] = payload
                    else:
                        errors[rank] = payload
                        # Others may be blocked in a collective with the failed rank.
                        deadline = min(deadline, time.monotonic() + _GRACE_S)
        except BaseException:  # e.g. KeyboardInterrupt: ranks are now out of sync
            self._shutdown(orderly=False)
            raise
        if not errors and not pending:
            return [results[r] for r in range(self.world_size)]
        self._shutdown(orderly=False)  # ranks may be stuck or out of sync: never reuse
        parts = [f"rank {r} raised:\n{tb}" for r, tb in sorted(errors.items())]
        if pending:
            waited = f"{_GRACE_S}s grace after the failure" if errors else f"{timeout}s"
            parts.insert(0, f"ranks {sorted(pending)} of world {self.world_size} did not finish {name} within {waited}")
        raise WorldError(f"{name} failed on world {self.world_size}:\n" + "\n".join(parts))

    def _death_note(self, rank: int) -> str:
        p = self._procs[rank]
        p.join(_KILL_WAIT_S)
        code = p.exitcode
        if code is not None and code < 0:
            return f"process {p.pid} died: killed by signal {signal.Signals(-code).name}\n"
        return f"process {p.pid} died with exit code {code}\n"

    def close(self) -> None:
        """Stop all ranks (orderly if idle, SIGTERM then SIGKILL otherwise) and reap them."""
        self._shutdown(orderly=True)

    def _shutdown(self, orderly: bool) -> None:
        if not self._conns:
            return
        self.broken = True
        if orderly:
            for conn in self._conns:
                try:
                    conn.send_bytes(b"")  # idle ranks exit cleanly; busy ones get signals below
                except OSError:
                    pass
            deadline = time.monotonic() + _KILL_WAIT_S
            for p in self._procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for sig_method in ("terminate", "kill"):
            alive = [p for p in self._procs if p.is_alive()]
            for p in alive:
                getattr(p, sig_method)()
            deadline = time.monotonic() + _KILL_WAIT_S
            for p in alive:
                p.join(max(0.0, deadline - time.monotonic()))
        for conn in self._conns:
            conn.close()
        self._conns = []
        try:
            os.unlink(self._store_file)
        except FileNotFoundError:
            pass


_worlds: dict[int, World] = {}


def get_world(world_size: int) -> World:
    """The session's cached world of this size, rebuilt if a previous run broke it."""
    world = _worlds.get(world_size)
    if world is None or not world.alive():
        if world is not None:
            world.close()
        world = _worlds[world_size] = World(world_size)
    return world


def run_world(fn: Callable[..., T], world_size: int, *args: Any, **kwargs: Any) -> list[T]:
    """``get_world(world_size).run(fn, *args, **kwargs)``."""
    return get_world(world_size).run(fn, *args, **kwargs)


def close_worlds() -> None:
    """Stop every cached world (session end; also registered with atexit)."""
    while _worlds:
        _worlds.popitem()[1].close()


atexit.register(close_worlds)
