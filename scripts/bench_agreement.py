"""Do several benchmark runs agree? Per run: the four target ratios (median [Q1, Q3] over its
rounds) and the noise it ran under; per ratio: max/min - 1 of the runs' medians against a tolerance.

    python scripts/bench_agreement.py results/bench/validation8k_ref/run{1,2,3}.csv [--tolerance 0.10] [--all-rounds]

Exit code 0 whether or not the runs agree (the table is the result); 2 for a missing or empty CSV.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eval.bench.report import agreement, default_clock, summarise_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="+", type=Path, help="benchmark CSVs (scripts/bench_speed.py out=...)")
    p.add_argument("--tolerance", type=float, default=0.10, help="max/min - 1 allowed (default 0.10)")
    p.add_argument(
        "--clock",
        choices=("auto", "ref", "cpu", "wall"),
        default="auto",
        help="which timings (default auto: ref where the rows have reference-clock values, else cpu)",
    )
    p.add_argument(
        "--all-rounds",
        action="store_true",
        help="use every round, the ones flagged noisy too (default: the summary's kept rounds)",
    )
    args = p.parse_args(argv)
    runs = []
    stems = [path.stem for path in args.csv]
    for path in args.csv:
        name = path.stem if stems.count(path.stem) == 1 else f"{path.parent.name}/{path.stem}"
        if not path.is_file():
            print(f"bench_agreement: no such file: csv={str(path)!r}", file=sys.stderr)
            return 2
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows:
            print(f"bench_agreement: no rows in csv={str(path)!r}", file=sys.stderr)
            return 2
        clock = default_clock(rows) if args.clock == "auto" else args.clock
        runs.append(summarise_run(f"{name} ({clock})", rows, clock, args.all_rounds))
    text, _ = agreement(runs, args.tolerance)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
