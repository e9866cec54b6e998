"""Serving benchmark at a fixed KV pool on OpenVINO GenAI's continuous batching: the full cache
beside each cache-eviction mode (norm_sum, sum, adaptive_rkv, snapkv) at several budgets, closed-loop
and Poisson arrivals, concurrency 1 up to the pool's limit; the logic is `eval.bench.serving`.

    python scripts/bench_serving.py                                  # SmolLM2's GGUF, 96 blocks, 3 rounds
    python scripts/bench_serving.py --pool-blocks 48 --concurrency 1,2,4 --budgets 256 \\
        --modes snapkv,norm_sum --arrivals closed,poisson --rate 0.5 --rounds 1 --out runs/serving
    python scripts/bench_serving.py --search                         # + each configuration's largest
                                                                     #   concurrency without preemption

Writes points.csv (one row per point per round), requests.csv (one row per request), search.csv
(with --search) and throughput_<arrival>.png into --out; prints each point as it ends and the
ratios to the full cache (median [IQR] over rounds). Exit 2 with one line on bad input or when
openvino_genai is missing (`pip install .[openvino]`), before anything loads.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from eval.bench.serving import main

    sys.exit(main(sys.argv[1:]))
