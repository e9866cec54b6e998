"""R-KV and SnapKV-D against a naive transcription of the authors' R1KV."""

from __future__ import annotations

import math
from unittest.mock import patch

import pytest
import torch
from conftest import random_ids

from methods._common import tiny_llama
from snapkv import build_method, generate_ids

# Transcribed from Zefan-Cai/R-KV @ d15c9767e67c2bd9807128fecc35223fa2484a69: `rkv/utils.py`
# (`compute_attention_scores`: q.k / sqrt(d), max over the GQA group; `cal_similarity`: cosine of
# normalised keys, diagonal 0, each row's last entry above the threshold set to 0 (index 0 when
# none), mean over rows, softmax) and `rkv/compression/r1_kv.py` (`R1KV.update_kv`: softmax of the
# window rows over the prefix columns, mean over the window, max-pool, lambda * attention -
# (1 - lambda) * similarity, top budget - window of the prefix, then the window). Per batch row
# here (the original: row 0's similarity for every row). SnapKV-D is the same with lambda = 1.


def naive_rkv_importance(q: torch.Tensor, k: torch.Tensor, window: int, kernel: int, scaling: float) -> list:
    """One batch row: q `[heads, >=window, d]`, k `[kv_heads, L, d]` -> [kv_heads][L - window]."""
    heads, kv, n = q.shape[0], k.shape[0], k.shape[1]
    g, prefix = heads // kv, n - window
    out = []
    for h in range(kv):
        mean = [0.0] * prefix
        for i in range(q.shape[1] - window, q.shape[1]):
            logits = [
                max(float(q[h * g + m, i].double() @ k[h, j].double()) * scaling for m in range(g))
                for j in range(prefix)
            ]
            top = max(logits)
            z = sum(math.exp(x - top) for x in logits)
            for j in range(prefix):
                mean[j] += math.exp(logits[j] - top) / z / window
        half = kernel // 2
        out.append(
            [max(mean[t] for t in range(j - half, j + half + 1) if 0 <= t < prefix) for j in range(prefix)]
        )
    return out


def naive_rkv_redundancy(k: torch.Tensor, threshold: float) -> list:
    """One batch row: k `[kv_heads, L, d]` -> [kv_heads][L]."""
    out = []
    for h in range(k.shape[0]):
        keys = [v.double() / (float(v.double().norm()) + 1e-8) for v in k[h]]
        n = len(keys)
        cos = [[0.0 if i == j else float(keys[i] @ keys[j]) for j in range(n)] for i in range(n)]
        for i in range(n):
            near = [j for j in range(n) if cos[i][j] > threshold]
            cos[i][max(near) if near else 0] = 0.0
        col = [sum(cos[i][j] for i in range(n)) / n for j in range(n)]
        top = max(col)
        z = sum(math.exp(c - top) for c in col)
        out.append([math.exp(c - top) / z for c in col])
    return out


def naive_rkv_kept(importance, redundancy, n: int, window: int, budget: int, lam: float) -> list:
    """Kept slots per KV head: top budget - window prefix slots by the final score (ties: earlier
    slot), then the window."""
    kept = []
    for imp, red in zip(importance, redundancy):
        final = [lam * imp[j] - (1 - lam) * red[j] for j in range(n - window)]
        best = sorted(range(n - window), key=lambda j: (-final[j], j))[: budget - window]
        kept.append(sorted(best) + list(range(n - window, n)))
    return kept


