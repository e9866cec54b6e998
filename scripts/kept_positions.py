"""Which needle positions each method keeps, for the digits ablation figures (eval.analysis.kept_positions).

python scripts/kept_positions.py [length=2000] [depth=50] [budget=512] [out=results/digits]
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout

from eval.analysis.kept_positions import main  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main(sys.argv[1:]))
