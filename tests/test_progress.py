"""`generate`'s progress callback: the events and their order, and that a slow callback changes no
timing (it never runs inside a timed region). Tiny random models, CPU, milliseconds per forward."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import random_ids, tiny_model

from snapkv import GenerationConfig, answer, build_method, compress_context, generate_ids


class Recorder:
    """A progress callback that records (stage, done, total) and optionally sleeps in some stages."""

    def __init__(self, sleep: float = 0.0, sleep_when=lambda stage, done, total: False):
        self.events: list[tuple[str, int, int]] = []
        self.sleep, self.sleep_when = sleep, sleep_when

    def __call__(self, stage: str, done: int, total: int) -> None:
        self.events.append((stage, done, total))
        if self.sleep_when(stage, done, total):
            time.sleep(self.sleep)


@pytest.mark.parametrize(
    ("chunk_size", "query_aware", "prefill_done"),
    [
        (None, True, [0]),  # one forward of the whole prompt
        (24, True, [0, 24, 48]),  # 60 tokens in chunks of 24 (last chunk >= the window: 48..60)
        (None, False, [0, 50]),  # context alone, then the question on the compressed cache
    ],
)
def test_events_come_in_order_with_their_totals(chunk_size, query_aware, prefill_done):
    model = tiny_model()
    ids = random_ids(60)
    rec = Recorder()
    method = build_method("snapkv", budget=32, window=8, kernel_size=3)
    _, res = generate_ids(
        model, ids[:, :50], ids[:, 50:], method, query_aware=query_aware, max_new_tokens=7,
        stop_ids=set(), chunk_size=chunk_size, on_progress=rec,
    )  # fmt: skip
    assert res.input_tokens == 60 and res.new_tokens == 7
    starts = [(s, d, t) for s, d, t in rec.events if s == "prefill" and d < t]
    assert starts == [("prefill", d, 60) for d in prefill_done]
    # Each prompt forward announced, then the prompt done, then one event per generated token.
    assert rec.events == starts + [("prefill", 60, 60)] + [("decode", k, 7) for k in range(1, 8)]


def test_decode_events_stop_at_a_stop_token():
    model = tiny_model()
    ids = random_ids(40)
    _, first = generate_ids(model, ids, None, build_method("full"), max_new_tokens=6, stop_ids=set())
    stop = first.output_ids[2]  # the third generated token ends the next run
    rec = Recorder()
    _, res = generate_ids(
        model, ids, None, build_method("full"), max_new_tokens=6, stop_ids={stop}, on_progress=rec
    )
    decode = [e for e in rec.events if e[0] == "decode"]
    n = first.output_ids.index(stop) + 1
    assert res.new_tokens == n and decode == [("decode", k, 6) for k in range(1, n + 1)]


def test_a_slow_callback_changes_no_timing():
    """Every event sleeps 0.4 s: prefill_s, ttft_s and tpot_s must not contain it (between chunks the
    clock is paused). The tiny model's forwards take milliseconds; without the pause prefill_s would
    be >= 0.8 s (two between-chunk events), ttft_s >= 1.2 s (plus the question event)."""
    model = tiny_model()
    ids = random_ids(72)
    sleep = 0.4
    rec = Recorder(sleep=sleep, sleep_when=lambda stage, done, total: True)
    method = build_method("snapkv", budget=32, window=8, kernel_size=3)
    t = time.perf_counter()
    _, res = generate_ids(
        model, ids[:, :64], ids[:, 64:], method, query_aware=False, max_new_tokens=3, stop_ids=set(),
        chunk_size=24, on_progress=rec,
    )  # fmt: skip
    wall = time.perf_counter() - t
    between = [e for e in rec.events if e[0] == "prefill" and 0 < e[1] < e[2]]
    assert len(between) == 3  # chunks at 24 and 48 (64 tokens: 0-24, 24-48, 48-64), then the question
    assert wall >= sleep * len(rec.events)
    assert res.prefill_s < sleep and res.ttft_s < sleep and res.tpot_s < sleep


def test_no_callback_no_change():
    """Without a callback the result is the same (ids, kept cache) as with one."""
    model = tiny_model()
    ids = random_ids(60)
    method = build_method("snapkv", budget=32, window=8, kernel_size=3)
    a, ra = generate_ids(model, ids, None, method, max_new_tokens=5, stop_ids=set(), chunk_size=24)
    b, rb = generate_ids(
        model, ids, None, method, max_new_tokens=5, stop_ids=set(), chunk_size=24, on_progress=Recorder()
    )
    assert a.tolist() == b.tolist() and ra.kv_tokens_per_layer == rb.kv_tokens_per_layer


def test_one_generation_config_object_or_its_fields_as_keywords():
    """`config=GenerationConfig(...)` and the same fields as keywords generate the same tokens; a
    keyword overrides the config's field; an unknown option, a bad value or a text-only option on an
    id entry point is refused naming it."""
    model = tiny_model()
    ids = random_ids(40)
    method = build_method("snapkv", budget=16, window=4, kernel_size=3)
    cfg = GenerationConfig(max_new_tokens=5, stop_ids=set(), query_aware=False)
    a, ra = generate_ids(model, ids[:, :32], ids[:, 32:], method, config=cfg)
    b, rb = generate_ids(
        model, ids[:, :32], ids[:, 32:], method, max_new_tokens=5, stop_ids=set(), query_aware=False
    )
    assert a.shape == (1, 5) and torch.equal(a, b) and ra.input_tokens == rb.input_tokens == 40
    c, _ = generate_ids(model, ids[:, :32], ids[:, 32:], method, config=cfg, max_new_tokens=3)
    assert torch.equal(c, a[:, :3]) and cfg.max_new_tokens == 5  # the config itself is left as it was
    with pytest.raises(TypeError, match="no_such_option"):
        generate_ids(model, ids, None, method, no_such_option=1)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got max_new_tokens=0"):
        generate_ids(model, ids, None, method, config=cfg, max_new_tokens=0)
    with pytest.raises(ValueError, match="chat_template and ignore_eos apply to text prompts"):
        generate_ids(model, ids, None, method, ignore_eos=True)
    with pytest.raises(ValueError, match="config must be a GenerationConfig, got dict"):
        generate_ids(model, ids, None, method, config={"max_new_tokens": 3})


def test_answer_takes_the_generation_config_and_refuses_what_does_not_apply():
    model = tiny_model()
    ids = random_ids(40)
    method = build_method("snapkv", budget=16, window=4, kernel_size=3)
    cache = compress_context(model, ids[:, :32], method)
    a = answer(model, cache, ids[:, 32:], method, config=GenerationConfig(max_new_tokens=4, stop_ids=set()))
    b = answer(model, cache, ids[:, 32:], method, max_new_tokens=4, stop_ids=set())
    assert a.ids.shape == (1, 4) and torch.equal(a.ids, b.ids)
    with pytest.raises(ValueError, match="answer.*chunk_size, on_progress do not apply"):
        answer(model, cache, ids[:, 32:], method, chunk_size=8, on_progress=print)
