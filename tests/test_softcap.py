"""Attention modules beyond plain scaled softmax: Gemma 2 style logit soft-capping and gpt-oss style
attention sinks. Nothing evicted must equal the full cache (H2O's fused prefill may not replace such
an attention), and every method's scores must be the weights the model's own attention used."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model
from reference import eager_attentions, naive_column_sums, naive_snapkv_selection
from test_padding import generate, left_padded
from transformers import AutoModelForCausalLM, Gemma2Config, GptOssConfig

from snapkv import CompressedCache, build_method, generate_ids, prefill
from snapkv.hooks import session

PROMPT = 80
NEW = 6
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4)
SMALL.update(num_key_value_heads=2, head_dim=16, num_hidden_layers=2, max_position_embeddings=4096)


def softcap_model(softcap: float = 5.0):
    """Tiny Gemma 2 (logit soft-capping; eager: sdpa cannot soft-cap), q/k scaled up so the cap bites."""
    torch.manual_seed(0)
    config = Gemma2Config(
        attn_logit_softcapping=softcap,
        query_pre_attn_scalar=16,
        layer_types=["full_attention"] * 2,
        sliding_window=16,
        **SMALL,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.q_proj.weight.mul_(8)
            block.self_attn.k_proj.weight.mul_(8)
    return model.eval()


def sinks_model():
    """Tiny gpt-oss (per-head attention sinks `s_aux`), sinks set large enough to matter."""
    torch.manual_seed(0)
    config = GptOssConfig(
        num_local_experts=2,
        num_experts_per_tok=1,
        layer_types=["full_attention"] * 2,
        sliding_window=16,
        **{**SMALL, "intermediate_size": 64},
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for block in model.model.layers:
            block.self_attn.sinks.copy_(torch.tensor([2.0, -1.0, 0.5, 3.0]))
    return model.eval()


MODELS = {"softcap": softcap_model, "sinks": sinks_model}
# Budgets >= prompt + new tokens: nothing is ever evicted.
NOTHING_EVICTED = [
    ("snapkv", dict(budget=PROMPT + NEW, window=8)),
    ("h2o", dict(budget=PROMPT + NEW)),  # fused prefill by default
    ("h2o", dict(budget=PROMPT + NEW, fused=False)),
    ("h2o", dict(budget=PROMPT + NEW, evict_during_decode=False)),
    ("streamingllm", dict(budget=PROMPT + NEW)),
    ("pyramidkv", dict(budget=PROMPT, window=8)),
    ("adakv", dict(budget=PROMPT, window=8)),
]


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("name,params", NOTHING_EVICTED)
def test_nothing_evicted_equals_full_cache(kind, name, params):
    model = MODELS[kind]()
    ids = random_ids(PROMPT)
    ref, rref = generate_ids(model, ids, None, build_method("full"), max_new_tokens=NEW, keep_logits=True)
    out, res = generate_ids(
        model, ids, None, build_method(name, **params), max_new_tokens=NEW, keep_logits=True
    )
    assert not res.compressed
    assert torch.equal(out, ref)
    for a, b in zip(res.logits, rref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _prefilled(model, ids, method):
    cache = CompressedCache(model.config, layer_factory=method.cache_layer)
    with session(model, method, cache) as s, torch.no_grad():
        prefill(model, ids, cache, session=s)
    return cache


@pytest.mark.parametrize("kind", list(MODELS))
def test_h2o_scores_equal_eager_column_sums(kind):
    model = MODELS[kind]()
    ids = random_ids(PROMPT)
    attns = eager_attentions(model, ids)  # the model's own weights: soft-capped / with sinks
    cache = _prefilled(model, ids, build_method("h2o", budget=PROMPT + NEW))  # fused=True (default)
    for i, layer in cache.compressible_layers():
        want = naive_column_sums(attns[i], kv_heads=2).float()
        torch.testing.assert_close(layer.scores[0], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", list(MODELS))
def test_snapkv_selection_equals_naive_eager_reference(kind):
    model = MODELS[kind]()
    ids = random_ids(PROMPT)
    attns = eager_attentions(model, ids)
    cache = _prefilled(model, ids, build_method("snapkv", budget=40, window=8, kernel_size=5))
    for i, layer in cache.compressible_layers():
        want = naive_snapkv_selection(attns[i], 2, 40, 8, 5, "max", "mean")
        assert layer.positions[0].tolist() == want, f"layer {i}"


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize(
    "name,params",
    [("snapkv", dict(budget=40, window=8)), ("h2o", dict(budget=40)), ("streamingllm", dict(budget=40))],
)
def test_padded_row_decodes_as_the_row_alone(kind, name, params):
    model = MODELS[kind]()
    rows = [random_ids(n, seed=i + 1)[0] for i, n in enumerate((PROMPT, 60, 36))]
    ids, mask = left_padded(rows)
    method = build_method(name, **params)
    tokens, logits = generate(model, method, ids, mask)
    for i, row in enumerate(rows):
        alone_tokens, alone_logits = generate(model, method, row[None])
        assert torch.equal(tokens[i], alone_tokens[0]), f"row {i}"
        torch.testing.assert_close(logits[i], alone_logits[0], atol=1e-5, rtol=1e-5, msg=f"row {i}")


def test_bf16_fused_h2o_is_close_not_identical_and_unfused_is_exact():
    """The bf16 statement of docs/pitfalls.md: the fused prefill computes in fp32 (differs from the model's own bf16
    attention by rounding); fused=False runs the model's attention (bit-identical to the full cache)."""
    model = tiny_model("llama").to(torch.bfloat16)
    ids = random_ids(PROMPT)
    ref, rref = generate_ids(model, ids, None, build_method("full"), max_new_tokens=NEW, keep_logits=True)
    diffs = {}
    for fused in (True, False):
        method = build_method("h2o", budget=PROMPT + NEW, fused=fused)
        _, res = generate_ids(model, ids, None, method, max_new_tokens=NEW, keep_logits=True)
        diffs[fused] = max(float((a - b).abs().max()) for a, b in zip(res.logits, rref.logits))
    assert diffs[False] == 0.0
    assert 0.0 < diffs[True] < 2e-2
