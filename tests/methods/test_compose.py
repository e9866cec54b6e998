"""Budget policies and selections around a scorer other than SnapKV (`snapkv.methods.compose`),
each against a transcription of kvpress' composition of the same two presses, or an independent
computation of the wrapper's rule over the scorer's scores.

Transcribed (definitions re-written with loops; no code copied) from NVIDIA/kvpress @
8bb29b9c3078452a86d692f29123fa6c793e2b05, `kvpress/presses/`: `KnormPress.score` (-||k||),
`TOVAPress.score` (the last query's attention over the other keys, averaged over all heads, the last
entry padded with max + 1), `AdaKVPress.compress` (each head's top `int(n_kept x alpha)` safeguarded,
then the `heads x (L - n_kept)` lowest of all heads pruned), `CriticalKVPress.score` (the two stages:
tests/methods/test_criticalkv.py) and `ChunkKVPress.compress` (chunk sums over the heads:
tests/methods/test_chunkkv.py). Every top-k breaks ties towards the earlier index (`top_indices`)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from reference import eager_attentions

from eval.conf import CONF_DIR
from methods._common import FMAX, MODELS, distinct_ids, kept_by_method, layer_inputs, top_indices, topk_rows
from methods.test_chunkkv import naive_chunkkv_kept
from methods.test_criticalkv import naive_criticalkv_keep, naive_vwl1norm
from snapkv import build_method
from snapkv.methods.compose import scorers
from snapkv.methods.pyramidkv import pyramid_budgets

WRAPPERS = ("pyramidkv", "adakv", "criticalkv", "chunkkv")


def knorm_scores(keys: torch.Tensor) -> torch.Tensor:
    """`KnormPress.score` of one row: keys `[1, kv_heads, L, d]` -> `[kv_heads, L]`."""
    return torch.stack([-torch.norm(keys[0, h].float(), p=2, dim=-1) for h in range(keys.shape[1])])


def tova_scores(attn: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`TOVAPress.score` of one row from its eager attention `[1, heads, L, L]`: the last query's
    weights over the other keys, mean over all heads, the last entry at max + 1 -> `[kv_heads, L]`."""
    last = attn[0, :, -1, :-1].float().mean(dim=0)
    row = torch.cat([last, (last.max() + 1)[None]])
    return row.expand(kv_heads, -1).clone()


def naive_adakv_press(scores: torch.Tensor, n_kept: int, alpha: float) -> list[list[int]]:
    """`AdaKVPress.compress` of one row's scores `[heads, L]`: kept positions per head."""
    heads, length = scores.shape
    s = scores.clone()
    for h in range(heads):
        s[h, top_indices(s[h], int(n_kept * alpha))] = FMAX
    pruned = set(top_indices(-s.reshape(-1), heads * (length - n_kept)).tolist())
    return [[j for j in range(length) if h * length + j not in pruned] for h in range(heads)]


@pytest.mark.parametrize("kind", ["mha", "gqa"])
@pytest.mark.parametrize("alpha", [0.2, 0.5])
def test_adakv_over_knorm_is_adakvpress_over_knormpress(kind, alpha):
    model = MODELS[kind]()
    method = build_method("adakv", budget=24, scorer="knorm", allocation="kvpress", alpha=alpha)
    row = distinct_ids(64, seed=1)[0]  # distinct tokens: no tied key norms at layer 0
    got = kept_by_method(model, method, [row])
    for idx, (_, _, keys, _) in enumerate(layer_inputs(model, row[None])):
        want = naive_adakv_press(knorm_scores(keys), 24, alpha)
        assert got[idx][0] == want, f"layer {idx}"
        assert len({len(h) for h in want}) > 1 or kind == "gqa", "the heads' budgets should differ"


@pytest.mark.parametrize("length", [23, 24, 64])
def test_pyramidkv_over_tova_keeps_each_layers_top_by_the_last_querys_head_mean(length):
    """PyramidKV's layer budgets (the pyramid counting TOVA's one protected entry, kvpress' last
    token) filled by TOVA's scores: the same positions in every head."""
    model = tiny_model("llama", layers=4)
    budget, beta = 24, 4
    method = build_method(
        "pyramidkv", budget=budget, beta=beta, scorer="tova", scorer_params={"keep_last": True}
    )
    row = random_ids(length)[0]
    got = kept_by_method(model, method, [row])
    attns = eager_attentions(model, row[None])
    kv = model.config.num_key_value_heads
    sizes = pyramid_budgets(budget, 1, 4, beta, length) if length > budget else (length,) * 4
    for idx in got:
        want = topk_rows(tova_scores(attns[idx], kv), sizes[idx])
        assert got[idx][0] == want, f"L={length}, layer {idx}"
    if length == 64:
        assert len({len(got[i][0][0]) for i in got}) == 4  # a real pyramid: four different budgets


