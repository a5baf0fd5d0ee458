"""Inside parallelisms/dtensor/, planning.py and the rules in ops/ import nothing that issues a collective
(docs/architecture.md §1): no chain of imports from them reaches collectives.py, redistribute.py, dispatch.py
or dtensor.py. A local_impl that communicates is handed its `LocalComm` by the dispatcher (ops/registry.py).

Checked on the source with `ast`, following the imports of parallelisms.dtensor from module to module (relative
ones, and absolute `parallelisms.dtensor...`). Importing `ops.norms` runs `ops/__init__.py` first, so a
package's `__init__` counts for every module below it; the root package's does not (every importer runs it).
Imports inside functions count too (a deferred import still imports); those under `if TYPE_CHECKING:` do not.
"""

from __future__ import annotations

import ast
from collections import deque
from functools import cache
from pathlib import Path

DTENSOR = Path(__file__).resolve().parents[2] / "parallelisms" / "dtensor"
ROOT = "parallelisms.dtensor"
COMMUNICATING = ("collectives", "redistribute", "dispatch", "dtensor")  # module names below ROOT


@cache
def _modules() -> dict[str, Path]:
    """Module name below ROOT -> its file: "" is the root package, "ops" ops/__init__.py, "ops.norms"."""
    found = {}
    for path in DTENSOR.rglob("*.py"):
        parts = path.relative_to(DTENSOR).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _is_package(name: str) -> bool:
    return _modules()[name].name == "__init__.py"


def _join(package: str, name: str) -> str:
    return f"{package}.{name}" if package and name else package or name


def _packages_above(name: str) -> list[str]:
    """The packages that importing `name` runs first, below the root: "ops" for "ops.norms"."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _statements(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, in function bodies too, except those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            found += [s for child in node.orelse for s in _statements(child)]
        else:
            found += _statements(node)
    return found


def _targets(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules of parallelisms.dtensor that `node`, in module `name`, imports (and so runs)."""
    modules = _modules()
    if isinstance(node, ast.Import):
        absolute = [alias.name for alias in node.names]
    elif node.level == 0:
        absolute = [node.module or ""]
    else:
        package = name if _is_package(name) else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            if not package:
                return []  # above parallelisms.dtensor
            package = package.rpartition(".")[0]
        absolute = [_join(f"{ROOT}.{package}".rstrip("."), node.module or "")]
    inside = [a.removeprefix(ROOT).lstrip(".") for a in absolute if a == ROOT or a.startswith(f"{ROOT}.")]
    if not inside:
        return []
    base = inside[0]
    if isinstance(node, ast.Import):
        targets = inside
    else:  # `from base import a, b`: submodules a and b, or names of base's own (its __init__ if a package)
        submodules = [_join(base, alias.name) for alias in node.names if _join(base, alias.name) in modules]
        targets = submodules + ([base] if len(submodules) < len(node.names) or base else [])
    assert all(t in modules for t in targets), f"{name}: cannot resolve {ast.unparse(node)} ({targets})"
    return [p for t in targets for p in (*_packages_above(t), t)]


def _file(name: str) -> str:
    return str(_modules()[name].relative_to(DTENSOR))


@cache
def _edges(name: str) -> tuple[tuple[str, int], ...]:
    """(module imported, line) for every import statement of `name` inside parallelisms.dtensor."""
    tree = ast.parse(_modules()[name].read_text(encoding="utf-8"), str(_modules()[name]))
    return tuple((t, node.lineno) for node in _statements(tree) for t in _targets(name, node) if t != name)


def import_chains(start: str) -> dict[str, str]:
    """Each module of parallelisms.dtensor that importing `start` reaches -> the shortest chain that gets there,
    as `planning.py:30 -> ops/__init__.py:3 -> ops/norms.py:35 -> collectives.py`."""
    chains = {start: ""}
    queue = deque([start, *_packages_above(start)])
    for package in _packages_above(start):
        chains[package] = f"{_file(start)} (its package)"
    while queue:
        name = queue.popleft()
        for target, line in _edges(name):
            if target not in chains:
                step = f"{_file(name)}:{line}"
                chains[target] = f"{chains[name]} -> {step}" if chains[name] else step
                queue.append(target)
    return {name: f"{chain} -> {_file(name)}" for name, chain in chains.items() if chain}


def _pure_modules() -> list[str]:
    return sorted(name for name in _modules() if name == "planning" or name == "ops" or name.startswith("ops."))


def test_the_scan_sees_planning_and_the_rules() -> None:
    pure = _pure_modules()
    assert "planning" in pure and len([n for n in pure if n.startswith("ops")]) >= 15, pure
    assert set(COMMUNICATING) <= set(_modules()), sorted(_modules())


def test_the_scan_follows_imports_through_packages() -> None:
    """It finds what is known to be there: dispatch reaches collectives (through redistribute) and
    planning every rule file (through ops/__init__.py), so the test below cannot pass by seeing nothing."""
    assert "collectives" in import_chains("dispatch")
    assert {"ops.norms", "ops.convolution", "ops.registry"} <= set(import_chains("planning"))


def test_planning_and_the_rules_import_nothing_that_communicates() -> None:
    offenders = [
        f"{_file(name)} imports {_file(bad)}: {chain}"
        for name in _pure_modules()
        for bad, chain in import_chains(name).items()
        if bad in COMMUNICATING
    ]
    assert not offenders, (
        "planning.py and ops/ must not import a module that communicates (docs/architecture.md §1); a local_impl "
        "takes its collectives from the LocalComm the dispatcher hands in (ops/registry.py):\n" + "\n".join(offenders)
    )
