"""Independent references for the core tests.

`masked_reference_logits`: the FULL cache (a plain transformers DynamicCache, nothing evicted) with a
plain eager attention that hides, per layer and KV head, every key the compressed run did not have
at that step. If compression (gather, positions, masks, GQA layout) is right, the logits agree.

`naive_snapkv_selection` / `naive_column_sums`: method scores from eager attention weights with
Python loops (no shared code with snapkv.methods). `naive_pooled_votes` / `naive_adakv_counts`:
AdaKV's window votes and per-head counts (FFY0/AdaKV's `snapkv_utils.py`), which tests/methods/
compares with Ada-KV and with CriticalKV's AdaKV base. `naive_kvpress_snapkv_votes`: kvpress'
`SnapKVPress.score` (average pooling per query head, then the group mean), CriticalKV's base in the
authors' `criti_snapkv` / `criti_adasnapkv`.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import snapkv.forward as forward
import snapkv.hooks as hooks


def record_visible(model, run):
    """Run `run()` (a compressed generation) recording, for every forward and compressible layer,
    the original positions `[batch, kv_heads, n]` each head attended to (after the cache update)."""
    records: list[dict[int, torch.Tensor]] = []
    original = hooks.Session.after_attention

    def spy(self, module, layer, query, key):
        step = getattr(self, "_spy_step", None)
        if step is None or module.layer_idx in step:
            step = {}
            records.append(step)
            self._spy_step = step
        # Per-head storage (Ada-KV) pads short heads with -1: repeat the head's first position
        # instead (harmless for the reference's scatter).
        pos = layer.head_positions() if hasattr(layer, "head_positions") else layer.positions
        step[module.layer_idx] = torch.where(pos < 0, pos[..., :1], pos).clone()
        return original(self, module, layer, query, key)

    hooks.Session.after_attention = spy
    try:
        out = run()
    finally:
        hooks.Session.after_attention = original
    return out, records


@contextlib.contextmanager
def masked_attention(visible_by_layer: dict):
    """Register 'ref_masked': eager attention whose keys are limited to `visible_by_layer[layer]`
    (original positions, per KV head) when set; causal/sliding masks come from sdpa_mask."""

    def attn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        b, h, q, d = query.shape
        kv = key.shape[1]
        k = key.repeat_interleave(h // kv, dim=1).double()
        v = value.repeat_interleave(h // kv, dim=1).double()
        logits = query.double() @ k.transpose(-1, -2) * scaling
        if attention_mask is None:  # sdpa_mask skipped it: plain causal, bottom-right aligned
            attention_mask = torch.ones(q, key.shape[2], dtype=torch.bool, device=key.device).tril(
                key.shape[2] - q
            )
        logits = logits.masked_fill(~attention_mask, float("-inf"))
        vis = visible_by_layer.get(module.layer_idx)
        if vis is not None:
            allowed = torch.zeros(b, kv, key.shape[2], dtype=torch.bool, device=key.device)
            allowed.scatter_(2, vis.to(key.device), True)
            allowed = allowed.repeat_interleave(h // kv, dim=1)[:, :, None, :]
            logits = logits.masked_fill(~allowed, float("-inf"))
        probs = logits.softmax(-1)
        out = (probs @ v).to(query.dtype)
        return out.transpose(1, 2).contiguous(), probs

    AttentionInterface.register("ref_masked", attn)
    AttentionMaskInterface.register("ref_masked", sdpa_mask)
    try:
        yield
    finally:
        AttentionInterface._global_mapping.pop("ref_masked", None)
        AttentionMaskInterface._global_mapping.pop("ref_masked", None)


def masked_reference_logits(
    model, prompt_chunks: list[torch.Tensor], fed: list[torch.Tensor], records, every_position: bool = False
):
    """Teacher-forced full-cache run: the prompt chunks (attended in full, as the compressed run's
    prefill was) then each `fed` input masked to `records[i]`; last-position logits `[batch, vocab]`
    per forward (every_position: all of them, `[batch, q, vocab]`)."""
    impl = model.config._attn_implementation
    visible: dict = {}
    cache = DynamicCache(config=model.config)
    outs = []
    with masked_attention(visible), torch.no_grad():
        model.set_attn_implementation("ref_masked")
        try:
            pos = 0
            for i, ids in enumerate(prompt_chunks + fed):
                # The compressed run's prefill attention was full; later forwards saw `records[i]`.
                visible.clear()
                if i >= len(prompt_chunks):
                    visible.update(records[i])
                p = torch.arange(pos, pos + ids.shape[1], device=ids.device).unsqueeze(0)
                out = model(
                    input_ids=ids, position_ids=p, use_cache=True, **{forward.cache_kwarg(model): cache}
                )
                pos += ids.shape[1]
                outs.append(out.logits.float() if every_position else out.logits[:, -1].float())
        finally:
            model.set_attn_implementation(impl)
    return outs


def eager_attentions(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer causal attention weights `[batch, heads, L, L]` from the model's eager path."""
    impl = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=ids, output_attentions=True)
    finally:
        model.set_attn_implementation(impl)
    return [a.double() for a in out.attentions]