@pytest.mark.parametrize("kind", ["mha", "gqa"])
@pytest.mark.parametrize("ratio", [0.5, 0.25])
def test_criticalkv_over_tova_is_criticalkvpress_over_tovapress(kind, ratio):
    model = MODELS[kind]()
    params = dict(budget=24, first_stage_ratio=ratio, epsilon=1e-2)
    method = build_method("criticalkv", **params, scorer="tova", scorer_params={"keep_last": True})
    heads = model.config.num_attention_heads
    for length in (24, 25, 64):
        row = random_ids(length, seed=length)[0]
        got = kept_by_method(model, method, [row])
        attns = eager_attentions(model, row[None])
        for idx, (module, _, _, values) in enumerate(layer_inputs(model, row[None])):
            if length <= 24:
                assert got[idx][0] == [list(range(length))] * values.shape[1]
                continue
            scores = tova_scores(attns[idx], values.shape[1])
            want = naive_criticalkv_keep(scores, naive_vwl1norm(module, values, heads), 24, ratio, 1e-2)
            assert got[idx][0] == want, f"L={length}, layer {idx}"


@pytest.mark.parametrize("how", ["sum", "mean"])
def test_chunkkv_over_knorm_is_chunkkvpress_over_knormpress(how):
    """K-norm protects nothing: the whole prompt is chunked from position 0, as ChunkKVPress does."""
    model = MODELS["gqa"]()
    method = build_method("chunkkv", budget=24, chunk_length=5, chunk_score=how, scorer="knorm")
    for length in (24, 63):
        row = distinct_ids(length, seed=2)[0]
        got = kept_by_method(model, method, [row])
        for idx, (_, _, keys, _) in enumerate(layer_inputs(model, row[None])):
            kept = naive_chunkkv_kept(knorm_scores(keys).tolist(), length, 0, 24, 5, how)
            assert got[idx][0] == [kept] * keys.shape[1], f"L={length}, layer {idx}"


def test_adakv_over_expected_attention_is_adakv_expected_attention():
    """`adakv_expected_attention` (kvpress' AdaKVPress(ExpectedAttentionPress)) is this composition
    under its own flat parameters: the same kept positions per head, sinks included."""
    model = MODELS["gqa"]()
    composed = build_method(
        "adakv", budget=24, scorer="expected_attention", allocation="kvpress", scorer_params={"epsilon": 1e-2}
    )
    flat = build_method("adakv_expected_attention", budget=24)
    rows = [random_ids(64, seed=s)[0] for s in (1, 2)]
    assert kept_by_method(model, composed, rows) == kept_by_method(model, flat, rows)


@pytest.mark.parametrize("name", WRAPPERS)
def test_the_default_scorer_is_left_out_of_params_and_another_is_named(name):
    """`scorer` / `scorer_params` at their defaults are not in `params()` (every SnapKV-scored config
    keeps its hash); another scorer, and its parameters, are."""
    default = build_method(name, budget=64)
    assert "scorer" not in default.params() and "scorer_params" not in default.params()
    assert build_method(name, budget=64, scorer="snapkv").params() == default.params()
    other = build_method(name, budget=64, scorer="tova", scorer_params={"keep_last": True})
    snapkv_fields = {"window", "kernel_size", "pooling", "gqa_reduce", "gqa_order", "span"}
    rest = {k: v for k, v in default.params().items() if k not in snapkv_fields}
    assert other.params() == {
        **rest,
        "scorer": "tova",
        "scorer_params": {"keep_last": True},
    }  # no SnapKV fields
    assert build_method(name, **other.params()).params() == other.params()
    # A stored row of it reads back as it is: SnapKV's legacy values (gqa_order) are not added.
    assert type(other).upgrade_params(other.params()) == other.params()
    assert other.protected() == (0, 1) and other.min_last_chunk == 1
    assert not other.scorer_method.evict_during_decode  # the wrapper owns eviction


def test_scorers_are_the_methods_with_plain_top_k_selection():
    assert {"snapkv", "tova", "knorm", "expected_attention"} <= set(scorers())
    assert not {"full", "h2o", "streamingllm", "kvzip", "adakv_expected_attention", *WRAPPERS} & set(
        scorers()
    )


def test_a_scorer_is_chosen_on_the_command_line():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=[
                "method=adakv",
                "budget=64",
                "method.scorer=tova",
                "+method.scorer_params.keep_last=true",
            ],
        )
    method = build_method(**OmegaConf.to_container(cfg.method, resolve=True))
    assert method.scorer == "tova" and method.scorer_method.keep_last and method.protected() == (0, 1)
