"""The one list of methods and parameter variants that every method-wide test parametrizes over
(kvpress' `default_presses.py` idea). Adding a method or a switch: add a line here, and every
method-wide test (exactness against the masked full cache, `model.generate` inside `apply`, chunked
prefill, budget >= length == full, ...) runs it. `test_catalogue_covers_every_method_and_switch`
fails while a registered method or a value of one of its switches is missing.

Budgets are for the tests' 96-token prompts: every entry but `full` really evicts (40 < 96, and
96 >= 2 x (40 - 8), so PyramidKV's pyramid runs rather than its short-prompt fallback).
"""

from __future__ import annotations

from typing import Any

W = 8  # observation window of the SnapKV-family entries

CATALOGUE: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("snapkv", dict(budget=40, window=W, kernel_size=5)),
    (
        "snapkv",
        dict(budget=40, window=W, kernel_size=4, pooling="avg", gqa_reduce="max", gqa_order="pool_first"),
    ),
    ("snapkv", dict(budget=40, window=W, kernel_size=5, pooling="none", gqa_reduce="sum")),
    ("snapkv", dict(budget=40, window=W, kernel_size=5, span=6)),  # our variant (not the paper)
    ("h2o", dict(budget=40, evict_during_decode=True)),
    ("h2o", dict(budget=40, evict_during_decode=False, normalize=True, gqa_reduce="max")),
    ("h2o", dict(budget=40, recent=10, fused=False, gqa_reduce="sum")),
    ("streamingllm", dict(budget=40, n_sink=4)),
    ("pyramidkv", dict(budget=40, window=W, kernel_size=5)),
    ("pyramidkv", dict(budget=40, window=W, schedule="floor", short_prompt="clip", gqa_order="pool_first")),
    ("adakv", dict(budget=40, window=W, layout="padded")),
    ("adakv", dict(budget=40, window=W, layout="varlen")),
    ("adakv", dict(budget=40, window=W, layout="varlen", base="pyramidkv", normalize=True, alpha=0.5)),
    ("adakv", dict(budget=40, window=W, layout="padded", allocation="exact", normalize="sum")),
    (
        "adakv",
        dict(
            budget=40,
            window=W,
            base="pyramidkv",
            schedule="floor",
            short_prompt="uniform",
            gqa_order="pool_first",
        ),
    ),
    ("adakv", dict(budget=40, window=W, allocation="kvpress")),
    ("criticalkv", dict(budget=40, window=W, kernel_size=5)),
    ("criticalkv", dict(budget=40, window=W, base="pyramidkv", first_stage_ratio=0.25)),
    ("criticalkv", dict(budget=40, window=W, base="adakv", layout="padded")),
    ("criticalkv", dict(budget=40, window=W, base="adakv", allocation="kvpress", normalize=True)),
    ("expected_attention", dict(budget=40)),
    ("expected_attention", dict(budget=40, use_covariance=False, use_vnorm=False, n_future_positions=64)),
    ("adakv_expected_attention", dict(budget=40, layout="padded")),
    ("adakv_expected_attention", dict(budget=40, allocation="adakv", epsilon=0.0)),
    ("tova", dict(budget=40)),  # the authors': evicts after every forward, the newest token included
    ("tova", dict(budget=40, evict_during_decode=False, keep_last=True)),  # kvpress' TOVAPress
    ("knorm", dict(budget=40)),
    ("knorm", dict(budget=40, skip_layers=[0], prune_after=50, evict_during_decode=True)),
    # The authors' l2_compress rule: ceil(0.5 x n) of the n entries each time a layer is pruned.
    ("knorm", dict(budget=40, keep_ratio=0.5, skip_layers=[1], prune_after=48, evict_during_decode=True)),
    # The question ids (the tests' last 16 prompt tokens) kept: at the end of prefill (query-aware)
    # or by the per-step eviction after they are fed (context-only); Ada-KV's normalised head
    # budgets over a question longer than the window.
    ("knorm", dict(budget=40, evict_during_decode=True, protect="question")),
    ("adakv", dict(budget=40, window=W, normalize=True, protect="question")),
    # Without a tokenizer the reconstruction inputs are the carried tokens and the chunk alone.
    ("kvzip", dict(budget=40, repeat_chunk=32)),  # the authors': threshold over all layers and heads
    (
        "kvzip",
        dict(budget=40, selection="global", layout="padded", n_sink=4, prompt="kvpress", repeat_chunk=48),
    ),
    ("kvzip", dict(budget=40, selection="layer", kvzip_plus=True)),
    ("kvzip", dict(budget=40, selection="head", carry=0, repeat_chunk=20)),
    # 88 prefix positions: 17 chunks of 5 and a trailing one of 3; 6 chunks + the window kept.
    ("chunkkv", dict(budget=40, window=W, kernel_size=5, chunk_length=5)),
    (
        "chunkkv",
        dict(
            budget=40, window=W, chunk_length=10, chunk_score="mean", reuse_layers=2, gqa_order="pool_first"
        ),
    ),
    # The wrappers around a scorer other than SnapKV (snapkv.methods.compose)
    ("pyramidkv", dict(budget=40, scorer="knorm")),
    ("adakv", dict(budget=40, scorer="knorm", allocation="kvpress", layout="padded")),
    ("criticalkv", dict(budget=40, base="adakv", scorer="expected_attention")),
    ("chunkkv", dict(budget=40, chunk_length=5, scorer="tova", scorer_params=dict(keep_last=True))),
]

