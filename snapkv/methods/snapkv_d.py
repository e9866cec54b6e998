"""SnapKV-D: SnapKV run while decoding, as R-KV's baseline (https://arxiv.org/abs/2505.24133).

R-KV's authors adapt SnapKV "from prompt-time to decode-time by compressing every 128 generated
tokens with the same budgets as R-KV" (Zefan-Cai/R-KV @ d15c9767e67c2bd9807128fecc35223fa2484a69,
`rkv/compression/snapkv.py`, `SnapKV.update_kv`; the schedule in `rkv/modeling.py`). Their scores,
per layer and KV head, with `window` the latest queries (the prompt's last ones first, then the
generated tokens'):

1. logits of the window's queries against the keys before the window, `q.k / sqrt(d)` (here: the
   module's own scaling and logit soft-capping), reduced over the GQA group by MAX on the logits;
2. a softmax over those prefix keys only (the window's own keys are not in the row), averaged over
   the window's queries;
3. max-pooling along the sequence (`kernel_size`, stride 1, padding kernel // 2);
4. the top `budget - window` prefix entries plus the window are kept.

The prompt is compressed the same way once prefill ends (the original's first forward), then the
decode schedule (`decode_schedule`, default every 128 tokens down to `budget`; see
`snapkv.methods.base.DecodeSchedule`) repeats it. Differences from that code by default, each with
its switch back:

- kept entries stay in position order (`kept_order=position`); `kept_order=topk` stores them as
  the original does, the top `budget - window` prefix entries by descending score, then the window
  in slot order, so that later max-pooling treats top-k neighbours as sequence neighbours and
  R-KV's "most recent" near-duplicate is the one in the highest slot; a cache of exactly `budget`
  entries is then reordered too (the original compresses unless `kv_cache_len < budget`). A forward
  of several tokens after the prefill (a later question) first puts the entries back in position
  order (`CompressibleLayer.update`: the block's causal mask needs it); the original has no such
  forward;
- the schedule counts tokens from the end of prefill (`decode_schedule.count_from=prefill`);
  `count_from=start` compresses where the original does: at the forward after the total length,
  prompt included, reaches a multiple of `interval`.

Position order is the default because every method stores its entries that way (scores, windows
and masks read positions ascending), and counting from the end of prefill because it makes the
steps after the prompt the same for every prompt length. Left as they are: ties go to the earlier
slot (the original's top-k leaves their order open), scores are fp32 throughout (the original
casts the pooled attention to the model dtype). SnapKV proper (paper scores, sum over the window
of a softmax over the full row, group mean) is `snapkv`, which takes a decode schedule too;
docs/methods.md lists the settings of the other decode-time SnapKVs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from snapkv.methods.base import KEPT_ORDERS, DecodeSchedule, KeptOrder, Method, grouped, pool, soft_cap
from snapkv.methods.checks import integer, one_of
from snapkv.methods.registry import register


def window_importance(
    query: torch.Tensor,
    key: torch.Tensor,
    window: int,
    kernel_size: int,
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """R-KV's importance `[batch, kv_heads, L - window]` of the keys before the window.

    query `[batch, heads, q>=window, d]` (the last `window` are the window's), key `[batch, kv_heads,
    L, d]` (the last `window` are the window's own). Logits reduced by max over each GQA group,
    softmax (fp32) over the L - window prefix keys, mean over the window's queries, max-pooled.
    """
    kv = key.shape[1]
    q = grouped(query[:, :, -window:], kv).float()  # [b, kv, g, w, d]
    logits = torch.einsum("bhgqd,bhkd->bhgqk", q, key[:, :, :-window].float()) * scaling
    logits = soft_cap(logits, softcap).amax(dim=2)  # [b, kv, w, L - w]
    return pool(logits.softmax(dim=-1).mean(dim=-2), kernel_size, "max")


@register
@dataclass
class SnapKVD(KeptOrder, Method):
    name = "snapkv_d"
    observation_window = "window"  # the latest queries that vote, from the last prefill chunk too
    # kept_order=topk: the original compresses a cache of exactly `budget` entries (or a scheduled
    # step's target) too, nothing dropped, the entries taking top-k order.
    reorders_at_budget = True

    budget: int | None = 1024  # entries kept per KV head per layer, window included
    window: int = 8  # latest queries that vote (R-KV's window_size)
    kernel_size: int = 7  # max-pooling kernel along the sequence
    kept_order: str = "position"  # position | topk (the original's storage order)
    # R-KV's baseline: every 128 tokens, back to the budget, with the window's queries.
    decode_schedule: DecodeSchedule | None = field(
        default_factory=lambda: DecodeSchedule(interval=128), kw_only=True
    )
    left_out_at_default: ClassVar[tuple[str, ...]] = ("kept_order",)

    checks = {
        "budget": integer(needed=True),
        "window": integer(),
        "kernel_size": integer(),
        "kept_order": one_of(KEPT_ORDERS),
    }

    def validate(self) -> None:
        super().validate()
        if self.window >= self.budget:
            raise ValueError(f"window must be < budget, got window={self.window}, budget={self.budget}")

    def protected(self) -> tuple[int, int]:
        return 0, self.window

    def importance(self, layer, query, key, module) -> torch.Tensor:
        if query.shape[2] < self.window:
            raise ValueError(
                f"{self.name} scores with the latest window={self.window} queries, got {query.shape[2]}"
            )
        return window_importance(query, key, self.window, self.kernel_size, module.scaling, layer.softcap)

    def score(self, layer, query, key, module) -> torch.Tensor:
        # [b, kv, L]: the window's own entries score 0 (they are protected)
        return F.pad(self.importance(layer, query, key, module), (0, self.window))

    def topk_order(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        # The original's layout: the prefix's top-k by descending score, then the window's slots.
        n, w = scores.shape[-1], self.window
        top = scores[..., : n - w].float().sort(dim=-1, descending=True, stable=True).indices
        window = torch.arange(n - w, n, device=scores.device).expand(*scores.shape[:-1], w)
        return torch.cat([top[..., : budget - w], window], dim=-1)
