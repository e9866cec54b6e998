"""Summarise a results directory: tables, plots and report.md from the stored rows (eval.report).

python scripts/report.py RESULTS_DIR [--out DIR] [--trained-context N]
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout

from eval.report import main  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