# Decode schedules (`Method.decode_schedule`): with the tests' 8 new tokens, every entry compresses
# again while decoding (target < budget, or the cache grows past target + buffer).
SCHEDULED: list[tuple[str, dict[str, Any]]] = [
    ("snapkv", dict(budget=40, window=W, kernel_size=5, decode_schedule=dict(interval=2, target=36))),
    ("snapkv", dict(budget=40, window=W, decode_schedule=dict(interval=1, buffer=3, window=12))),
    ("pyramidkv", dict(budget=40, window=W, kernel_size=5, decode_schedule=dict(interval=3))),
    ("criticalkv", dict(budget=40, window=W, decode_schedule=dict(interval=2, target=0.4))),
    ("chunkkv", dict(budget=40, window=W, chunk_length=5, decode_schedule=dict(interval=2, target=36))),
    ("pyramidkv", dict(budget=40, scorer="tova", decode_schedule=dict(interval=2, target=36, window=4))),
    ("expected_attention", dict(budget=40, decode_schedule=dict(interval=2, target=36, window=4))),
    ("knorm", dict(budget=40, decode_schedule=dict(interval=2, target=36))),
    ("tova", dict(budget=40, evict_during_decode=False, decode_schedule=dict(interval=2, target=36))),
    ("snapkv_d", dict(budget=40, window=W, decode_schedule=dict(interval=2, target=36))),
    ("snapkv_d", dict(budget=40, window=1, kernel_size=5, decode_schedule=dict(interval=1))),
    # R-KV's own storage order and schedule on the total length (tests/methods/test_rkv.py)
    (
        "snapkv_d",
        dict(budget=40, window=W, kept_order="topk", decode_schedule=dict(interval=3, count_from="start")),
    ),
    ("rkv", dict(budget=40, window=W, decode_schedule=dict(interval=3))),
    (
        "rkv",
        dict(budget=40, window=W, mix_lambda=0.1, threshold=0.1, decode_schedule=dict(interval=2, target=36)),
    ),
    (
        "rkv",
        dict(budget=40, window=W, kept_order="topk", decode_schedule=dict(interval=4, count_from="start")),
    ),
    # arXiv 2512.12008's decode-time SnapKV (kvpress fork): the prompt's window votes, then the
    # current token alone, every step; top-k storage order (tests/methods/test_snapkv_d.py)
    (
        "snapkv",
        dict(
            budget=40,
            window=W,
            kernel_size=5,
            pooling="avg",
            gqa_order="pool_first",
            kept_order="topk",
            decode_schedule=dict(interval=1, window=1),
        ),
    ),
]
CATALOGUE += SCHEDULED
# Methods that refuse a decode schedule: no scores (full), their own decode-time state (H2O's
# accumulated attention, StreamingLLM's rolling window), per-head storage (no decode-time eviction).
NOT_SCHEDULABLE = {"full", "h2o", "streamingllm", "adakv", "adakv_expected_attention", "kvzip"}

# Parameters that are not enumerated switches (numbers, storage layout sizes) or whose other values
# are covered by dedicated tests (StreamingLLM's compacted positions only run in snapkv.generate).
NOT_SWITCHES = {
    "budget", "window", "kernel_size", "recent", "recent_ratio", "beta", "alpha", "block_size", "n_sink",
    "span", "n_future_positions", "epsilon", "first_stage_ratio", "skip_layers", "prune_after",
    "chunk_length", "reuse_layers", "repeat_chunk", "carry", "mix_lambda", "threshold",
    "decode_schedule",  # numbers: the SCHEDULED entries and tests/test_decode_schedule.py
}  # fmt: skip
SWITCHES_TESTED_ELSEWHERE = {("streamingllm", "positions"): "test_streamingllm_compacted_*"}


def ids(entries: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Readable pytest ids: `snapkv-budget=40-window=8-...`."""
    return ["-".join([name, *(f"{k}={v}" for k, v in params.items())]) for name, params in entries]


def catalogue(*names: str, budget: int | None = None) -> list[tuple[str, dict[str, Any]]]:
    """Catalogue entries (all, or of `names`); `budget` replaces every budget (not full's), and
    decode schedules then keep the budget (their `target` is dropped), as does K-norm (its
    `keep_ratio`, which replaces the budget, is dropped)."""
    out = []
    for name, params in CATALOGUE:
        if names and name not in names:
            continue
        if budget is not None and name != "full":
            params = {**params, "budget": budget}
            if "decode_schedule" in params:
                params["decode_schedule"] = {**params["decode_schedule"], "target": None}
            params.pop("keep_ratio", None)
        out.append((name, params))
    return out
