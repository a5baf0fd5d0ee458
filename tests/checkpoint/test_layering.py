"""The checkpoint package knows no model family: no module under checkpoint/ but the `convert` CLI imports
`models` (the adapter is handed in, checkpoint/hf_adapter_protocol.py), convert only inside a function (never when
imported), and no library module imports the CLI. Checked on the source with `ast`, every import statement
(inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoint"
CLI = "convert.py"


def _imports(tree: ast.AST, *, in_functions: bool = True) -> list[tuple[int, str]]:
    """(line, module) of every import in `tree`, and `module.name` of each name a from-import takes (so
    `from . import convert` reads `.convert`); relative modules keep their dots. Without `in_functions`,
    only what runs on import: function bodies are skipped."""
    found: list[tuple[int, str]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            prefix = module if module.endswith(".") else f"{module}."
            found += [(node.lineno, module)] + [(node.lineno, prefix + alias.name) for alias in node.names]
        if in_functions or not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            found += _imports(node, in_functions=in_functions)
    return found


def _is_models(module: str) -> bool:
    return module == "models" or module.startswith("models.")


def _sources() -> dict[str, ast.Module]:
    files = sorted(CHECKPOINT.rglob("*.py"))
    # the scan must see the package: the modules this test is about are there
    names = {p.name for p in files}
    assert {"__init__.py", "manager.py", "hf_conversion.py", "hf_state.py", CLI} <= names, names
    return {str(p.relative_to(CHECKPOINT)): ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in files}


def test_no_checkpoint_module_but_the_cli_imports_a_model_family() -> None:
    sources = _sources()
    library = {name: tree for name, tree in sources.items() if name != CLI}
    assert len(library) >= 10
    offenders = [f"checkpoint/{name}:{line}: {module}" for name, tree in library.items()
                 for line, module in _imports(tree) if _is_models(module)]  # fmt: skip
    assert not offenders, offenders


def test_the_cli_imports_models_only_inside_a_function() -> None:
    tree = _sources()[CLI]
    top_level = [module for _, module in _imports(tree, in_functions=False) if _is_models(module)]
    anywhere = [module for _, module in _imports(tree) if _is_models(module)]
    assert anywhere and not top_level, (anywhere, top_level)


def test_no_library_module_imports_the_cli() -> None:
    library = {name: tree for name, tree in _sources().items() if name != CLI}
    offenders = [f"checkpoint/{name}:{line}: {module}" for name, tree in library.items()
                 for line, module in _imports(tree)
                 if module == "checkpoint.convert" or module.endswith(".convert")]  # fmt: skip
    assert not offenders, offenders
