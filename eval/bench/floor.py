"""Why H2O's prefill cannot get close to the full cache's with PyTorch ops: CPU seconds of one
layer's attention at `length` tokens (SmolLM2 shapes by default: 9 query / 3 KV heads, d=64), one
thread (CPU time: robust to other processes).

    python scripts/bench_floor.py [length]

Prints the model's sdpa (flash kernel, output only), the QK^T GEMM alone over the causal half,
QK^T + exp + column sums (what exact column sums cost given sdpa's log-sum-exp), and the fused
exact pass H2O uses (`snapkv.methods.base.blockwise_attention`: output + column sums).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def _cpu(f: Callable[[], object], n: int = 2) -> float:
    f()
    best = []
    for _ in range(n):
        c = time.process_time()
        f()
        best.append(time.process_time() - c)
    return min(best)


def main(length: int = 8192, heads: int = 9, kv: int = 3, d: int = 64) -> str:
    # Lazy: scripts/bench_floor.py sets HF_HUB_OFFLINE before calling this, and huggingface_hub
    # (loaded with snapkv) reads it when imported.
    import torch

    from snapkv.methods.base import blockwise_attention, grouped

    torch.set_num_threads(1)
    g, rows = heads // kv, 28  # 28 query rows per block: blockwise_attention's 8 MiB block at 8K
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, length, d, generator=gen) for h in (heads, kv, kv))
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    qg, kt = grouped(q, kv), k.transpose(-1, -2)

    def qk(exp_sum: bool) -> None:
        sums = torch.zeros(1, kv, g, length)
        for s in range(0, length, rows):
            t = min(s + rows, length)
            x = torch.matmul(qg[:, :, :, s:t].reshape(1, kv, (t - s) * g, d), kt[..., :t])
            if exp_sum:
                sums[..., :t] += x.exp_().view(1, kv, g, t - s, t).sum(-2)

    pos = torch.arange(length)
    sd = _cpu(lambda: torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True))
    gemm, col = _cpu(lambda: qk(False)), _cpu(lambda: qk(True))
    fused = _cpu(lambda: blockwise_attention(q, k, pos, pos.expand(1, kv, length), d**-0.5, v))
    return (
        f"L={length}: sdpa {sd:.3f} s | QK^T GEMM, causal half {gemm:.3f} s ({gemm / sd:.2f}x sdpa) | "
        f"QK^T + exp + column sums {col:.3f} s ({col / sd:.2f}x) | fused output + column sums "
        f"{fused:.3f} s ({fused / sd:.2f}x)"
    )