def naive_snapkv_selection(
    attn: torch.Tensor,
    kv_heads: int,
    budget: int,
    window: int,
    kernel: int,
    pooling: str,
    reduce: str,
    order: str = "reduce_first",
):
    """Kept positions per KV head from one layer's eager weights `[1, heads, L, L]`, with loops.

    order="reduce_first": the group's votes are reduced, then pooled (KVCache-Factory's kv-head
    mode, AdaKV's gqa_support); "pool_first": each query head's votes are pooled, then reduced."""
    _, h, length, _ = attn.shape
    g = h // kv_heads
    prefix = length - window

    def pooled(votes):
        out = []
        for j in range(prefix):
            lo, hi = j - kernel // 2, j + kernel // 2
            vals = [votes[i] if 0 <= i < prefix else 0.0 for i in range(lo, hi + 1)]
            if pooling == "max":
                out.append(max(v for i, v in zip(range(lo, hi + 1), vals) if 0 <= i < prefix))
            elif pooling == "avg":
                out.append(sum(vals) / kernel)
            else:
                out.append(votes[j])
        return out

    def reduced(rows):
        cols = list(zip(*rows))
        if reduce == "mean":
            return [sum(c) / g for c in cols]
        if reduce == "max":
            return [max(c) for c in cols]
        return [sum(c) for c in cols]

    kept = []
    for kvh in range(kv_heads):
        votes = [
            [float(attn[0, qh, length - window :, j].sum()) for j in range(prefix)]
            for qh in range(kvh * g, (kvh + 1) * g)
        ]
        if order == "reduce_first":
            score = pooled(reduced(votes))
        else:
            score = reduced([pooled(v) for v in votes])
        top = sorted(range(prefix), key=lambda j: -score[j])[: budget - window]
        kept.append(sorted(top) + list(range(prefix, length)))
    return kept


def naive_column_sums(attn: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """H2O scores: column sums of the causal weights, mean over each GQA group -> `[kv_heads, L]`."""
    _, h, length, _ = attn.shape
    g = h // kv_heads
    sums = attn[0].sum(dim=1)  # [heads, L]
    return sums.view(kv_heads, g, length).mean(1)


def _round_half_even(x: float) -> int:
    return round(x)  # Python's round is half to even, as torch.round


def naive_pooled_votes(attn: torch.Tensor, kv_heads: int, window: int, kernel: int) -> list[list[float]]:
    """AdaKV's `calcul_attn_sore` with gqa_support, one layer `[1, heads, L, L]` -> per KV head:
    mean over the window queries, mean over the group, max-pool (stride 1, padding kernel // 2)."""
    _, h, length, _ = attn.shape
    g, prefix = h // kv_heads, length - window
    out = []
    for kvh in range(kv_heads):
        votes = [
            sum(float(attn[0, qh, length - window :, j].mean()) for qh in range(kvh * g, (kvh + 1) * g)) / g
            for j in range(prefix)
        ]
        half = kernel // 2
        out.append([max(votes[max(0, j - half) : j + half + 1]) for j in range(prefix)])
    return out


def naive_kvpress_snapkv_votes(
    attn: torch.Tensor, kv_heads: int, window: int, kernel: int
) -> list[list[float]]:
    """kvpress' `SnapKVPress.score` (NVIDIA/kvpress @ 8bb29b9c3078452a86d692f29123fa6c793e2b05, and
    FFY0/AdaKV-in-NVIDIA-kvpress @ 88f5b1fb245d356c4a37cc734dd47dcd817779f1) on one layer
    `[1, heads, L, L]` -> per KV head: each query head's mean over the window queries of its causal
    softmax row, average-pooled (stride 1, padding kernel // 2, the zero padding counted, as
    F.avg_pool1d's default), then the mean over the group; the window's own columns dropped."""
    _, h, length, _ = attn.shape
    g, prefix, half = h // kv_heads, length - window, kernel // 2
    out = []
    for kvh in range(kv_heads):
        pooled = []
        for qh in range(kvh * g, (kvh + 1) * g):
            votes = [float(attn[0, qh, prefix:, j].mean()) for j in range(prefix)]
            pooled.append([sum(votes[max(0, j - half) : j + half + 1]) / kernel for j in range(prefix)])
        out.append([sum(col) / g for col in zip(*pooled)])
    return out


def naive_adakv_counts(scores: list[list[float]], per_head: int, alpha: float, normalize: bool) -> list[int]:
    """AdaKV's per-head selected counts for one batch row (`update_kv_gqa`)."""
    h = len(scores)
    flat = []
    for head, row in enumerate(scores):
        ranked = sorted(row, reverse=True)
        ratio = sum(ranked[:per_head]) / sum(ranked) if normalize else 1.0
        flat += [(v * ratio, head) for v in ranked]
    top = sorted(flat, key=lambda t: -t[0])[: h * per_head]
    counts = [sum(1 for _, head in top if head == i) for i in range(h)]
    floor = int(per_head * alpha)
    return [_round_half_even(c * (1 - alpha) + floor) for c in counts]
