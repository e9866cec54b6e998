"""Run the leaderboard's grid (conf/experiment/leaderboard.yaml), or say what it holds.

    python scripts/leaderboard.py run [cells=NAME,...] [methods=NAME,...]
    python scripts/leaderboard.py status [cells=...] [methods=...]

`run` launches `run.py` once per (cell, method) with the cell's overrides, one after another and
single-threaded (OMP_NUM_THREADS=1), skipping every config whose rows already cover the full
cache's samples of the cell; `run.py` itself resumes a config that stopped half way. `status`
prints the rows found per cell and method and runs nothing. The table is rendered by
`python scripts/make_figures.py`. Bad input exits 2 with one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.report import leaderboard as lb  # noqa: E402

COMMANDS = ("run", "status")


def parse(argv: list[str]) -> tuple[str, dict[str, list[str]]]:
    """(command, {"cells": [...], "methods": [...]}); ValueError naming a bad argument."""
    if not argv or argv[0] not in COMMANDS:
        got = argv[0] if argv else None
        raise ValueError(f"command must be one of {', '.join(COMMANDS)}, got {got!r}")
    options: dict[str, list[str]] = {}
    for arg in argv[1:]:
        key, sep, value = arg.partition("=")
        if not sep or key not in ("cells", "methods") or not value:
            raise ValueError(f"arguments are cells=NAME,... and methods=NAME,..., got {arg!r}")
        options[key] = [v for v in value.split(",") if v]
    return argv[0], options


def select(cells: list[lb.Cell], options: dict[str, list[str]]) -> tuple[list[lb.Cell], list[str]]:
    """The cells and methods asked for (all of each by default); ValueError listing the known names."""
    known_cells, known_methods = [c.name for c in cells], lb.methods()
    for key, known in (("cells", known_cells), ("methods", known_methods)):
        unknown = [v for v in options.get(key, []) if v not in known]
        if unknown:
            raise ValueError(f"unknown {key[:-1]} {unknown[0]!r}; known: {', '.join(known)}")
    chosen = options.get("cells") or known_cells
    names = options.get("methods") or known_methods
    return [c for c in cells if c.name in chosen], names


def coverage(
    cell: lb.Cell, names: list[str], results_root: Path
) -> tuple[dict[str, str], dict[str, int], int]:
    """({method: hash}, {method: ok rows}, the full cache's ok rows) of the cell."""
    configs = lb.specs(cell, sorted({*names, lb.BASELINE}))
    hashes = {m: spec.method_hash for m, spec in configs.items()}
    rows = lb.cell_rows(cell, configs, results_root)
    counts = rows.groupby("method").size().to_dict() if not rows.empty else {}
    return hashes, {m: int(counts.get(m, 0)) for m in names}, int(counts.get(lb.BASELINE, 0))


def main(argv: list[str]) -> int:
    try:
        command, options = parse(argv)
        cells, names = select(lb.load_grid(), options)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results_root = ROOT / "results"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    for cell in cells:
        hashes, found, full_rows = coverage(cell, names, results_root)
        for name in names:
            line = (
                f"{cell.name:28s} {name:26s} {hashes[name]}  {found[name]:4d} rows (full cache: {full_rows})"
            )
            print(line, flush=True)
            # Complete where the config holds as many ok rows as the full cache (which runs first).
            if command == "status" or (found[name] and found[name] >= full_rows and name != lb.BASELINE):
                continue
            proc = subprocess.run([sys.executable, "run.py", *cell.run_overrides(name)], cwd=ROOT, env=env)
            if proc.returncode != 0:
                print(
                    f"error: run.py exited {proc.returncode} on cell {cell.name}, method {name}",
                    file=sys.stderr,
                )
                return proc.returncode
            if name == lb.BASELINE:
                full_rows = coverage(cell, [name], results_root)[1][name]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
