"""Lint, format and types, run by the suite so that CI keeps them: ruff (rules and formatter pinned in
pyproject.toml) over the repository, and mypy over the packages pyproject.toml names."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("command", [("ruff", "check", "."), ("ruff", "format", "--check", ".")], ids=" ".join)
def test_ruff_finds_nothing(command: tuple[str, ...]) -> None:
    done = _run(*command)
    assert done.returncode == 0, f"{' '.join(command)}: fix with `ruff check --fix .` / `ruff format .`\n{done.stdout}"


def test_mypy_finds_nothing_in_the_packages() -> None:
    files = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["files"]
    assert {"parallelisms", "models", "trainer", "checkpoint"} <= set(files), files  # every product package
    done = _run("mypy")
    assert done.returncode == 0 and "Success: no issues found" in done.stdout, done.stdout[-5000:]
