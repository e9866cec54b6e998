"""KVzip against a naive transcription of the authors' scoring and kvpress' KVzipPress."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from transformers import DynamicCache

from methods._common import LENGTHS_AROUND_BUDGET, B, distinct_ids, padded_kept, prefilled, tiny_llama
from snapkv import build_method
from snapkv.forward import cache_kwarg

# Transcribed from snu-mllab/KVzip @ 5d8472975d286e3da6b52178af39d18904330c0d (`model/wrapper.py`
# `prefill` / `self_task` / `scoring`, `model/template.py`'s Qwen strings, `attention/score.py`
# `_get_score` / `_threshold` / `_threshold_uniform`) and NVIDIA/kvpress @
# 8bb29b9c3078452a86d692f29123fa6c793e2b05 (`KVzipPress`: `prepare`, `score_kvzip`,
# `compress_post`): the model runs on a plain DynamicCache, each reconstruction input is fed and
# the cache cropped back, queries and keys are read from the model's attention call. Bottom-k /
# top-k ties keep the earlier (layer, head, position), as everywhere in this harness.

KVZIP_SYSTEM = "Hi."


def _kvzip_kept(cache) -> dict[int, list[list[list[int]]]]:
    """Per layer, per batch row, per KV head: the positions kept (per-head storage read per head)."""
    out = {}
    for i, layer in cache.compressible_layers():
        pos = layer.head_positions() if layer.per_head else layer.positions
        out[i] = [[[p for p in head.tolist() if p >= 0] for head in row] for row in pos]
    return out


KVZIP_PREFIX = f"<|im_start|>system\n{KVZIP_SYSTEM}<|im_end|>\n<|im_start|>user\n"  # the authors' Qwen prefix
KVZIP_POSTFIX = "<|im_end|>\n<|im_start|>assistant\n"  # the authors' Qwen postfix
KVZIP_FIRST = "\n\nRepeat the previous context exactly."
KVZIP_LATER = "\n\nRepeat the part of the previous context exactly, starting with "  # kvpress: no final space
KVZIP_TEMPLATE = (
    f"<|im_start|>system\n{KVZIP_SYSTEM}<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer():
    """A character-level tokenizer (ids < 128, the tiny models' vocabulary) with a ChatML template
    that has a system prompt."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = sorted(
        set(KVZIP_PREFIX + KVZIP_POSTFIX + KVZIP_LATER + KVZIP_FIRST + "dummy context#") - set("<|>_")
    )
    chars += list("<|>_")
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.add_special_tokens(specials[1:])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    out.chat_template = KVZIP_TEMPLATE
    return out


