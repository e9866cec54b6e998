"""Score LongBench-format predictions with the official metrics (eval.tasks.longbench.score).
Installed, the same is `snapkv-score-longbench` (eval/cli.py).

python scripts/score_longbench.py PRED_DIR [--e]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout

from eval.cli import score_longbench  # noqa: E402

if __name__ == "__main__":
    sys.exit(score_longbench())
