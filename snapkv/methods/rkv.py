"""R-KV: "Redundancy-aware KV Cache Compression for Reasoning Models" (https://arxiv.org/abs/2505.24133).

Ported from the authors' code (Zefan-Cai/R-KV @ d15c9767e67c2bd9807128fecc35223fa2484a69,
`rkv/compression/r1_kv.py`, `R1KV.update_kv`, and `rkv/utils.py`, `cal_similarity`). Per layer
and KV head, over the L stored keys, with `window` the latest queries:

- importance `I` `[L - window]`: SnapKV-D's score (`snapkv.methods.snapkv_d.window_importance`:
  group max on the logits, softmax over the prefix keys, mean over the window, max-pool
  `kernel_size`);
- redundancy `R` `[L]`: the cosine similarities `C[i, j]` of the (normalised, `k / (|k| + 1e-8)`)
  keys, the diagonal zeroed; in each row i, the last column j with `C[i, j] > threshold` (the most
  recent near-duplicate; column 0 when the row has none) is zeroed too; `R = softmax_j(mean_i
  C[i, j])`, then the window's columns are dropped;
- final score `λ I - (1 - λ) R` (`mix_lambda`); the top `budget - window` prefix entries plus the
  window are kept.

Decisions: `mix_lambda` defaults to the code's 0.07 (`run_math.py` and `R1KV`; the README's table
says 0.1: `method.mix_lambda=0.1`). The original computes the redundancy on batch row 0 and
applies it to every row; here each row uses its own keys. Rows of C are processed in blocks
(memory `block x L` per KV head, never L x L), in fp32 (the original: the model dtype). The prompt
is compressed once prefill ends (the original's first forward), then every 128 tokens
(`decode_schedule`, the code's `divide_length`) back to the budget. By default kept entries stay in
position order and the interval counts from the end of prefill; `kept_order=topk` and
`decode_schedule.count_from=start` reproduce the original's top-k storage order (the window after
the prefix's top-k; the redundancy rule's "most recent" near-duplicate is then the highest slot, as
there) and its schedule on the total length (`snapkv.methods.snapkv_d`, shared with the baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from snapkv.methods.checks import number
from snapkv.methods.registry import register
from snapkv.methods.snapkv_d import SnapKVD


def key_redundancy(key: torch.Tensor, threshold: float, block: int = 512) -> torch.Tensor:
    """R-KV's redundancy `[batch, kv_heads, L]` of key `[batch, kv_heads, L, d]` (see module doc):
    per row of the cosine matrix (diagonal and the row's last entry above `threshold` zeroed), the
    column means, then a softmax over the columns. Rows in blocks of `block`."""
    k = key.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    n = k.shape[2]
    cols = torch.arange(n, device=k.device)
    total = k.new_zeros(k.shape[:3])
    for s in range(0, n, block):
        cos = k[:, :, s : s + block] @ k.transpose(-1, -2)  # [b, kv, rows, L]
        rows = torch.arange(cos.shape[2], device=k.device)
        cos[:, :, rows, rows + s] = 0.0
        # The row's most recent near-duplicate (column 0 where it has none, as the original's
        # `where(mask, arange, 0).max()` gives).
        last = torch.where(cos > threshold, cols, 0).amax(dim=-1, keepdim=True)
        cos.scatter_(-1, last, 0.0)
        total += cos.sum(dim=2)
    return (total / n).softmax(dim=-1)


@register
@dataclass
class RKV(SnapKVD):
    name = "rkv"

    budget: int | None = 1024  # entries kept per KV head per layer, window included
    window: int = 8  # latest queries that vote (the code's window_size)
    kernel_size: int = 7
    mix_lambda: float = 0.07  # λ: importance weight (code: 0.07; README: 0.1)
    threshold: float = 0.5  # cosine similarity above which two keys are near-duplicates

    checks = {"mix_lambda": number(0, 1), "threshold": number(-1, 1)}

    def score(self, layer, query, key, module) -> torch.Tensor:
        importance = self.importance(layer, query, key, module)  # [b, kv, L - w]
        redundancy = key_redundancy(key, self.threshold)[..., : -self.window]
        final = importance * self.mix_lambda - redundancy * (1 - self.mix_lambda)
        return F.pad(final, (0, self.window))  # the window's entries are protected
