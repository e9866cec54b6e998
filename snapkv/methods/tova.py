"""TOVA: "Transformers are Multi-State RNNs" (https://arxiv.org/abs/2401.06104).

Token Omission Via Attention: a layer keeps at most `budget` entries (the multi-state size). After
a forward that leaves more, the attention of that forward's LAST query over every stored key (its
own included) is averaged over all the layer's query heads, and the entries with the lowest average
are dropped: one kept set per layer, the same positions for every KV head. Once the budget is full,
every decoding step adds one entry and evicts one; the newest token is a candidate like any other.
Scores are the weights the model's own attention uses (fp32 softmax, the module's logit soft-capping
and attention sinks when it has them); one query row per layer and step, never L x L.

Ported from the authors' code (schwartz-lab-NLP/TOVA @ 9c7d09bfff64cfc92cfb5f9d7e138cb04866e5a7,
`src/tova_cache.py`, `TOVACache.reduce`: mean over the heads of `attn_weights[:, :, -1, :]`, top
`cache_size`, after every forward once the cache is over size). Two switches give kvpress's
`TOVAPress` (NVIDIA/kvpress @ 8bb29b9c3078452a86d692f29123fa6c793e2b05), which compresses the
prompt once and always keeps its last token:

- `evict_during_decode`: True (default, the authors'): evict after every forward once over budget;
  False: compress once at the end of prefill, then append (kvpress).
- `keep_last`: False (default, the authors'): the newest token may be evicted; True: the last
  entry is never evicted (kvpress gives it the highest score).

The prefill selection uses the last prompt token's query (with chunked prefill: the last chunk's;
the originals do not chunk). kvpress' budget is a ratio of the prompt; here an entry count.

Scores are fp32 whatever the model's dtype, as every method's here, so that a selection does not
hang on rounding: the original averages the attention weights the model returns, in the model's
dtype. On a bf16 model, entries whose averages are within one bf16 step (2^-7 relative) of the
kept set's boundary tie or swap order there, and `topk` picks among its ties; the kept sets differ
only at that margin (tested on bf16 models). Exact ties go to the earlier position here. No switch
reproduces the bf16 average: the original reads it from eager attention's own kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from snapkv.methods.base import Method, OwnAttention, attention_output, victim_by_position, window_attention
from snapkv.methods.checks import flag, integer
from snapkv.methods.registry import register


def last_query_attention(query: torch.Tensor, key: torch.Tensor, module, layer) -> torch.Tensor:
    """TOVA's scores `[batch, kv_heads, n]`: the last query's softmax attention over the `n` stored
    keys, averaged over all query heads, the same for every KV head. query `[batch, heads, q, d]`
    (the forward's queries; the last one is the newest token), key `[batch, kv_heads, n, d]`."""
    votes = window_attention(query, key, 1, module.scaling, layer.softcap, layer.sinks)  # [b, kv, g, n]
    return _head_mean(votes, key.shape[1])


def _head_mean(votes: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`[batch, kv_heads, group, n]` -> the mean over all query heads, `[batch, kv_heads, n]` (the
    same row for every KV head). Every KV head has the same group size: the mean of the group
    means is the mean over all heads."""
    return votes.mean(dim=(1, 2))[:, None, :].expand(-1, kv_heads, -1)


@register
@dataclass
class TOVA(OwnAttention, Method):
    name = "tova"

    budget: int | None = 1024  # entries kept per KV head per layer (the multi-state size)
    evict_during_decode: bool = True  # authors: after every forward | False: prefill only (kvpress)
    keep_last: bool = False  # True: the last entry is never evicted (kvpress)

    checks = {"budget": integer(needed=True), "evict_during_decode": flag(), "keep_last": flag()}

    def protected(self) -> tuple[int, int]:
        return 0, int(self.keep_last)

    def score(self, layer, query, key, module) -> torch.Tensor:
        return last_query_attention(query, key, module, layer)

    def decode_attention(self, layer, query, key, value, module):
        # A step that will evict: its attention row is both the step's attention and TOVA's
        # scores (the authors read them from the model's attention weights), computed once (the
        # hooks then skip observe() for the step).
        if not (self.evict_during_decode and layer.stored > self.budget):
            return None
        probs = window_attention(query, key, 1, module.scaling, layer.softcap, layer.sinks)  # [b, kv, g, L]
        layer.scores = _head_mean(probs, key.shape[1])
        return attention_output(probs, value, query.dtype)

    def observe(self, layer, query, key, module) -> None:
        # After prefill (called only under per-step eviction, `EveryStep`), a forward that leaves
        # the layer over budget scores its stored entries with its last query for the eviction; the
        # scores are replaced (not accumulated) every step.
        if layer.state == "ready" and layer.stored > self.budget:
            layer.scores = last_query_attention(query, key, module, layer)

    def decode_score(self, layer) -> torch.Tensor:
        return layer.scores

    def victims(self, layer) -> torch.Tensor | int:
        # One kept set per layer: every KV head holds the same positions and scores, so with one
        # row the victim is one slot, the base class's rule (the protected span included) applied
        # to head 0.
        if layer.positions.shape[0] != 1:
            return super().victims(layer)
        return int(
            victim_by_position(
                layer.scores[0, 0], layer.positions[0, 0], layer.seen, self.protected(), layer.protected_span
            )
        )
