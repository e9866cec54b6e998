"""The layering, checked by import-linter's contracts (`.importlinter`: grimp reads every import
statement, function-level ones included): `snapkv/` never imports `eval/` and reaches model
acquisition (`snapkv_models/`) only through `snapkv.models`, `snapkv_models/` never imports
`eval/`, `eval/` has no import cycle, the harness never reaches the speed benchmark or the analyses, the statistics and the labels
are leaves, and task code never imports a report. And what the contracts cannot see: every module
of `eval/` imports on its own, in any order, and the task registry loads a task only when asked."""

from __future__ import annotations

import configparser
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EVAL_MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "eval").rglob("*.py")
    if p.name != "__main__.py"
)


def _lint(cwd: Path, config: Path) -> subprocess.CompletedProcess:
    code = (
        "from importlinter.cli import lint_imports; "
        f"raise SystemExit(lint_imports(config_filename={str(config)!r}, no_cache=True, no_logo=True))"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_the_import_contracts_are_kept():
    res = _lint(ROOT, ROOT / ".importlinter")
    assert res.returncode == 0, res.stdout + res.stderr
    for contract in (
        "imports nothing from eval/",
        "only through snapkv.models",
        "snapkv_models/ (model acquisition, installed with the library) imports nothing",
        "No cycles in eval/",
        "never reaches",
        "are leaves",
    ):
        assert contract in res.stdout and "BROKEN" not in res.stdout


def test_the_reexport_contract_lets_only_snapkv_models_import_model_acquisition(tmp_path):
    """The `.importlinter` contract itself, run over a stand-in pair of packages: the re-export
    `snapkv.models` may import `snapkv_models`, any other `snapkv` module (function level too) may not."""
    contracts = configparser.ConfigParser()
    contracts.read(ROOT / ".importlinter")
    lines = {
        key: value.replace("\n", "\n    ")
        for key, value in contracts["importlinter:contract:reexport"].items()
    }
    for pkg in ("snapkv", "snapkv_models"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "snapkv_models" / "loading.py").write_text("def load_model():\n    return None\n")
    (tmp_path / "snapkv_models" / "paths.py").write_text("")
    (tmp_path / "snapkv" / "models.py").write_text("from snapkv_models.loading import load_model\n")
    (tmp_path / "snapkv" / "cache.py").write_text("def f():\n    return 1\n")
    config = tmp_path / ".importlinter"
    config.write_text(
        "[importlinter]\nroot_packages =\n    snapkv\n    snapkv_models\n\n[importlinter:contract:reexport]\n"
        + "".join(f"{key} = {value}\n" for key, value in lines.items())
    )
    res = _lint(tmp_path, config)
    assert res.returncode == 0 and "KEPT" in res.stdout, res.stdout + res.stderr
    (tmp_path / "snapkv" / "cache.py").write_text("def f():\n    from snapkv_models import paths\n")
    res = _lint(tmp_path, config)
    assert res.returncode == 1 and "BROKEN" in res.stdout, res.stdout + res.stderr


def test_the_cycle_contract_sees_a_cycle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    config = tmp_path / ".importlinter"
    config.write_text(
        "[importlinter]\nroot_packages =\n    pkg\n\n"
        "[importlinter:contract:acyclic]\nname = no cycles\ntype = acyclic_siblings\nancestors =\n    pkg\n"
    )
    res = _lint(tmp_path, config)
    assert res.returncode == 1 and "BROKEN" in res.stdout, res.stdout + res.stderr
    (pkg / "b.py").write_text("def f():\n    return 1\n")
    assert _lint(tmp_path, config).returncode == 0


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_every_eval_module_imports_alone_in_any_order():
    """Each module imported first into a process holding no other `eval` module (forward, then in
    reverse order): a cycle held together by import order would fail one of them."""
    res = _python(
        f"""
        import importlib, sys
        names = {EVAL_MODULES!r}
        for order in (names, names[::-1]):
            for name in order:
                for loaded in [m for m in sys.modules if m == "eval" or m.startswith("eval.")]:
                    del sys.modules[loaded]
                importlib.import_module(name)
        print(len(names))
        """
    )
    assert res.returncode == 0, res.stderr
    assert int(res.stdout) == len(EVAL_MODULES) > 50


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_the_task_registry_loads_a_task_only_when_asked_and_never_its_report():
    res = _python(
        """
        import sys
        from eval.tasks import TASKS, REPORTS, task_class, task_report
        loaded = lambda: sorted(m for m in sys.modules if m.startswith("eval.tasks.") and m.count(".") > 2)
        assert loaded() == [], loaded()
        assert task_class("needle").__name__ == "NeedleTask"
        assert "eval.tasks.needle.task" in sys.modules and "eval.tasks.ruler.task" not in sys.modules
        reports = [m for m in sys.modules if m.startswith("eval.") and (m.endswith(".report") or ".report." in m)]
        assert not reports and "matplotlib" not in sys.modules, reports
        assert task_report("needle").__name__ == "NeedleReport"
        assert isinstance(TASKS["needle"], type) and isinstance(REPORTS["needle"], type)
        assert isinstance(TASKS["ruler"], str)
        print("ok")
        """
    )
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
