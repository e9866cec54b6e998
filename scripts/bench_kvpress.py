"""Decode-step CPU time of this project's caches beside NVIDIA kvpress' (eval.bench.kvpress).

python scripts/bench_kvpress.py [--model M] [--length 4096] [--budget 512] [--rounds 12] [--steps 8] [--out CSV]

Exits 2 with one line when kvpress is not importable.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout

from eval.bench.kvpress import main  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
