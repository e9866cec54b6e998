"""Is decoding from a compressed cache slower per token than decoding a full cache of the same size?
One process, one thread, configurations alternated (so both see the same process and, seconds
apart, nearly the same machine): full@`short` then snapkv(budget=`short`)@`long`, `pairs` times;
prints each TPOT (median CPU-time decode step) and each pair's ratio, then the median ratio.

    python scripts/bench_pair.py [model] [short] [long] [pairs]    # default smollm2-135m-instruct 512 1024 6

This isolates the method's per-token overhead (cache bookkeeping, gathered layouts) from the
process-to-process spread that `scripts/bench_speed.py`'s fresh-process rounds include.
"""

from __future__ import annotations

import statistics
from typing import Any


def main(
    model: str = "smollm2-135m-instruct", short: int = 512, long: int = 1024, pairs: int = 6, decode: int = 32
) -> dict[str, Any]:
    # Lazy: scripts/bench_pair.py sets HF_HUB_OFFLINE before calling this, and huggingface_hub
    # (loaded with torch's model stack) reads it when imported.
    import torch

    from eval.bench.measure import load, measure

    if short >= long:
        raise ValueError(f"short must be below long (the compressed prompt), got short={short}, long={long}")
    torch.set_num_threads(1)
    mcfg = dict(name=model, dtype="float32", device="cpu", attn_implementation="sdpa")
    net, vocab = load(mcfg, 0)

    def tpot(method: str, length: int, params: dict) -> float:
        spec = dict(method=method, params=params, input_tokens=length, batch_size=1, decode_tokens=decode,
                    chunk_size=None, seed=0, model=mcfg)  # fmt: skip
        return measure(net, vocab, spec)["tpot_cpu_s"]

    ratios = []
    for i in range(pairs):
        full = tpot("full", short, {})
        snap = tpot("snapkv", long, {"budget": short})
        ratios.append(snap / full)
        print(f"pair {i + 1}: full@{short} {1000 * full:.1f} ms  snapkv(b={short})@{long} {1000 * snap:.1f} ms"
              f"  ratio {snap / full:.3f}", flush=True)  # fmt: skip
    med = statistics.median(ratios)
    print(f"PAIRED TPOT snapkv(b={short})@{long} / full@{short}: median {med:.3f} "
          f"[{min(ratios):.3f}, {max(ratios):.3f}] over {pairs} pairs")  # fmt: skip
    return {"ratios": ratios, "median": med}
