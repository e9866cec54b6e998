"""Score LongBench-format predictions with the official metrics (eval.tasks.longbench.score).

python scripts/score_longbench.py PRED_DIR [--e]
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout

from eval.tasks.longbench.score import main  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
