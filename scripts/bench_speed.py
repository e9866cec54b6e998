"""Speed and memory benchmark (prefill, TTFT, TPOT, peak memory) in interleaved rounds; the logic
is `eval.bench.run` and the configuration conf/bench.yaml (composed with conf/model/*, conf/method/*).

    python scripts/bench_speed.py                          # the CPU speed targets, 5 rounds
    python scripts/bench_speed.py 'lengths=[512,8192]' 'methods=[full,snapkv,h2o]' configs=null \
        budget=512 snapkv.window=16 rounds=3 out=bench.csv
    python scripts/bench_speed.py 'methods=[full,snapkv]' 'kv_quants.kivi4={kind:kivi,bits:4}' \
        'configs=[full@512,full@8192,full+kivi4@8192,snapkv@8192,snapkv+kivi4@8192]'   # quantized storage

The last line printed holds the four target ratios with their IQRs; the exit code is 0 whether or
not a target is met, 2 (one line naming the bad value) on bad input.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # On VMs an idle OpenMP worker sleeps and its wake-up costs a scheduler tick per parallel region
    # (docs/pitfalls.md, "CPU timing on VMs"). Spinning workers measure the kernels, not the scheduler. Set before torch loads OpenMP (the
    # workers inherit it); an explicit setting wins and is recorded in every row.
    os.environ.setdefault("OMP_WAIT_POLICY", "ACTIVE")
    from eval.bench.run import main

    sys.exit(main(sys.argv[1:]))
