"""A paired A/B of two input lengths' decode steps in one process (eval.bench.pair).

python scripts/bench_pair.py [model] [short] [long] [pairs]    # default smollm2-135m-instruct 512 1024 6
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout

from eval.bench.pair import main  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(*(a if i == 0 else int(a) for i, a in enumerate(sys.argv[1:])))
