"""The PyTorch-ops floor of H2O's prefill scoring against a plain prefill (eval.bench.floor).

python scripts/bench_floor.py [length]
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout

from eval.bench.floor import main  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(main(*(int(a) for a in sys.argv[1:2])))
