"""Entry point of the SnapKV paper's observation analysis: `eval.analysis.observation` does the work, configured
from conf/observation.yaml and conf/model/ (see there). Same as `python scripts/observation.py`.

    python scripts/observation.py [key=value ...] [model=NAME]
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout

from eval.analysis.observation import main  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")  # see scripts/bench_speed.py
    sys.exit(main(sys.argv[1:]))
