"""The layering, read from the source (every import statement, module-level or inside a function):
`snapkv/` never imports `eval/`, and the harness (runner, report, store, tasks) never reaches the
speed benchmark or the analyses, directly or through another module of `eval/`."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module an import statement in `path` names (`from a.b import c` gives a.b and a.b.c)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


MODULES = {_module_name(p): p for d in ("snapkv", "eval") for p in (ROOT / d).rglob("*.py")}


def _reachable(start: str) -> set[str]:
    """Project modules `start` imports, transitively (a package's import runs its __init__)."""
    seen, todo = set(), [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in MODULES:
            continue
        seen.add(name)
        for imported in _imports(MODULES[name]):
            parts = imported.split(".")
            todo.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return seen


def test_the_walk_sees_function_level_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from eval.bench import run\n")
    assert "eval.bench.run" in _imports(f) and "eval.bench" in _imports(f)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("snapkv")))
def test_snapkv_never_imports_eval(name):
    bad = sorted(m for m in _imports(MODULES[name]) if m == "eval" or m.startswith("eval."))
    assert not bad, f"{name} imports {bad}"


@pytest.mark.parametrize("start", ["eval.runner", "eval.report", "eval.store", "eval.tasks", "eval.spec"])
def test_the_harness_never_reaches_the_benchmark_or_the_analyses(start):
    reached = _reachable(start)
    assert start in reached and "eval.tasks.registry" in _reachable("eval.tasks")
    bad = sorted(m for m in reached if m.startswith(("eval.bench", "eval.analysis")))
    assert not bad, f"{start} reaches {bad}"
