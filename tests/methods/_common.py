"""What the per-method tests share: tiny models with 4 or 2 KV heads, a prefill through the hooks,
the kept positions read back per row and KV head (plain, per-head and left-padded layouts), the
check of a method on a batch of two rows and on a left-padded batch against the same naive
selection of each row alone, and the naive evicting decode loop on the full cache.

Prompt lengths straddle the budget (budget - 1, budget, budget + 1, and a longer one)."""

from __future__ import annotations

import pytest
import torch
from conftest import COMMON, tiny_model
from reference import masked_attention
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

import snapkv
from snapkv import CompressedCache, generate_ids, prefill
from snapkv.forward import cache_kwarg
from snapkv.hooks import session

W = 8  # observation window
B = 40  # budget of the selection tests
# B - 1 keeps everything as B does (nothing to evict): in the slow tier; B, B + 1 (one evicted) and
# the longer prompt in the fast tier.
LENGTHS_AROUND_BUDGET = [pytest.param(B - 1, marks=pytest.mark.slow), B, B + 1, 2 * B + 7]
FMAX = torch.finfo(torch.float32).max


def prefilled(model, ids, method):
    cache = CompressedCache(model.config, layer_factory=method.cache_layer)
    with torch.no_grad(), session(model, method, cache) as s:
        prefill(model, ids, cache, session=s)
    return cache


def tiny_llama(kv_heads: int, layers: int = 3):
    """A tiny Llama with 4 query heads and `kv_heads` KV heads (4: MHA, 2: GQA)."""
    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, **{**COMMON, "num_key_value_heads": kv_heads})
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def kept_rows(cache) -> dict[int, list[list[list[int]]]]:
    """Per layer, per batch row, per KV head: the real positions kept (filler slots left out)."""
    out = {}
    for i, layer in cache.compressible_layers():
        b = layer.positions.shape[0]
        pads = [0] * b if layer.pads is None else layer.pads.tolist()
        off = [0] * b if layer.prompt_pads is None else layer.prompt_pads.tolist()
        out[i] = [[(p[pads[r] :] - off[r]).tolist() for p in layer.positions[r]] for r in range(b)]
    return out


def padded_kept(model, rows: list[torch.Tensor], method):
    """Prefill a left-padded batch of `rows` through `snapkv.apply` (the padded-batch path)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    cache = CompressedCache(model.config, layer_factory=method.cache_layer)
    with snapkv.apply(model, method), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
    return kept_rows(cache)


def distinct_ids(n: int, seed: int) -> torch.Tensor:
    """`[1, n]` token ids without repeats: at layer 0 a key's norm depends on its token alone (RoPE
    keeps norms), so a repeated token gives keys whose norms tie up to rounding, and such a tie
    falls either way when the same prompt is computed in another batch layout."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(125, generator=g)[:n] + 3)[None]


def check_batches(model, method, naive, length: int) -> None:
    """`naive(ids [1, L]) -> {layer: [kept per KV head]}` against the method on two rows of length
    `length` and on a left-padded batch of rows of lengths length, length - 9 and length + 5."""
    batch = torch.cat([distinct_ids(length, seed=3), distinct_ids(length, seed=4)])
    got = kept_rows(prefilled(model, batch, method))
    for r in range(2):
        want = naive(batch[r : r + 1])
        assert {i: rows[r] for i, rows in got.items()} == want, f"row {r}"
    rows = [distinct_ids(n, seed=5 + i)[0] for i, n in enumerate((length, max(length - 9, 1), length + 5))]
    got = padded_kept(model, rows, method)
    for r, row in enumerate(rows):
        want = naive(row[None])
        assert {i: kept[r] for i, kept in got.items()} == want, f"padded row {r} (length {len(row)})"


def naive_evicting_decode(model, ids: torch.Tensor, new_tokens: int, choose):
    """Greedy decoding on the FULL cache (a plain DynamicCache: nothing is removed) with eager
    attention limited, per layer and KV head, to a kept set of positions (tests/reference.py's
    `masked_attention`). After every forward, `choose(layer, candidates, probs, keys, prefill)`
    returns the new kept sets: candidates [kv_heads][n] (the kept set plus the forward's tokens),
    probs `[heads, seen]` the forward's last query's attention (0 on hidden positions), keys
    `[kv_heads, seen, d]`. Returns the tokens and, per forward, {layer: kept sets}."""
    visible: dict = {}
    cache = DynamicCache(config=model.config)
    kept: dict[int, list[list[int]]] = {}
    tokens, history = [], []
    impl = model.config._attn_implementation
    x, pos = ids, 0
    with masked_attention(visible), torch.no_grad():
        model.set_attn_implementation("ref_masked")
        try:
            for step in range(new_tokens):
                p = torch.arange(pos, pos + x.shape[1])[None]
                out = model(
                    input_ids=x, position_ids=p, use_cache=True, output_attentions=True,
                    **{cache_kwarg(model): cache},
                )  # fmt: skip
                new = list(range(pos, pos + x.shape[1]))
                pos += x.shape[1]
                for i, attn in enumerate(out.attentions):
                    kv = cache.layers[i].keys.shape[1]
                    cand = [new] * kv if step == 0 else [k + new for k in kept[i]]
                    keys = cache.layers[i].keys[0].double()
                    kept[i] = choose(i, cand, attn[0, :, -1].double(), keys, step == 0)
                history.append({i: [list(k) for k in v] for i, v in kept.items()})
                x = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(x))
                for i, v in kept.items():  # the next forward sees the kept entries and itself
                    visible[i] = torch.tensor([k + [pos] for k in v])[None]
        finally:
            model.set_attn_implementation(impl)
    return tokens, history


