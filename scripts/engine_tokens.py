"""Greedy-token parity of OpenVINO GenAI's full cache with the harness' on a run's prompts (the
logic and its options: eval/analysis/engine_tokens.py).

    python scripts/engine_tokens.py experiment=engine_parity model=smollm2-135m-instruct \\
        engine.threads=1 out=results/serving/parity/tokens_smollm2-135m-instruct.csv
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from eval.analysis.engine_tokens import main

    sys.exit(main(sys.argv[1:]))
