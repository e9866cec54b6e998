"""Run the equal-bytes grid (conf/experiment/equal_bytes.yaml), or list its configs.

    python scripts/equal_bytes.py list [only=SUBSTRING]    # one `python run.py ...` line per config
    python scripts/equal_bytes.py run [only=SUBSTRING]     # run them, one after another

`run` launches `run.py` once per config of the grid, single-threaded (OMP_NUM_THREADS=1); `run.py`
resumes a config that has rows already, so a rerun continues where the last one stopped. A config
that a task's `reuse` folder holds (the same config's rows, counting the bytes the grid counts:
`equal_bytes.reused`) runs there instead, where `run.py` finds its rows and runs what is missing. `only`
keeps the configs whose name (`<task>/<method>[@budget][+storage]`) contains it. A config that fails
is reported and the next one runs; the exit code is then 1. The figures and tables are rendered by
`python scripts/make_figures.py` (eval/report/equal_bytes.py). Bad input exits 2 with one line.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval.report import equal_bytes  # noqa: E402

COMMANDS = ("list", "run")


def parse(argv: list[str]) -> tuple[str, str]:
    """(command, only); ValueError naming a bad argument."""
    if not argv or argv[0] not in COMMANDS:
        raise ValueError(f"command must be one of {', '.join(COMMANDS)}, got {argv[0] if argv else None!r}")
    only = ""
    for arg in argv[1:]:
        key, sep, value = arg.partition("=")
        if key != "only" or not sep:
            raise ValueError(f"the only argument is only=SUBSTRING, got {arg!r}")
        only = value
    return argv[0], only


def overrides(run: equal_bytes.Run, elsewhere: set[equal_bytes.Run]) -> list[str]:
    """The run's `run.py` overrides; for a reused config, its results_dir is the reuse folder."""
    if run not in elsewhere:
        return list(run.overrides)
    return [o for o in run.overrides if not o.startswith("results_dir=")] + [
        f"results_dir=results/{run.reuse}"
    ]


def main(argv: list[str]) -> int:
    try:
        what, only = parse(argv)
        plan = [r for r in equal_bytes.load_plan() if only in r.name]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elsewhere = set(equal_bytes.reused(plan, ROOT / "results" / equal_bytes.FOLDER))
    if what == "list":
        for r in plan:
            print(shlex.join(["python", "run.py", *overrides(r, elsewhere)]))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    failed = []
    for i, r in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] {r.name}", flush=True)
        if (
            subprocess.run([sys.executable, "run.py", *overrides(r, elsewhere)], cwd=ROOT, env=env).returncode
            != 0
        ):
            failed.append(r.name)
    if failed:
        print(f"{len(failed)} of {len(plan)} configs failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
