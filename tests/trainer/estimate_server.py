"""Many `python -m trainer.estimate` runs in one fresh interpreter, for the tests.

An interpreter per estimate paid about 2 s of imports and cold plan caches each time: test_estimate.py took
149 s, and takes 59 s with one server per module. The server runs the CLI's own `main(argv)` for each request,
so the tests still see exactly what the command prints and returns, and the fake process group still never
enters pytest's process. Protocol: one JSON argv per line on the server's stdin; one JSON line
`{"returncode", "stdout", "stderr"}` per request on its stdout; `null` ends it (not end of file: worlds the
tests fork later inherit the pipe's writing end, so closing ours would never read as EOF).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class EstimateServer:
    """The client: `run(*argv)` sends one request and waits at most `timeout` seconds for its answer."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
        env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.trainer.estimate_server"],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._answers: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self._answers.put(line)
        self._answers.put("")  # EOF: the server died

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def run(self, *argv: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(list(argv)) + "\n")
        self._process.stdin.flush()
        try:
            line = self._answers.get(timeout=timeout)
        except queue.Empty:
            self._process.kill()  # busy past its bound: it would not read a request to stop either
            self._process.wait()
            raise TimeoutError(f"trainer.estimate {' '.join(argv)}: no answer in {timeout:.0f} s") from None
        if not line:
            raise RuntimeError(f"the estimate server exited ({self._process.wait(5)}) running {' '.join(argv)}")
        answer = json.loads(line)
        return subprocess.CompletedProcess(["trainer.estimate", *argv], **answer)

    def close(self) -> None:
        if self._process.stdin is not None and self._process.poll() is None:
            self._process.stdin.write("null\n")
            self._process.stdin.close()
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


class _CurrentStderr:
    """The stream of `main`'s logging handler, which `logging.basicConfig` binds once: whatever sys.stderr is
    now, so each request's log lines land in its own answer."""

    def write(self, text: str) -> None:
        sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def serve() -> None:
    from trainer.estimate import LOG_FORMAT, main

    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT, stream=_CurrentStderr())
    answers = sys.stdout  # requests' own prints go to a buffer each
    for line in sys.stdin:
        argv = json.loads(line)
        if argv is None:
            return
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as stop:  # argparse's refusals
                code = stop.code if isinstance(stop.code, int) else 2
            except Exception:  # what the CLI would have died of: a traceback and exit status 1
                traceback.print_exc()
                code = 1
        answers.write(json.dumps({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve()
