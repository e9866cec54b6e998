"""Results and rows say what decoding did: a prompt shorter than the budget is not compressed at
prefill, yet the methods that evict while decoding (H2O, StreamingLLM, TOVA, K-norm re-pruning)
evict once it has grown past the budget."""

from __future__ import annotations

import pytest
from conftest import random_ids, tiny_model

import eval.runner as runner
from eval.store import ROW_FIELDS
from snapkv import build_method, generate_ids

PROMPT, BUDGET, NEW = 20, 24, 12
DECODE_FIELDS = ("compressed", "evicted_during_decode", "decode_evicted", "kv_tokens_end")


@pytest.mark.parametrize(
    "name,params",
    [
        ("h2o", dict(budget=BUDGET)),
        ("streamingllm", dict(budget=BUDGET, n_sink=4)),
        ("tova", dict(budget=BUDGET)),
        ("tova", dict(budget=BUDGET, keep_last=True)),
        ("knorm", dict(budget=BUDGET, evict_during_decode=True)),
    ],
)
def test_short_prompt_rows_report_decode_eviction_and_final_entries(name, params):
    model = tiny_model("llama")
    _, res = generate_ids(model, random_ids(PROMPT), None, build_method(name, **params), max_new_tokens=NEW)
    # The last generated token is never fed: PROMPT + NEW - 1 entries went through each layer.
    evicted = PROMPT + NEW - 1 - BUDGET
    assert not res.compressed and res.kv_tokens == PROMPT
    assert res.evicted_during_decode and res.decode_evicted == evicted
    assert res.kv_tokens_end == BUDGET and res.kv_tokens_end_per_layer == [BUDGET] * 3
    # The runner copies every measured GenerationResult field into the row (eval.runner).
    assert set(DECODE_FIELDS) <= set(ROW_FIELDS) and not set(DECODE_FIELDS) & set(runner.NOT_MEASURED)
    row = {k: v for k, v in res.to_dict().items() if k not in runner.NOT_MEASURED}
    assert row["evicted_during_decode"] is True and row["decode_evicted"] == evicted
    assert row["kv_tokens_end"] == BUDGET and row["kv_tokens_end_per_layer"] == [BUDGET] * 3


@pytest.mark.parametrize(
    "name,params",
    [
        ("snapkv", dict(budget=BUDGET, window=8)),
        ("h2o", dict(budget=BUDGET, evict_during_decode=False)),
        ("tova", dict(budget=BUDGET, evict_during_decode=False, keep_last=True)),
        ("knorm", dict(budget=BUDGET)),
        ("chunkkv", dict(budget=BUDGET, window=8, chunk_length=4)),
    ],
)
def test_methods_that_never_evict_while_decoding_say_so(name, params):
    model = tiny_model("llama")
    _, res = generate_ids(model, random_ids(PROMPT), None, build_method(name, **params), max_new_tokens=NEW)
    assert not res.compressed and not res.evicted_during_decode and res.decode_evicted == 0
    assert res.kv_tokens_end == PROMPT + NEW - 1  # new tokens are appended


@pytest.mark.parametrize(
    "name,params",
    [
        ("h2o", dict(budget=BUDGET)),
        ("tova", dict(budget=BUDGET)),
        ("knorm", dict(budget=BUDGET, evict_during_decode=True)),
    ],
)
def test_compressed_prompt_with_decode_eviction_holds_the_budget(name, params):
    model = tiny_model("llama")
    method = build_method(name, **params)
    _, res = generate_ids(model, random_ids(60), None, method, max_new_tokens=NEW)
    assert res.compressed and res.kv_tokens == BUDGET
    assert res.evicted_during_decode and res.decode_evicted == NEW - 1 and res.kv_tokens_end == BUDGET