def _near_duplicate_keys(batch: int, kv: int, n: int, d: int, seed: int) -> torch.Tensor:
    """Random keys where every third one repeats an earlier one with a little noise (cosine well
    above 0.5), so the threshold rule has rows with and without near-duplicates."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, kv, n, d, generator=g)
    for j in range(3, n, 3):
        k[:, :, j] = k[:, :, j - 3] + 0.1 * torch.randn(batch, kv, d, generator=g)
    return k


class _Module:
    scaling = 0.125


class _Layer:
    softcap = None


@pytest.mark.parametrize("kv,group", [(2, 2), (1, 4)])
@pytest.mark.parametrize("threshold", [0.5, 0.95])
def test_rkv_scores_and_selection_are_the_original_formula(kv, group, threshold):
    from snapkv.methods.rkv import key_redundancy
    from snapkv.methods.snapkv_d import window_importance

    n, d, w, kernel, budget, lam = 30, 16, 4, 5, 14, 0.07
    keys = _near_duplicate_keys(2, kv, n, d, seed=kv + group)
    query = torch.randn(2, kv * group, 6, d, generator=torch.Generator().manual_seed(5))
    method = build_method(
        "rkv", budget=budget, window=w, kernel_size=kernel, mix_lambda=lam, threshold=threshold
    )
    imp = window_importance(query, keys, w, kernel, _Module.scaling)
    red = key_redundancy(keys, threshold, block=7)  # blocks that do not divide L
    scores = method.score(_Layer(), query, keys, _Module())
    kept = method.select(scores, budget)
    for row in range(2):  # each row on its own keys
        want_imp = naive_rkv_importance(query[row], keys[row], w, kernel, _Module.scaling)
        want_red = naive_rkv_redundancy(keys[row], threshold)
        torch.testing.assert_close(
            imp[row].double(), torch.tensor(want_imp, dtype=torch.float64), rtol=1e-5, atol=1e-7
        )
        torch.testing.assert_close(
            red[row].double(), torch.tensor(want_red, dtype=torch.float64), rtol=1e-5, atol=1e-7
        )
        final = (
            lam * torch.tensor(want_imp, dtype=torch.float64)
            - (1 - lam) * torch.tensor(want_red, dtype=torch.float64)[:, :-w]
        )
        torch.testing.assert_close(scores[row, :, :-w].double(), final, rtol=1e-5, atol=1e-7)
        assert kept[row].tolist() == naive_rkv_kept(want_imp, want_red, n, w, budget, lam)
    # The rows differ, so row 0's redundancy (the original's) would be wrong for row 1.
    assert not torch.allclose(red[0], red[1])


def test_rkv_threshold_zeroes_the_most_recent_near_duplicate():
    from snapkv.methods.rkv import key_redundancy

    # Keys 0 and 2 are the same direction, 1 is orthogonal: row 2's most recent near-duplicate is 0,
    # row 0's is 2; row 1 has none, so its column 0 is zeroed (0 there anyway).
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])[None, None]
    col = torch.tensor([0.0, 0.0, 0.0])  # every off-diagonal similarity above 0.5 is zeroed
    torch.testing.assert_close(key_redundancy(k, 0.5)[0, 0], col.softmax(-1))
    # Threshold 1: nothing is a near-duplicate; each row zeroes its column 0 instead.
    col = torch.tensor([0.0, 0.0, 1.0]) / 3  # only C[0, 2] = 1 survives (row 0 zeroes column 0)
    torch.testing.assert_close(key_redundancy(k, 1.0)[0, 0], col.softmax(-1))


def _scheduled_steps(model, ids, method, new_tokens: int):
    """The method's own generation, recording layer 0's window queries, keys, target and kept
    positions around every compression (prefill and scheduled steps)."""
    steps = []
    prefill, scheduled = type(method).compress_prefill, type(method).compress_decode

    def record(layer, query, key, module, target, run):
        before = dict(query=query.clone(), keys=key.clone(), positions=layer.positions.clone(), target=target)
        done = run()
        if layer.index == 0 and layer.positions.shape[-1] != before["positions"].shape[-1]:
            steps.append({**before, "scaling": module.scaling, "kept": layer.positions.clone()})
        return done

    def spy_prefill(self, layer, query, key, module):
        return record(
            layer,
            query,
            key,
            module,
            self.layer_budget(layer),
            lambda: prefill(self, layer, query, key, module),
        )

    def spy_decode(self, layer, query, module):
        return record(
            layer,
            query,
            layer.keys,
            module,
            self.decode_target(layer),
            lambda: scheduled(self, layer, query, module),
        )

    # patch.object puts the spies on the class and, on exit, removes them again (the templates are
    # the base class's: restoring them as the class's own attributes would read as overrides).
    cls = type(method)
    with patch.object(cls, "compress_prefill", spy_prefill), patch.object(cls, "compress_decode", spy_decode):
        generate_ids(model, ids, None, method, max_new_tokens=new_tokens)
    return steps


@pytest.mark.parametrize("name", ["rkv", "snapkv_d"])
def test_rkv_and_snapkv_d_compress_the_prompt_then_every_interval_as_the_original(name):
    model = tiny_llama(2)  # GQA groups of 2
    w, budget, interval = 4, 24, 5
    params = dict(budget=budget, window=w, decode_schedule=dict(interval=interval))
    if name == "rkv":
        params["threshold"] = 0.2  # random keys: a few near-duplicates
    method = build_method(name, **params)
    lam = method.mix_lambda if name == "rkv" else 1.0
    steps = _scheduled_steps(model, random_ids(40, seed=3), method, new_tokens=16)
    # The prompt (40 > 24), then forwards 5, 10, 15 (24 + 5 > 24 each time).
    assert [s["keys"].shape[2] for s in steps] == [
        40,
        budget + interval,
        budget + interval,
        budget + interval,
    ]
    for n, step in enumerate(steps):
        keys, query = step["keys"][0], step["query"][0]
        imp = naive_rkv_importance(query, keys, w, 7, step["scaling"])
        red = naive_rkv_redundancy(keys, 0.2) if name == "rkv" else [[0.0] * keys.shape[1]] * keys.shape[0]
        kept = naive_rkv_kept(imp, red, keys.shape[1], w, budget, lam)
        want = torch.stack([step["positions"][0, h, slots] for h, slots in enumerate(kept)])
        assert torch.equal(step["kept"][0], want), f"compression {n}"


# The original's generation, replayed per layer from the forwards' own queries and new keys:
# `rkv/modeling.py` (`LlamaAttention_forward`: the query cache of the latest `window_size` queries,
# the prompt's last ones first; `compression` None on the first forward, whose keys are compressed
# alone; True: the forward's keys appended, then the whole cache compressed; the flag for the next
# forward set after each by `length % divide_length == 0`, `length` counting every token fed, prompt
# included) around `R1KV.update_kv` / `SnapKV.update_kv` (nothing while `kv_cache_len < budget`;
# else the top `budget - window` prefix slots by score, gathered in top-k order, then the last
# `window` slots). Top-k ties: the earlier slot, as the method breaks them (torch leaves them open).
def rkv_replay(forwards: list[dict], budget, window, kernel, interval, lam, threshold) -> list[torch.Tensor]:
    """One layer of a one-row batch: the stored positions `[1, kv_heads, stored]` after each forward,
    in slot order. `threshold` None: SnapKV-D (no redundancy term, lambda 1)."""
    keys = positions = queries = None
    flag, length, out = None, 0, []

    def update_kv(keys, positions):
        n = keys.shape[2]
        if n < budget:
            return keys, positions
        k, q = keys[0], queries[0]
        imp = naive_rkv_importance(q, k, window, kernel, 1 / math.sqrt(k.shape[-1]))
        red = naive_rkv_redundancy(k, threshold) if threshold is not None else [[0.0] * n] * k.shape[0]
        slots = []
        for h in range(k.shape[0]):
            final = [lam * imp[h][j] - (1 - lam) * red[h][j] for j in range(n - window)]
            top = sorted(range(n - window), key=lambda j: (-final[j], j))[: budget - window]
            slots.append(top + list(range(n - window, n)))
        idx = torch.tensor(slots)[None]
        return keys.gather(2, idx[..., None].expand(-1, -1, -1, keys.shape[-1])), positions.gather(2, idx)

    for step in forwards:
        query, new = step["query"], step["keys"]
        q = new.shape[2]
        new_pos = torch.arange(length, length + q).expand(*new.shape[:2], q)
        queries = query[:, :, -window:] if queries is None else torch.cat([queries, query], 2)[:, :, -window:]
        if flag is None:
            keys, positions = update_kv(new, new_pos)
        else:
            keys, positions = torch.cat([keys, new], dim=2), torch.cat([positions, new_pos], dim=2)
            if flag:
                keys, positions = update_kv(keys, positions)
        length += q
        flag = length % interval == 0
        out.append(positions.clone())
    return out


ORIGINAL = dict(kept_order="topk")  # with decode_schedule.count_from=start


@pytest.mark.parametrize("arch", ["mha", "gqa"])
@pytest.mark.parametrize("name", ["rkv", "snapkv_d"])
@pytest.mark.parametrize("prompt,budget", [(43, 24), (19, 21), (24, 24)])
def test_rkv_and_snapkv_d_switches_keep_what_the_original_keeps(arch, name, prompt, budget):
    """`kept_order=topk` + `count_from=start`: slot for slot what the authors' generation stores,
    every layer and forward. Prompt 43: the original compresses at the forwards that bring the
    length to 46, 51 and 56 (the default: 48, 53, 58); prompt 19 < budget 21: at length 21 the cache
    holds exactly `budget` entries, which the original reorders without dropping any; prompt 24 =
    budget 24: the same at the prefill."""
    from methods._common import MODELS, record_forwards

    w, interval = 4, 5
    params = dict(budget=budget, window=w, kept_order="topk")
    params["decode_schedule"] = dict(interval=interval, count_from="start")
    if name == "rkv":
        params["threshold"] = 0.2  # random keys: a few near-duplicates
    model = MODELS[arch]()
    threshold = 0.2 if name == "rkv" else None
    lam = 0.07 if name == "rkv" else 1.0
    ids = random_ids(prompt, seed=3)
    forwards = record_forwards(model, ids, build_method(name, **params), new_tokens=16)
    for layer, steps in forwards.items():
        want = rkv_replay(steps, budget, w, 7, interval, lam, threshold)
        for t, (step, kept) in enumerate(zip(steps, want)):
            assert torch.equal(step["positions"], kept), f"layer {layer}, forward {t}"
    # The defaults (position order, interval from the end of prefill) store something else.
    default = {**params, "kept_order": "position", "decode_schedule": dict(interval=interval)}
    steps = record_forwards(model, ids, build_method(name, **default), new_tokens=16)[0]
    want = rkv_replay(steps, budget, w, 7, interval, lam, threshold)
    assert any(not torch.equal(s["positions"], k) for s, k in zip(steps, want))
