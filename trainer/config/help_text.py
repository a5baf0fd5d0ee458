"""`--help`: every section and key of the job config with its type, default and one-line doc; and the same as
docs/config_reference.md (`python -m trainer.config.help_text > docs/config_reference.md`; a test keeps it current).

The docs are the string literals under each field in `trainer/config/sections.py` (attribute docstrings, which
Python does not keep at run time), read from its source with `ast`, so the help and the code never differ.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import sys
import typing
from pathlib import Path
from typing import Any

from . import sections
from .sections import JobConfig

USAGE = """usage: ./run_train.sh [--section.key value ...]    (or python -m trainer.train ...)

Keys come from dataclass defaults < the TOML file of --job.config_file < the command line.
Sections and keys are torchtitan v0.2.0's; a bool key alone means true (--checkpoint.enable); a list is
written as in TOML ('["a", "b"]', '[["a"], ["b", "c"]]') or comma-separated, ';' between inner lists (a;b,c).
Environment of run_train.sh: NGPU, CONFIG_FILE, LOG_RANK, NNODES, NODE_RANK, RDZV_ENDPOINT, MAX_RESTARTS."""


def field_docs() -> dict[tuple[str, str], str]:
    """{(class name, field name): its docstring's first sentence-line}, from sections.py's source."""
    tree = ast.parse(Path(sections.__file__).read_text(encoding="utf-8"))
    docs: dict[tuple[str, str], str] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for stmt, after in zip(cls.body, cls.body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[cls.name, stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    text = str(tp) if typing.get_origin(tp) else getattr(tp, "__name__", str(tp))
    return text.replace("typing.", "")


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _section_lines(cls: type, name: str, docs: dict[tuple[str, str], str]) -> list[str]:
    hints = typing.get_type_hints(cls)
    lines, subsections = ["", f"[{name}]"], []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            subsections.append((tp, f"{name}.{f.name}"))
            continue
        lines.append(f"  --{name}.{f.name}  {_type_name(tp)} = {_default(f)!r}")
        lines.append(f"      {docs.get((cls.__name__, f.name), '')}")
    for tp, sub in subsections:
        lines += _section_lines(tp, sub, docs)
    return lines if len(lines) > 2 else lines[1:]  # a section of sub-sections only: just its header


def config_help() -> str:
    docs = field_docs()
    hints = typing.get_type_hints(JobConfig)
    lines = [USAGE]
    for f in dataclasses.fields(JobConfig):
        lines += _section_lines(hints[f.name], f.name, docs)
    return "\n".join(lines)


def print_help() -> None:
    """The help on stdout; a reader that stops early (`| head`) ends it quietly."""
    try:
        print(config_help(), flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit


def _markdown_rows(cls: type, name: str, docs: dict[tuple[str, str], str]) -> list[str]:
    hints = typing.get_type_hints(cls)
    rows, subsections = [], []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            subsections.append((tp, f"{name}.{f.name}"))
            continue
        doc = docs.get((cls.__name__, f.name), "").replace("|", "\\|")
        kind = _type_name(tp).replace("|", "\\|")
        rows.append(f"| `{f.name}` | `{kind}` | `{_default(f)!r}` | {doc} |")
    lines = [f"\n## [{name}]\n", "| key | type | default | what it does |", "| --- | --- | --- | --- |", *rows]
    lines = lines if rows else lines[:1]
    for tp, sub in subsections:
        lines += _markdown_rows(tp, sub, docs)
    return lines


def config_reference() -> str:
    """docs/config_reference.md: every section and key as a table, from the code."""
    docs = field_docs()
    hints = typing.get_type_hints(JobConfig)
    lines = [
        "# Config reference",
        "",
        "Generated from `trainer/config/sections.py` by `python -m trainer.config.help_text > "
        "docs/config_reference.md`; `./run_train.sh --help` prints the same. Keys come from the dataclass defaults, "
        "then the TOML file of `--job.config_file`, then the command line (`--section.key value`). Sections and keys "
        "are torchtitan v0.2.0's, so its TOML files load unchanged.",
    ]
    for f in dataclasses.fields(JobConfig):
        lines += _markdown_rows(hints[f.name], f.name, docs)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(config_reference())
