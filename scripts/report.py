"""Summarise a results directory: tables, plots and report.md from the stored rows (eval.report).
Installed, the same is `snapkv-report` (eval/cli.py).

python scripts/report.py RESULTS_DIR [--out DIR] [--trained-context N]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout

from eval.cli import report  # noqa: E402

if __name__ == "__main__":
    sys.exit(report())
