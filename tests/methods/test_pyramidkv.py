"""PyramidKV's layer budgets against a naive transcription of KVCache-Factory's.

Transcribed from Zefan-Cai/KVCache-Factory (`pyramidkv/pyramidkv_utils.py`, `PyramidKVCluster.
update_kv`): no compression below the budget, uniform SnapKV budgets while L < 2 (budget - window),
else the floored pyramid `max_num - layer * steps` (+ window)."""

from __future__ import annotations

import pytest
from conftest import random_ids, tiny_model

from methods._common import W
from snapkv import build_method, generate_ids


def naive_kvcache_factory_budgets(
    budget: int, window: int, n_layers: int, beta: int, length: int
) -> list[int]:
    """Entries each layer keeps in KVCache-Factory's `PyramidKVCluster.update_kv` (window included)."""
    out = []
    for layer in range(n_layers):
        min_num = (budget - window) // beta
        max_num = (budget - window) * 2 - min_num
        if max_num >= length - window:
            max_num = length - window
            min_num = (budget - window) * 2 - max_num
        steps = (max_num - min_num) // (n_layers - 1)
        if length < budget:
            out.append(length)  # not compressed
        elif length < (budget - window) * 2:
            out.append(budget)  # uniform SnapKV budgets
        else:
            out.append(max_num - layer * steps + window)
    return out


@pytest.mark.parametrize("length", [30, 40, 50, 63, 64, 70, 96, 200])
def test_pyramidkv_floor_schedule_and_short_prompt_fallback_equal_kvcache_factory(length):
    model = tiny_model("llama", layers=4)
    ids = random_ids(length)
    method = build_method("pyramidkv", budget=40, window=W, schedule="floor", short_prompt="uniform")
    _, res = generate_ids(model, ids, None, method, max_new_tokens=1)
    assert res.kv_tokens_per_layer == [float(b) for b in naive_kvcache_factory_budgets(40, W, 4, 20, length)]


@pytest.mark.parametrize("length", [41, 50, 63])
def test_pyramidkv_default_falls_back_to_uniform_on_short_prompts_and_clip_does_not(length):
    model = tiny_model("llama", layers=4)
    ids = random_ids(length)
    _, res = generate_ids(model, ids, None, build_method("pyramidkv", budget=40, window=W), max_new_tokens=1)
    assert res.kv_tokens_per_layer == [40.0] * 4  # B < L < 2 (B - w): SnapKV's uniform budgets
    clip = build_method("pyramidkv", budget=40, window=W, short_prompt="clip")
    _, res = generate_ids(model, ids, None, clip, max_new_tokens=1)
    assert res.kv_tokens_per_layer[0] == length and res.kv_tokens_per_layer[0] > res.kv_tokens_per_layer[-1]
    assert sum(res.kv_tokens_per_layer) == 4 * 40  # the clipped pyramid, mean still exact
