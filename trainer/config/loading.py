"""Loading the job's configuration: dataclass defaults < TOML file < `--section.key value`.

The sections and keys are `trainer/config/sections.py`'s (torchtitan v0.2.0's, so its TOML files load unchanged;
nested sections such as `[quantize.linear.float8]` too). Only `trainer/train.py` sees the whole `JobConfig`;
every component gets its own section or explicit arguments. Values are parsed from the fields' types; every
unknown key or bad value of a job is reported at once, each with a did-you-mean. `--help` lists every key.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Literal

from .sections import JobConfig


# ------------------------------------------------------------------------------------ parsing
def did_you_mean(name: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _resolve(cfg: JobConfig, dotted: str, where: str) -> tuple[Any, str, Any]:
    """(the section object holding the key, the key, its type) for `section[.sub...].key`."""
    *path, key = dotted.split(".")
    obj: Any = cfg
    for depth, name in enumerate(path):
        hints = typing.get_type_hints(type(obj))
        if name not in hints or not _is_section(hints[name]):
            sections = [n for n, t in hints.items() if _is_section(t)]
            table = ".".join(path[: depth + 1])
            raise ValueError(f"unknown config section [{table}] in {where}{did_you_mean(name, sections)}")
        obj = getattr(obj, name)
    hints = typing.get_type_hints(type(obj))
    if not path or key not in hints or _is_section(hints[key]):
        choices = [n for n, t in hints.items() if not _is_section(t)]
        raise ValueError(f"unknown config key {dotted} in {where}{did_you_mean(key, choices)}")
    return obj, key, hints[key]


def parse_value(raw: Any, tp: Any, name: str) -> Any:
    """Convert `raw` (a CLI string or a TOML value) to the field type `tp`; errors name the key."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null")):
            return None
        return parse_value(raw, args[0], name)
    if origin is list:  # a TOML array; on the CLI also one written as in TOML, or comma-separated (";" between lists)
        inner = typing.get_args(tp)[0]
        nested = typing.get_origin(inner) is list
        if isinstance(raw, str) and raw.lstrip().startswith("["):
            raw = _toml_array(raw, name)
        items = raw.split(";" if nested else ",") if isinstance(raw, str) else raw
        if not isinstance(items, list):
            raise TypeError(f"{name}={raw!r}: expected a list (TOML array or comma-separated)")
        return [parse_value(item.strip() if isinstance(item, str) else item, inner, name)
                for item in items if item != ""]  # fmt: skip
    if origin is Literal:
        choices = typing.get_args(tp)
        if raw not in choices:
            raise ValueError(f"{name}={raw!r}: expected one of {list(choices)}")
        return raw
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0"):
            return raw.lower() in ("true", "1")
        raise TypeError(f"{name}={raw!r}: expected a bool (true or false)")
    if tp in (int, float):
        return _parse_number(raw, tp, name)
    if tp is str:
        if not isinstance(raw, str):
            raise TypeError(f"{name}={raw!r}: expected a string")
        return raw
    raise TypeError(f"{name}: unsupported field type {tp}")


def _toml_array(raw: str, name: str) -> list[Any]:
    """A CLI value written as a TOML array, e.g. '[["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]]'
    (JSON's syntax is TOML's here)."""
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError as error:
        raise ValueError(
            f'{name}={raw!r}: not a TOML array ({error}); quote every string, e.g. ["a", "b"], or write '
            f"the list comma-separated (a,b), with ';' between inner lists (a,b;c)"
        ) from None


def _parse_number(raw: Any, tp: type, name: str) -> int | float:
    # bool is an int subclass and 1.5 is not an int: both are typos of the number meant
    wrong = isinstance(raw, bool) or (tp is int and isinstance(raw, float))
    try:
        value = None if wrong else tp(raw)
    except ValueError:
        value = None
    if value is None:
        raise TypeError(f"{name}={raw!r}: expected {'an int' if tp is int else 'a float'}")
    if not math.isfinite(value):  # nan and inf parse as floats, and then break the step or its metrics line
        raise ValueError(f"{name}={raw!r}: expected a finite number, not {value}")
    return value


def _set(cfg: JobConfig, dotted: str, raw: Any, where: str) -> None:
    obj, key, tp = _resolve(cfg, dotted, where)
    setattr(obj, key, parse_value(raw, tp, dotted))


def _split_cli(argv: list[str]) -> list[tuple[str, str]]:
    """`--a.b v`, `--a.b=v`, and a bare `--a.b` (true, for bools) -> [("a.b", "v"), ...]."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ValueError(f"unexpected argument {arg!r}: expected --section.key value (--help lists the keys)")
        if "=" in arg:
            name, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            name, value = arg[2:], argv[i + 1]
            i += 2
        else:
            name, value = arg[2:], "true"
            i += 1
        pairs.append((name, value))
    return pairs


def _toml_items(table: dict[str, Any], prefix: str, where: str) -> list[tuple[str, Any]]:
    """("section.key", value) for every value of a TOML document, sub-tables flattened."""
    items: list[tuple[str, Any]] = []
    for name, value in table.items():
        dotted = f"{prefix}{name}"
        if isinstance(value, dict):
            items += _toml_items(value, f"{dotted}.", where)
        elif not prefix:
            raise ValueError(f"{where}: [{name}] must be a table, found {value!r}")
        else:
            items.append((dotted, value))
    return items


def load_config(argv: list[str] | None = None) -> JobConfig:
    """Defaults < the TOML named by `--job.config_file` < the other `--section.key value` overrides.
    Every unknown key and bad value is reported in one error; `--help` prints the keys and exits."""
    argv = list(argv or [])
    if "--help" in argv or "-h" in argv:
        from .help_text import print_help

        print_help()
        raise SystemExit(0)
    cfg = JobConfig()
    pairs = _split_cli(argv)
    settings: list[tuple[str, Any, str]] = []
    config_file = next((v for k, v in pairs if k == "job.config_file"), None)
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise FileNotFoundError(f"job.config_file {config_file!r} does not exist")
        with path.open("rb") as f:
            data = tomllib.load(f)
        settings += [(k, v, config_file) for k, v in _toml_items(data, "", config_file)]
    settings += [(k, v, "command line") for k, v in pairs]
    errors: list[Exception] = []
    for dotted, raw, where in settings:
        try:
            _set(cfg, dotted, raw, where)
        except (ValueError, TypeError) as e:
            errors.append(e)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ValueError(f"{len(errors)} config errors: " + " | ".join(str(e) for e in errors))
    return cfg


# ------------------------------------------------------------------------------------- output
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)  # a JSON string is a valid TOML basic string


def _toml_tables(table: dict[str, Any], name: str) -> list[str]:
    """`[name]` with its values, then its sub-tables as `[name.sub]` (TOML has no null: None is left out)."""
    values = [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None and not isinstance(v, dict)]
    lines = [f"[{name}]", *values]
    lines.append("")
    for k, v in table.items():
        if isinstance(v, dict):
            lines += _toml_tables(v, f"{name}.{k}")
    return lines


def to_toml(cfg: JobConfig) -> str:
    """The resolved config as TOML, loadable by `load_config`."""
    return "\n".join(line for section, values in cfg.to_dict().items() for line in _toml_tables(values, section))


def save_config(cfg: JobConfig, folder: str | Path) -> Path:
    """Write config.toml and config.json into `folder`; returns the TOML path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    path = folder / "config.toml"
    path.write_text(to_toml(cfg))
    return path
