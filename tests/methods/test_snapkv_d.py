"""The decode-time SnapKV of arXiv 2512.12008's authors against a replay of their code.

Transcribed from minghui-liu/kvpress @ 43d9e37 (main): `kvpress/presses/base_press.py`
(`BasePress.forward_hook`: after every attention forward inside `press(model)`, `compress_prefilling`
on the first forward, `compress_decoding` on every later one, the cache replaced by what they
return), `kvpress/presses/scorer_press.py` (`ScorerPress`: nothing while the stored length is
<= `cache_budget`, else `scores.topk(cache_budget)` over every slot, the keys gathered in that
order) and `kvpress/presses/snapkv_press.py` (`SnapKVPress.score` with the eager attention weights
`[batch, heads, q, stored]` of the forward: rows `[-window:]`, columns `[:-window]`, mean over the
rows, `avg_pool1d(kernel, padding=kernel // 2)` per query head, mean over the GQA group, the last
`window` slots padded with `scores.max()`). No decoding press wraps it: `reason/evaluate.py` runs
`model.generate` inside `press(model)` with eager attention, so a decode step's rows are the current
token's alone. torch's top-k leaves the order of ties open; the replay breaks them towards the
earlier slot, as the method does.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import random_ids

from methods._common import MODELS, record_forwards
from snapkv import build_method


def eager_weights(query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The eager attention weights `[batch, heads, q, stored]` (fp64) of `query` over `keys` (the
    keys repeated over each GQA group, 1/sqrt(d), causal for the last q slots, fp32 softmax)."""
    b, h, q, d = query.shape
    k = keys.double().repeat_interleave(h // keys.shape[1], dim=1)
    logits = query.double() @ k.transpose(2, 3) / math.sqrt(d)
    n = k.shape[2]
    mask = torch.full((q, n), -math.inf, dtype=torch.float64).triu(n - q + 1)
    return (logits + mask).softmax(dim=-1)


def snapkv_press_score(attentions: torch.Tensor, kv_heads: int, window: int, kernel: int) -> torch.Tensor:
    """`SnapKVPress.score` from the forward's attention weights: `[batch, kv_heads, stored]`."""
    b, h, _, n = attentions.shape
    scores = attentions[..., -window:, :-window].mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = scores.view(b, kv_heads, h // kv_heads, n - window).mean(2)
    return F.pad(scores, (0, window), value=scores.max().item())


def kvpress_fork_replay(forwards: list[dict], budget: int, window: int, kernel: int) -> list[torch.Tensor]:
    """One layer's cache under the fork's SnapKV-D, forward after forward (the forward's queries
    and new keys as the model computed them): the stored positions after each, in slot order."""
    keys = positions = None
    out, seen = [], 0
    for step in forwards:
        query, new = step["query"], step["keys"]
        b, kv, q, _ = new.shape
        new_pos = torch.arange(seen, seen + q).expand(b, kv, q)
        keys = new if keys is None else torch.cat([keys, new], dim=2)
        positions = new_pos if positions is None else torch.cat([positions, new_pos], dim=2)
        seen += q
        # compress_prefilling / compress_decoding: nothing while the cache fits the budget
        if keys.shape[2] > budget:
            scores = snapkv_press_score(eager_weights(query, keys), kv, window, kernel)
            order = scores.sort(dim=-1, descending=True, stable=True).indices[..., :budget]
            keys = keys.gather(2, order[..., None].expand(-1, -1, -1, keys.shape[-1]))
            positions = positions.gather(2, order)
        out.append(positions.clone())
    return out


FORK = dict(kernel_size=5, pooling="avg", gqa_order="pool_first", kept_order="topk")


@pytest.mark.parametrize("arch", ["mha", "gqa"])
def test_snapkv_fork_preset_keeps_what_the_authors_press_keeps(arch):
    """Votes with the prompt's last `window` queries, then with the current token alone; protects
    the last `window` slots; stores top-k order. Slot for slot, every layer and forward."""
    model = MODELS[arch]()
    window, budget, kernel = 8, 24, 5
    method = build_method(
        "snapkv", budget=budget, window=window, decode_schedule=dict(interval=1, window=1), **FORK
    )
    ids = torch.cat([random_ids(40, seed=3), random_ids(40, seed=4)])  # the pad value spans the batch
    got = record_forwards(model, ids, method, new_tokens=12)
    for layer, forwards in got.items():
        assert len(forwards) == 12  # the prompt, then 11 decode steps, each compressing
        want = kvpress_fork_replay(forwards, budget, window, kernel)
        for t, (step, kept) in enumerate(zip(forwards, want)):
            assert torch.equal(step["positions"], kept), f"layer {layer}, forward {t}"
    # The prompt's last positions are all kept, then later compressions protect slots, not positions.
    first = got[0][0]["positions"]
    assert all(set(range(40 - window, 40)) <= set(h.tolist()) for row in first for h in row)


@pytest.mark.parametrize("arch", ["mha", "gqa"])
def test_snapkv_fork_replay_tells_position_order_and_window_votes_apart(arch):
    """The replay is not met by position order, nor by a window of 1 (the current token votes at
    the prefill too, and one entry is protected): `snapkv` or `snapkv_d` with `window=1`."""
    model = MODELS[arch]()
    ids = random_ids(40, seed=3)
    for name, params in (
        (
            "snapkv",
            dict(window=8, decode_schedule=dict(interval=1, window=1), **{**FORK, "kept_order": "position"}),
        ),
        ("snapkv", dict(window=1, decode_schedule=dict(interval=1), **FORK)),
        ("snapkv_d", dict(window=1, kernel_size=5, decode_schedule=dict(interval=1))),
    ):
        method = build_method(name, budget=24, **params)
        forwards = record_forwards(model, ids, method, new_tokens=12)[0]
        want = kvpress_fork_replay(forwards, 24, 8, 5)
        # Already at the prompt's compression: other votes, other protected slots, or another order.
        assert not torch.equal(forwards[0]["positions"], want[0]), (name, params)