@contextlib.contextmanager
def captured_attention(model):
    """The model's attention calls recorded: {layer: (query [b, heads, q, d] post-RoPE, key
    [b, kv, L, d] the whole cache, the attention module's input hidden states [b, q, hidden])}."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    seen: dict = {}
    hidden: dict = {}

    def attn(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = (query, key, value, hidden[module.layer_idx])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def grab(module, args, kwargs):
        hidden[module.layer_idx] = kwargs["hidden_states"]

    hooks = [
        layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in model.model.layers
    ]
    AttentionInterface.register("kvzip_capture", attn)
    AttentionMaskInterface.register("kvzip_capture", sdpa_mask)
    impl = model.config._attn_implementation
    model.set_attn_implementation("kvzip_capture")
    try:
        yield seen
    finally:
        model.set_attn_implementation(impl)
        for h in hooks:
            h.remove()
        AttentionInterface._global_mapping.pop("kvzip_capture", None)
        AttentionMaskInterface._global_mapping.pop("kvzip_capture", None)


def naive_kvzip_chunk_score(module, query, key, value, hidden, sink, start, end, plus):
    """`_get_score` (kvpress' `score_kvzip` with `plus`) of one layer: per KV head, the max over
    its group's heads and the input's queries of the softmax over [sinks, chunk, input] keys."""
    heads, q_len, d = query.shape[1], query.shape[2], query.shape[3]
    kv = key.shape[1]
    g = heads // kv
    ctx = end - start
    out = []
    for h in range(kv):
        keys = torch.cat([key[0, h, :sink], key[0, h, start:end], key[0, h, -q_len:]])
        vals = torch.cat([value[0, h, :sink], value[0, h, start:end], value[0, h, -q_len:]])
        best = torch.zeros(ctx)
        for j in range(g):
            logits = query[0, h * g + j] @ keys.T / math.sqrt(d)
            for i in range(q_len):
                logits[i, keys.shape[0] - q_len + i + 1 :] = -math.inf
            w = logits.softmax(dim=-1)
            if plus:
                w = w / hidden[0].norm(dim=-1)[:, None]
                wo = module.o_proj.weight.T[(h * g + j) * d : (h * g + j + 1) * d]  # [d, hidden]
                w = w * (vals @ wo).norm(dim=-1)[None, :]
            best = torch.maximum(best, w[:, sink : sink + ctx].amax(dim=0))
        out.append(best)
    return torch.stack(out)  # [kv, ctx]


def naive_kvzip_kept(model, tok, ids, budget, variant, chunk, plus=False):
    """{layer: [kept positions per KV head]} for one row `ids` `[1, n]` starting with the prefix."""
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prefix, n = len(enc(KVZIP_PREFIX)), ids.shape[1]
    later = KVZIP_LATER if variant in ("authors", "uniform") else KVZIP_LATER.rstrip(" ")
    n_layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    if n <= budget:
        return {i: [list(range(n))] * kv for i in range(n_layers)}
    cache = DynamicCache(config=model.config)
    ctx = ids[:, prefix:]
    chunks = [ctx[:, s : s + chunk] for s in range(0, ctx.shape[1], chunk)]
    scores = torch.zeros(n_layers, kv, n)
    with captured_attention(model) as seen, torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
        start = prefix
        for i, a in enumerate(chunks):
            q = (
                torch.tensor([enc(KVZIP_FIRST)])
                if i == 0
                else torch.cat([torch.tensor([enc(later)]), chunks[i - 1][:, -8:]], 1)
            )
            repeat = torch.cat([q, torch.tensor([enc(KVZIP_POSTFIX)]), a], dim=1)
            end = start + a.shape[1]
            sink = prefix if variant in ("authors", "uniform") else min(4, start)
            model(input_ids=repeat, use_cache=True, **{cache_kwarg(model): cache})
            for layer in range(n_layers):
                module = model.model.layers[layer].self_attn
                scores[layer, :, start:end] = naive_kvzip_chunk_score(
                    module, *seen[layer], sink, start, end, plus
                )
            cache.crop(-repeat.shape[1])  # the authors' `kv.slice(seen_token_prev)`
            start = end
    kept = torch.zeros(n_layers, kv, n, dtype=torch.bool)
    if variant == "authors":  # `_threshold`: strictly above sorted[int(N r) - 1], the prefix kept
        ctx_scores = scores[..., prefix:]
        k = (budget - prefix) * kv * n_layers  # int(N * r)
        thres = ctx_scores.reshape(-1).sort(descending=True).values[max(k - 1, 0)]
        kept[..., prefix:] = ctx_scores > thres
        kept[..., :prefix] = True
    elif variant == "uniform":  # `_threshold_uniform`: each head its top int(n_seq r)
        for layer in range(n_layers):
            for h in range(kv):
                row = scores[layer, h, prefix:].tolist()
                top = sorted(range(len(row)), key=lambda j: -row[j])[: budget - prefix]
                kept[layer, h, [prefix + j for j in top]] = True
        kept[..., :prefix] = True
    else:  # kvpress `compress_post`: sinks scored 1, the bottom int(numel ratio) pruned
        scores[..., :4] = 1.0
        if variant == "kvpress":
            flat = scores.reshape(-1).tolist()
            order = sorted(range(len(flat)), key=lambda j: (flat[j], -j))
            pruned = order[: len(flat) - budget * kv * n_layers]
            kept.view(-1)[:] = True
            kept.view(-1)[pruned] = False
        else:  # layerwise
            for layer in range(n_layers):
                flat = scores[layer].reshape(-1).tolist()
                order = sorted(range(len(flat)), key=lambda j: (flat[j], -j))
                kept[layer].view(-1)[:] = True
                kept[layer].view(-1)[order[: len(flat) - budget * kv]] = False
    return {layer: [kept[layer, h].nonzero()[:, 0].tolist() for h in range(kv)] for layer in range(n_layers)}


KVZIP_VARIANTS = {
    "authors": dict(),
    "uniform": dict(selection="head"),
    "kvpress": dict(selection="global", n_sink=4, prompt="kvpress"),
    "layerwise": dict(selection="layer", n_sink=4, prompt="kvpress"),
}


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("length", LENGTHS_AROUND_BUDGET)
@pytest.mark.parametrize("variant", [*KVZIP_VARIANTS, "kvpress+plus"])
def test_kvzip_selection_is_the_original(kv_heads, length, variant):
    model, tok = tiny_llama(kv_heads, layers=2), char_tokenizer()
    name, plus = variant.split("+")[0], variant.endswith("+plus")
    method = build_method("kvzip", budget=B, repeat_chunk=9, kvzip_plus=plus, **KVZIP_VARIANTS[name])
    method.post_init_from_tokenizer(tok, True)
    head = torch.tensor([tok(KVZIP_PREFIX, add_special_tokens=False)["input_ids"]])
    rows = [torch.cat([head, distinct_ids(length - head.shape[1], seed=s)], dim=1) for s in (3, 4)]
    got = _kvzip_kept(prefilled(model, torch.cat(rows), method))
    for r, row in enumerate(rows):
        want = naive_kvzip_kept(model, tok, row, B, name, chunk=9, plus=plus)
        assert {i: kept[r] for i, kept in got.items()} == want, f"row {r}"


def test_kvzip_repeat_prompt_pieces_are_the_authors_strings():
    """The template prefix / suffix derived from the chat template are the authors' hard-coded Qwen
    strings; the later chunks' instruction ends with a space (authors) or not (kvpress)."""
    from snapkv.methods.kvzip import RepeatPrompt

    tok = char_tokenizer()
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    p = RepeatPrompt.of(tok, True, "authors")
    assert (p.prefix, p.suffix, p.first, p.later) == (
        enc(KVZIP_PREFIX),
        enc(KVZIP_POSTFIX),
        enc(KVZIP_FIRST),
        enc(KVZIP_LATER),
    )
    assert RepeatPrompt.of(tok, True, "kvpress").later == enc(KVZIP_LATER)[:-1]
    raw = RepeatPrompt.of(tok, False, "authors")
    assert raw.prefix == [] and raw.suffix == enc("\n")


def test_kvzip_threshold_keeps_one_fewer_than_global_and_refuses_padding():
    model = tiny_llama(2, layers=2)
    ids = torch.cat([distinct_ids(90, seed=3), distinct_ids(90, seed=4)])
    kept = {}
    for selection in ("threshold", "global"):
        method = build_method("kvzip", budget=B, selection=selection, repeat_chunk=32)
        cache = prefilled(model, ids, method)
        kept[selection] = [
            sum(len(h) for h in rows[r]) for r in range(2) for rows in [_kvzip_kept(cache)[i] for i in (0, 1)]
        ]
    total = [kept["threshold"][0] + kept["threshold"][1], kept["threshold"][2] + kept["threshold"][3]]
    assert total == [B * 2 * 2 - 1] * 2
    assert sum(kept["global"]) == 2 * B * 2 * 2
    method = build_method("kvzip", budget=B)
    with pytest.raises(ValueError, match="left-padded"):
        padded_kept(model, [distinct_ids(90, seed=3)[0], distinct_ids(70, seed=5)[0]], method)
