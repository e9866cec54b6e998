"""Left-padded batches through `snapkv.apply(model, method): model.generate(...)` (snapkv.padding):
a padded row decodes as the same prompt alone, for every method; unsupported padding is refused."""

from __future__ import annotations

import pytest
import torch
from cache_paths import entry_tier
from conftest import random_ids, tiny_model

import snapkv
from snapkv import build_method
from snapkv.forward import cache_kwarg
from snapkv.padding import left_pads

NEW = 8
# Rows longer than the budget (compressed at prefill), and one shorter (kept whole; H2O and
# StreamingLLM then evict during decoding: 36 + 7 fed tokens > 40).
LENGTHS = (96, 72, 36)
METHODS = [
    ("full", {}),
    ("snapkv", dict(budget=40, window=8, kernel_size=5)),
    ("snapkv", dict(budget=40, window=8, kernel_size=4, pooling="avg", gqa_reduce="max")),
    ("h2o", dict(budget=40, evict_during_decode=True)),
    ("h2o", dict(budget=40, evict_during_decode=False, normalize=True)),
    ("streamingllm", dict(budget=40, n_sink=4)),  # positions="original" (compacted: refused)
    ("pyramidkv", dict(budget=40, window=8, kernel_size=5)),
    ("adakv", dict(budget=40, window=8, layout="varlen")),
    ("adakv", dict(budget=40, window=8, layout="padded")),
    ("adakv", dict(budget=40, window=8, base="pyramidkv", normalize=True, alpha=0.5)),
    ("criticalkv", dict(budget=40, window=8, kernel_size=5)),
    ("criticalkv", dict(budget=40, window=8, base="adakv", allocation="kvpress")),
    ("expected_attention", dict(budget=40)),
    ("adakv_expected_attention", dict(budget=40, layout="padded")),
    ("tova", dict(budget=40)),
    ("tova", dict(budget=40, evict_during_decode=False, keep_last=True)),
    ("knorm", dict(budget=40, evict_during_decode=True, skip_layers=[1])),
    ("chunkkv", dict(budget=40, window=8, chunk_length=5, reuse_layers=2)),
]


def left_padded(rows: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = r
        mask[i, width - len(r) :] = 1
    return ids, mask


def generate(model, method, ids, mask=None, **kw):
    with snapkv.apply(model, method), torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=NEW,
            min_new_tokens=NEW,  # no early EOS: every row runs all steps
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **kw,
        )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits, dim=1)


# In the fast tier: on Llama the first entry of each method (its padded scoring and storage; the
# further switch settings score the same padded rows, checked per switch in tests/methods/), on both
# architectures each cache path's representative; the others in the slow tier (tests/cache_paths.py).
PADDED_ROW_CASES = [
    pytest.param(
        arch, name, params, id=f"{name}-params{i}-{arch}", marks=entry_tier(arch, name, params, METHODS)
    )
    for i, (name, params) in enumerate(METHODS)
    for arch in ("llama", "gemma3")
]