def decode_with_history(model, ids, method, new_tokens: int):
    """The method's own greedy generation, with the kept positions after every forward (in
    position order: decode-time eviction in place leaves the stored entries unordered)."""
    history: list[dict] = []
    original = snapkv.hooks.Session.after_attention

    def spy(self, module, layer, query, key):
        original(self, module, layer, query, key)
        if module.layer_idx == 0:
            history.append({})
        history[-1][module.layer_idx] = layer.positions[0].sort(dim=-1).values.tolist()

    snapkv.hooks.Session.after_attention = spy
    try:
        out, res = generate_ids(model, ids, None, method, max_new_tokens=new_tokens)
    finally:
        snapkv.hooks.Session.after_attention = original
    return out[0].tolist(), history, res


def record_forwards(model, ids, method, new_tokens: int) -> dict[int, list[dict]]:
    """The method's own greedy generation, recording per layer and forward what a replay of an
    original needs: the forward's queries `[batch, heads, q, d]`, its new keys `[batch, kv_heads, q,
    d]` (post-RoPE, as cached) and the stored positions `[batch, kv_heads, stored]` after it, in
    storage order (slot i holds position `positions[..., i]`)."""
    forwards: dict[int, list[dict]] = {}
    original = snapkv.hooks.Session.after_attention

    def spy(self, module, layer, query, key):
        step = {"query": query.clone(), "keys": key[:, :, -query.shape[2] :].clone()}
        original(self, module, layer, query, key)
        forwards.setdefault(module.layer_idx, []).append({**step, "positions": layer.positions.clone()})

    snapkv.hooks.Session.after_attention = spy
    try:
        generate_ids(model, ids, None, method, max_new_tokens=new_tokens)
    finally:
        snapkv.hooks.Session.after_attention = original
    return forwards


MODELS = {"mha": lambda: tiny_llama(4, layers=2), "gqa": lambda: tiny_model("llama", layers=2)}


def left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` left-padded with 0 into one batch, and its attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    return ids, mask


def kept_by_method(model, method, rows: list[torch.Tensor]):
    """Our kept positions `{layer: [row][kv head] -> positions in the row}` after a prefill of
    `rows` as one batch (left-padded when their lengths differ) inside `snapkv.apply`."""
    ids, mask = left_padded(rows)
    padded = len({len(r) for r in rows}) > 1
    cache = CompressedCache(model.config, layer_factory=method.cache_layer)
    with snapkv.apply(model, method), torch.no_grad():
        model(input_ids=ids, attention_mask=mask if padded else None, **{cache_kwarg(model): cache})
    out = {}
    for idx, layer in cache.compressible_layers():
        b, h, _ = layer.dims
        per_row = []
        for r in range(b):
            off = 0 if layer.prompt_pads is None else int(layer.prompt_pads[r])
            heads = []
            for kvh in range(h):
                if layer.per_head:
                    pos = layer.head_positions()[r, kvh, : int(layer.lengths[r, kvh])]
                else:
                    pos = layer.positions[r, kvh, 0 if layer.pads is None else int(layer.pads[r]) :]
                heads.append((pos - off).tolist())
            per_row.append(heads)
        out[idx] = per_row
    return out


def layer_inputs(model, ids: torch.Tensor):
    """Per decoder layer of one row `[1, L]`: (attention module, its input hidden states, the full
    cache's keys and values `[1, kv_heads, L, d]`)."""
    layers = model.model.layers
    hidden = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda m, args, kwargs: hidden.__setitem__(m.layer_idx, kwargs["hidden_states"]), with_kwargs=True
        )
        for layer in layers
    ]
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    finally:
        for hook in hooks:
            hook.remove()
    return [
        (lay.self_attn, hidden[i], cache.layers[i].keys, cache.layers[i].values)
        for i, lay in enumerate(layers)
    ]


def top_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of the 1-D `x`; ties to the earlier index."""
    return x.sort(descending=True, stable=True).indices[:k]


def topk_rows(scores: torch.Tensor, k: int) -> list[list[int]]:
    """ScorerPress: per head the top-k positions of `scores` `[heads, L]`, ascending."""
    return [sorted(top_indices(scores[h], k).tolist()) for h in range(scores.shape[0])]
