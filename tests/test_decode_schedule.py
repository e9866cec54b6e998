"""Decode schedules (`Method.decode_schedule`): any scoring method compresses again while generating.

Exactness against the masked full cache runs for every scheduled entry of tests/method_catalogue.py
(`test_core.test_compressed_decoding_equals_masked_full_cache`); here: when the compressions happen,
what they keep (an independent SnapKV transcription on the recorded window queries), the window
queries themselves, the result-row fields, rollback, validation and the configs.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conftest import random_ids, tiny_model
from hydra import compose, initialize_config_dir
from method_catalogue import SCHEDULED, ids
from omegaconf import OmegaConf

import snapkv.hooks as hooks
from eval.store import ROW_FIELDS
from snapkv import answer, build_method, compress_context, generate_ids

PROMPT, BUDGET, NEW = 60, 40, 14
STATS = ("decode_compressions", "kv_entries_peak", "kv_entries_mean")


def _run(method, prompt: int = PROMPT, new: int = NEW, **kw):
    return generate_ids(tiny_model("llama"), random_ids(prompt), None, method, max_new_tokens=new, **kw)


def test_schedule_off_leaves_params_unchanged():
    plain = build_method("snapkv", budget=64, window=8).params()
    assert "decode_schedule" not in plain
    for off in (None, {}, dict(interval=None), dict(interval=0, buffer=0, target=None, window=None)):
        assert build_method("snapkv", budget=64, window=8, decode_schedule=off).params() == plain
    on = build_method("snapkv", budget=64, window=8, decode_schedule=dict(interval=64)).params()
    assert on["decode_schedule"] == dict(interval=64, buffer=0, target=None, window=None)


def test_compressions_every_interval_down_to_the_target():
    method = build_method("snapkv", budget=BUDGET, window=8, decode_schedule=dict(interval=4, target=30))
    _, res = _run(method)
    # 13 forwards after the prefill (the last token is never fed); every 4th compresses to 30 after
    # attending: 41 42 43 44 | 31 32 33 34 | 31 32 33 34 | 31.
    seen = [41, 42, 43, 44] + [31, 32, 33, 34] * 2 + [31]
    assert res.decode_compressions == 3 and res.evicted_during_decode
    assert res.kv_entries_peak == 44 and res.kv_entries_mean == pytest.approx(sum(seen) / len(seen))
    assert res.kv_tokens_end == 31 and res.decode_evicted == 14 + 4 + 4


def test_buffer_compresses_only_past_target_plus_buffer():
    method = build_method(
        "snapkv", budget=BUDGET, window=8, decode_schedule=dict(interval=1, buffer=3, target=36)
    )
    _, res = _run(method)
    # 41 > 39: back to 36, then 37 38 39 40 > 39: back to 36, ... (forwards 1, 5, 9, 13)
    assert res.decode_compressions == 4 and res.kv_entries_peak == 41 and res.kv_tokens_end == 36


def test_ratio_target_and_default_target_is_the_budget():
    ratio = build_method("knorm", budget=BUDGET, decode_schedule=dict(interval=13, target=0.5))
    _, res = _run(ratio)
    assert res.decode_compressions == 1 and res.kv_tokens_end == int(0.5 * (PROMPT + NEW - 1))
    default = build_method("knorm", budget=BUDGET, decode_schedule=dict(interval=5))
    _, res = _run(default)
    assert res.decode_compressions == 2 and res.kv_tokens_end == BUDGET + 3


def test_a_short_prompt_is_compressed_once_the_cache_outgrows_the_target():
    method = build_method("snapkv", budget=BUDGET, window=8, decode_schedule=dict(interval=2))
    _, res = _run(method, prompt=30, new=20)
    # 19 forwards; scheduled at forwards 2, 4, ..., 18; the first over 40 is forward 12 (42 entries),
    # then 14, 16 and 18; forward 19 appends one.
    assert not res.compressed and res.decode_compressions == 4
    assert res.kv_entries_peak == BUDGET + 2 and res.kv_tokens_end == BUDGET + 1


def test_no_schedule_reports_no_compressions_and_the_growing_cache():
    _, res = _run(build_method("snapkv", budget=BUDGET, window=8))
    assert res.decode_compressions == 0 and not res.evicted_during_decode
    assert res.kv_entries_peak == BUDGET + NEW - 1 and res.kv_entries_mean == BUDGET + NEW / 2
    row = res.measurements()
    assert set(STATS) <= set(ROW_FIELDS) and row["decode_compressions"] == 0


def _record_steps(model, run):
    """Run `run()`, recording for layer 0 every forward's queries, and at each scheduled step the
    window queries, stored keys, positions and target before it and the positions after it."""
    queries, steps = [], []
    original = hooks.Session.scheduled_step
    after = hooks.Session.after_attention

    def spy_after(self, module, layer, query, key):
        if module.layer_idx == 0:
            queries.append(query.clone())
        return after(self, module, layer, query, key)

    def spy_step(self, module, layer, fed):
        due = layer.since_schedule + fed >= self.method.decode_schedule.interval
        if module.layer_idx != 0 or not due:
            return original(self, module, layer, fed)
        before = dict(
            queries=layer.window_queries.clone(),
            keys=layer.keys.clone(),
            positions=layer.positions.clone(),
            target=self.method.decode_target(layer),
            scaling=module.scaling,
        )
        original(self, module, layer, fed)
        steps.append({**before, "kept": layer.positions.clone()})

    hooks.Session.after_attention, hooks.Session.scheduled_step = spy_after, spy_step
    try:
        out = run()
    finally:
        hooks.Session.after_attention, hooks.Session.scheduled_step = after, original
    return out, queries, steps


def naive_snapkv_keep(queries, keys, window, kernel, budget, scaling) -> list[list[int]]:
    """Kept slots per KV head: each of the last `window` queries' softmax over every stored key
    (causal inside the window block), summed, mean over the GQA group, max-pooled over the prefix;
    top budget - window prefix slots (ties: earlier slot) plus the window. Python loops."""
    _, h, _, _ = queries.shape
    kv, n = keys.shape[1], keys.shape[2]
    g, prefix = h // kv, n - window
    out = []
    for head in range(kv):
        votes = [0.0] * prefix
        for qh in range(head * g, head * g + g):
            for i in range(window):
                q = queries[0, qh, queries.shape[2] - window + i].double()
                visible = prefix + i + 1
                logits = [float(q @ keys[0, head, j].double()) * scaling for j in range(visible)]
                top = max(logits)
                z = sum(math.exp(x - top) for x in logits)
                for j in range(prefix):
                    votes[j] += math.exp(logits[j] - top) / z / g
        pooled = [
            max(votes[i] for i in range(j - kernel // 2, j + kernel // 2 + 1) if 0 <= i < prefix)
            for j in range(prefix)
        ]
        best = sorted(range(prefix), key=lambda j: (-pooled[j], j))[: budget - window]
        out.append(sorted(best) + list(range(prefix, n)))
    return out


def test_scheduled_step_keeps_what_snapkv_scores_with_the_latest_queries():
    model = tiny_model("qwen2")  # GQA: 2 query heads per KV head
    method = build_method(
        "snapkv",
        budget=BUDGET,
        window=8,
        kernel_size=5,
        decode_schedule=dict(interval=3, target=32, window=8),
    )
    (_, res), queries, steps = _record_steps(
        model, lambda: generate_ids(model, random_ids(PROMPT), None, method, max_new_tokens=NEW)
    )
    assert len(steps) == res.decode_compressions == 4
    every = torch.cat(queries, dim=2)  # [1, heads, prompt + fed, d]: each forward's own queries
    for n, step in enumerate(steps):
        fed = PROMPT + 3 * (n + 1)
        torch.testing.assert_close(step["queries"], every[:, :, fed - 8 : fed], rtol=0, atol=0)
        keep = naive_snapkv_keep(step["queries"], step["keys"], 8, 5, step["target"], step["scaling"])
        want = torch.stack([step["positions"][0, h, slots] for h, slots in enumerate(keep)])
        assert torch.equal(step["kept"][0], want), f"step {n}"


def test_rollback_restores_the_schedule_state():
    model = tiny_model("llama")
    method = build_method("snapkv", budget=BUDGET, window=8, decode_schedule=dict(interval=2, target=34))
    cache = compress_context(model, random_ids(PROMPT), method)
    question = random_ids(6, seed=3)
    first = answer(model, cache, question, method, max_new_tokens=10, keep_logits=True)
    second = answer(model, cache, question, method, max_new_tokens=10, keep_logits=True)
    assert torch.equal(first.ids, second.ids)
    for a, b in zip(first.logits, second.logits):
        assert torch.equal(a, b)
    for _, layer in cache.compressible_layers():
        assert layer.stored == BUDGET and layer.decode_compressions == [] and layer.decode_entries == []


def test_schedule_from_the_command_line():
    with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "method=snapkv",
                "method.decode_schedule.interval=64",
                "method.decode_schedule.target=0.25",
            ],
        )
    method = build_method(**OmegaConf.to_container(cfg.method, resolve=True))
    assert method.decode_schedule.interval == 64 and method.decode_schedule.target == 0.25
    assert method.params()["decode_schedule"]["interval"] == 64


@pytest.mark.parametrize("name,params", SCHEDULED, ids=ids(SCHEDULED))
def test_every_scheduled_catalogue_entry_compresses_while_decoding(name, params):
    _, res = generate_ids(
        tiny_model("llama"), random_ids(96), None, build_method(name, **params), max_new_tokens=8
    )
    assert res.compressed and res.decode_compressions >= 1 and res.evicted_during_decode


def test_window_queries_do_not_keep_the_prompt_queries_alive():
    model = tiny_model("llama")
    method = build_method("snapkv", budget=BUDGET, window=8, decode_schedule=dict(interval=4))
    cache = compress_context(model, random_ids(PROMPT), method)
    for _, layer in cache.compressible_layers():
        q = layer.window_queries
        assert q.shape[2] == 8
        assert q.untyped_storage().nbytes() == q.numel() * q.element_size()  # its own storage