@pytest.mark.parametrize("arch_name,name,params", PADDED_ROW_CASES)
def test_padded_row_decodes_as_the_row_alone(arch_name, name, params):
    if name == "knorm" and arch_name == "gemma3":
        pytest.skip(
            "Gemma 3 normalises its keys (k_norm, at its init weights here): every key's L2 norm is "
            "sqrt(head_dim) up to rounding, so K-norm's choice is rounding noise"
        )
    model = tiny_model(arch_name)
    rows = [random_ids(n, seed=i + 1)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = left_padded(rows)
    method = build_method(name, **params)
    tokens, logits = generate(model, method, ids, mask)
    for i, row in enumerate(rows):
        alone_tokens, alone_logits = generate(model, method, row[None])
        assert torch.equal(tokens[i], alone_tokens[0]), f"row {i} (length {len(row)})"
        torch.testing.assert_close(logits[i], alone_logits[0], atol=1e-5, rtol=1e-5, msg=f"row {i}")


@pytest.mark.parametrize("name,params", [METHODS[1], METHODS[3], METHODS[5], METHODS[8]])
def test_padded_row_decodes_as_the_row_alone_with_eager_attention(name, params):
    model = tiny_model("qwen2", attn="eager")
    rows = [random_ids(n, seed=i + 1)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = left_padded(rows)
    method = build_method(name, **params)
    tokens, logits = generate(model, method, ids, mask)
    for i, row in enumerate(rows):
        alone_tokens, alone_logits = generate(model, method, row[None])
        assert torch.equal(tokens[i], alone_tokens[0]), f"row {i} (length {len(row)})"
        torch.testing.assert_close(logits[i], alone_logits[0], atol=1e-5, rtol=1e-5, msg=f"row {i}")


def test_padded_cache_keeps_no_pad_and_masks_filler_slots():
    model = tiny_model("llama")
    rows = [random_ids(n, seed=i + 1)[0] for i, n in enumerate((60, 30))]
    ids, mask = left_padded(rows)
    method = build_method("streamingllm", budget=40, n_sink=4)
    cache = snapkv.CompressedCache(model.config, layer_factory=method.cache_layer)
    with snapkv.apply(model, method), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
    for _, layer in cache.compressible_layers():
        assert layer.stored == 40
        # Row 0 (60 tokens): its first 4 REAL tokens (positions 0-3 of the row) + the last 36.
        real = layer.positions[0, 0] - layer.prompt_pads[0]
        assert real.tolist() == [0, 1, 2, 3] + list(range(24, 60))
        # Row 1 (30 tokens, 30 pads): kept whole, 10 masked filler slots in front.
        assert int(layer.pads[1]) == 10
        assert (layer.positions[1, 0, 10:] - layer.prompt_pads[1]).tolist() == list(range(30))
        assert layer.kept_per_head == (40 + 30) / 2


@pytest.mark.parametrize("name", ["full", "snapkv"])
def test_right_padding_is_refused(name):
    model = tiny_model("llama")
    rows = [random_ids(n, seed=i + 1)[0] for i, n in enumerate((60, 50))]
    ids, mask = left_padded(rows)
    ids, mask = ids.flip(-1), mask.flip(-1)  # pads at the end
    method = build_method(name, **({} if name == "full" else dict(budget=40, window=8)))
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, method, ids, mask)


@pytest.mark.parametrize("name,params", [METHODS[1], METHODS[3]])
def test_beam_search_on_a_padded_batch_equals_each_row_alone(name, params):
    model = tiny_model("llama")
    rows = [random_ids(n, seed=i + 1)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = left_padded(rows)
    method = build_method(name, **params)
    tokens, _ = generate(model, method, ids, mask, num_beams=3)
    for i, row in enumerate(rows):
        assert torch.equal(tokens[i], generate(model, method, row[None], num_beams=3)[0][0]), f"row {i}"


def test_padding_mask_outside_apply_is_refused():
    model = tiny_model("llama")
    ids, mask = left_padded([random_ids(n, seed=i + 1)[0] for i, n in enumerate((60, 50))])
    method = build_method("snapkv", budget=40, window=8)
    cache = snapkv.CompressedCache(model.config, layer_factory=method.cache_layer)
    with snapkv.session(model, method, cache), torch.no_grad():
        with pytest.raises(ValueError, match="outside snapkv.apply"):
            model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})


def test_left_pads_names_the_bad_rows():
    assert left_pads(torch.tensor([[1, 1], [1, 1]])) is None
    assert left_pads(torch.tensor([[0, 1, 1], [1, 1, 1]])).tolist() == [1, 0]
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        left_pads(torch.tensor([[0, 1, 1], [1, 1, 0]]))
    with pytest.raises(ValueError, match="without any real token"):
        left_pads(torch.tensor([[0, 0], [1, 1]]))
