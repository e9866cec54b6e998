"""KVzip: "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction"
(https://arxiv.org/abs/2505.23416). The authors' code: snu-mllab/KVzip (MIT; `model/wrapper.py`
`prefill` / `self_task` / `scoring`, `attention/score.py`, read at
5d8472975d286e3da6b52178af39d18904330c0d); kvpress's port: `KVzipPress` in NVIDIA/kvpress
(`kvpress/presses/kvzip_press.py`, read at 8bb29b9c3078452a86d692f29123fa6c793e2b05).

After the prompt is prefilled, the model is teacher-forced to reconstruct it: for each chunk of
the context (`repeat_chunk` tokens) it is fed, on the full cache, a repeat instruction in the chat
template followed by the chunk itself,

    "\\n\\nRepeat the previous context exactly." + template suffix + chunk            (first chunk)
    "\\n\\nRepeat the part of the previous context exactly, starting with " + the previous chunk's
    last `carry` tokens + template suffix + chunk                                      (later ones)

and each context entry (per layer and KV head) is scored by the MAXIMUM softmax attention it
receives from the queries of its chunk's reconstruction input, over those queries and the GQA
group. As in both originals, that softmax runs over the prefix `sink` keys, the chunk's own
context keys and the reconstruction input's keys (causal among the latter), not over the whole
cache; the reconstruction's forward itself attends the whole cache. After each chunk the cache is
rolled back exactly (`CompressedCache.checkpoint()` / `rollback()`), then it is pruned by the
scores. `selection`: `threshold` (the authors' default: one threshold over all layers' and heads'
scores, keeping the entries STRICTLY above the K-th largest: K - 1 of them without ties),
`global` (kvpress: exactly the top K over all layers and heads), `layer` (kvpress's
`layerwise=True`: each layer the top of its share over its heads), `head` (the authors' uniform
per-head budgets: each head its own top). K = (budget - protected) x kv_heads x layers per batch
row: `budget` is the MEAN entries kept per KV head per layer, protected entries included
(`threshold`: one fewer entry in total). Per-head storage as Ada-KV (`layout`, `snapkv.headwise`)
except with `selection="head"`.

The prompt's template prefix (its system prompt and user header, from the tokenizer's chat
template with a dummy content, as kvpress derives it): `n_sink=None` (the authors) keeps it whole
and uses it as the softmax's sink keys; `n_sink=k` (kvpress) keeps its first k entries, uses
`min(k, chunk start)` sink keys, and scores the rest of the template prefix 0 (evicted first).
`prompt`: `authors` (the later-chunk instruction ends with a space) or `kvpress` (it does not).
`repeat_chunk`: 2000 (the authors) or 2048 (kvpress). `kvzip_plus` (kvpress's
`kvzip_plus_normalization`): each attention weight divided by the norm of its query's attention
input `||h||` and multiplied by `||v W_o^h||_2` of its key (per query head), before the max.

Fidelity caveats: the template suffix is the tokenizer's chat template's (kvpress; the authors
hard-code per-family strings, Llama's starting with "\\n\\n"); without a chat template it is "\\n"
(kvpress). The task's own instruction stays where the task puts it (the authors add theirs to the
system prompt). Token-id entry points without a tokenizer (`generate_ids`, `compress_context`,
the speed bench) have no prompt text: the reconstruction then feeds each chunk after the carried
tokens, without instruction or template (same cost up to those tokens), and no template prefix
is protected. Scores are computed in fp32 with the model's own `scaling` (the originals: in the
model dtype, `1/sqrt(head_dim)`). Kept entries stay in position order, as in both originals
(they mask: the authors' boolean `valid` layout, kvpress's masked indices); attention does not
depend on the order. Left-padded batches and `inputs_embeds` are refused.

What is repeated is everything prefilled after the template prefix: with the question in the
prompt (`query_aware`) the question and the template's tail are reconstructed too; the paper's
setting is query-agnostic (`protocol=context_only` or the shared protocols, which compress the
context alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from snapkv.cache import CompressibleLayer
from snapkv.headwise import LAYOUTS, HeadwiseLayer
from snapkv.methods.adakv import keep_top_per_head
from snapkv.methods.base import Method, OwnPass, grouped, soft_cap, softmax_scores
from snapkv.methods.checks import flag, integer, one_of
from snapkv.methods.criticalkv import head_projections, output_projections
from snapkv.methods.registry import register

SELECTIONS = ("threshold", "global", "layer", "head")
# (first chunk, later chunks) repeat instructions.
REPEAT_PROMPTS = {
    "authors": (
        "\n\nRepeat the previous context exactly.",
        "\n\nRepeat the part of the previous context exactly, starting with ",
    ),
    "kvpress": (
        "\n\nRepeat the previous context exactly.",
        "\n\nRepeat the part of the previous context exactly, starting with",
    ),
}
# fp32 bytes of one block of attention weights `[batch, kv_heads, group, rows, keys]`.
BLOCK_BYTES = 64 * 2**20


@dataclass
class RepeatPrompt:
    """Token ids of the reconstruction input's pieces: the template prefix the prompt starts with,
    the first / later chunks' instructions and the template suffix (end of turn, assistant header)."""

    prefix: list[int] = field(default_factory=list)
    first: list[int] = field(default_factory=list)
    later: list[int] = field(default_factory=list)
    suffix: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, tokenizer, chat_template: bool, prompt: str) -> RepeatPrompt:
        """The pieces for `tokenizer` (kvpress's split of the template around a dummy content)."""

        def encode(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

        first, later = REPEAT_PROMPTS[prompt]
        if chat_template and getattr(tokenizer, "chat_template", None):
            dummy = "dummy context"
            separator = "\n" + "#" * len(dummy)
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": dummy + separator}], tokenize=False, add_generation_prompt=True
            )
            head, suffix = rendered.split(separator)
            prefix = encode(head.split(dummy)[0])
        else:
            # What a raw prompt starts with (`encode_prompt`: the tokenizer's own BOS, if any).
            prefix, suffix = tokenizer("", verbose=False)["input_ids"], "\n"
        return cls(prefix=prefix, first=encode(first), later=encode(later), suffix=encode(suffix))


def reconstruction_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    sink: int,
    start: int,
    end: int,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    key_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """KVzip's score of the context entries `[start, end)`: the max over the reconstruction queries
    and the GQA group of their softmax attention `[batch, kv_heads, end - start]` (fp32).

    query `[batch, heads, q, d]` (the reconstruction input's queries); key `[batch, kv_heads, L, d]`
    (the cache after the input was appended: its last q entries are the input's). The softmax runs
    over `key[:sink]`, `key[start:end]` and the last q keys (causal among those). `row_scale`
    `[batch, q]` multiplies each query's weights, `key_scale` `[batch, kv_heads, group, sink +
    (end - start) + q]` each key's per query head (KVzip+). Memory: query blocks of `BLOCK_BYTES`.
    """
    b, kv_heads, length, _ = key.shape
    nq = query.shape[2]
    keys = torch.cat([key[:, :, :sink], key[:, :, start:end], key[:, :, length - nq :]], dim=2).float()
    qg = grouped(query, kv_heads).float()  # [b, kv, g, q, d]
    g, n_keys, ctx = qg.shape[2], keys.shape[2], end - start
    best = torch.zeros(b, kv_heads, ctx, dtype=torch.float32, device=key.device)
    step = max(1, BLOCK_BYTES // (4 * b * kv_heads * g * n_keys))
    for s in range(0, nq, step):
        t = min(s + step, nq)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qg[:, :, :, s:t], keys).mul_(scaling)
        soft_cap(logits, softcap)
        # Query s+i of the input may not see the input's keys after it.
        hidden = torch.arange(nq, device=key.device)[None, :] > torch.arange(s, t, device=key.device)[:, None]
        logits[..., n_keys - nq :].masked_fill_(hidden, -math.inf)
        probs = softmax_scores(logits, sinks)
        if row_scale is not None:
            probs = probs * row_scale[:, None, None, s:t, None]
        if key_scale is not None:
            probs = probs * key_scale[:, :, :, None, :]
        best = torch.maximum(best, probs[..., sink : sink + ctx].amax(dim=(2, 3)))
    return best


def head_output_norms(values: torch.Tensor, out_proj: torch.Tensor) -> torch.Tensor:
    """`||v W_o^h||_2` of each entry for each query head h of its KV head's group.

    values `[batch, kv_heads, n, head_dim]`, out_proj the layer's `o_proj` weight
    `[hidden, heads * head_dim]` (`head_projections`). Returns `[batch, kv_heads, group, n]` (fp32)."""
    b, kv, n, d = values.shape
    out = torch.empty(b, kv, out_proj.shape[1] // d // kv, n, dtype=torch.float32, device=values.device)
    for s, proj in head_projections(values, out_proj):
        out[..., s : s + proj.shape[2]] = torch.linalg.vector_norm(proj, dim=-1).transpose(2, 3)
    return out


def attention_modules(model) -> dict[int, torch.nn.Module]:
    """The attention modules by layer index (those with a `layer_idx` and an `o_proj`)."""
    found = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and isinstance(getattr(module, "o_proj", None), torch.nn.Linear):
            found[idx] = module
    return found


class _Pass:
    """One reconstruction pass: the chunk being fed and the scores so far."""

    def __init__(self, prefix: int, length: int):
        self.prefix, self.length = prefix, length
        self.start = self.end = self.sink = 0
        self.scores: dict[int, torch.Tensor] = {}  # layer index -> [batch, kv_heads, length]
        self.row_norms: dict[int, torch.Tensor] = {}  # layer index -> ||h|| [batch, q] (KVzip+)


@register
@dataclass
class KVzip(OwnPass, Method):
    name = "kvzip"

    budget: int | None = 1024  # MEAN entries per KV head per layer, protected entries included
    selection: str = "threshold"  # threshold (authors) | global (kvpress) | layer (kvpress layerwise) | head
    n_sink: int | None = None  # None: keep the template prefix whole (authors) | k: kvpress's n_sink
    prompt: str = "authors"  # authors | kvpress: the later chunks' instruction (trailing space or not)
    repeat_chunk: int = 2000  # context tokens per reconstruction input (kvpress: 2048)
    carry: int = 8  # the previous chunk's last tokens repeated in a later chunk's instruction
    kvzip_plus: bool = False  # KVzip+: weights / ||h|| x ||v W_o^h|| (kvpress's normalisation)
    layout: str = "varlen"  # varlen | padded (per-head storage; not used by selection="head")
    # Both originals compress the context alone: the template's generation prompt is never evicted.
    protect: str = field(default="generation_prompt", kw_only=True)

    legacy_params: ClassVar[dict[str, Any]] = {}
    # Its scores come from a reconstruction pass over the whole context, not from the latest
    # queries, so there is nothing for a decode schedule to re-score with.
    schedulable = False

    # Not fields: the repeat prompt's token ids (`post_init_from_tokenizer`), the pass under way, the
    # attention modules and their output projections (`post_init_from_model`).
    _prompt = None
    _pass = None
    _modules = None
    _out_proj = None

    checks = {
        "selection": one_of(SELECTIONS),
        "prompt": one_of(tuple(REPEAT_PROMPTS)),
        "layout": one_of(LAYOUTS),
        "repeat_chunk": integer(1, rule="an integer >= 1"),
        "carry": integer(0),
        "n_sink": integer(0, none=True, rule="None or an integer >= 0"),
        "kvzip_plus": flag(),
    }

    def validate(self) -> None:
        super().validate()
        k = self.n_sink
        if k is not None and self.budget is not None and k >= self.budget:
            raise ValueError(f"n_sink must be < budget, got n_sink={k}, budget={self.budget}")

    def post_init_from_model(self, model) -> None:
        self._modules = attention_modules(model)
        self._out_proj = output_projections(model, self.name) if self.kvzip_plus else None

    def post_init_from_tokenizer(self, tokenizer, chat_template: bool) -> None:
        self._prompt = RepeatPrompt.of(tokenizer, chat_template, self.prompt)

    def cache_layer(self, index: int, num_layers: int) -> CompressibleLayer:
        if self.selection == "head":
            return CompressibleLayer(index=index, num_layers=num_layers)
        return HeadwiseLayer(index=index, num_layers=num_layers, layout=self.layout)

    # ---- the reconstruction pass ----------------------------------------------------------------
    def repeat_inputs(self, ids: torch.Tensor, prefix: int) -> list[tuple[int, int, torch.Tensor]]:
        """(start, end, input ids `[batch, m]`) per chunk of the context `ids[:, prefix:]`: the
        instruction (later chunks: with the previous chunk's last `carry` tokens), the template
        suffix, the chunk."""
        p = self._prompt or RepeatPrompt()
        b, n = ids.shape

        def tensor(tokens: list[int]) -> torch.Tensor:
            return torch.tensor(tokens, dtype=ids.dtype, device=ids.device).expand(b, -1)

        out = []
        for start in range(prefix, n, self.repeat_chunk):
            end = min(start + self.repeat_chunk, n)
            if start == prefix:
                parts = [tensor(p.first)]
            else:
                # The previous chunk's last tokens (at most the whole previous chunk).
                carried = ids[:, max(start - min(self.carry, self.repeat_chunk), prefix) : start]
                parts = [tensor(p.later), carried]
            out.append((start, end, torch.cat([*parts, tensor(p.suffix), ids[:, start:end]], dim=1)))
        return out

    def after_prefill(self, ids: torch.Tensor, cache, forward: Callable[[torch.Tensor], Any]) -> None:
        layers = cache.compressible_layers()
        if self.budget is None or not layers or all(layer.stored <= self.budget for _, layer in layers):
            return  # short prompts are left uncompressed (the result row says so)
        if any(layer.pads is not None for _, layer in layers):
            raise ValueError("kvzip does not support left-padded batches (one reconstruction per prompt)")
        n = layers[0][1].stored
        if ids.shape[1] != n:
            raise ValueError(
                f"kvzip needs the whole prompt's ids: got {ids.shape[1]} tokens, the cache holds {n}"
            )
        prefix = self._prefix_length(ids)
        protected = prefix if self.n_sink is None else min(self.n_sink, n)
        if protected >= self.budget:
            raise ValueError(
                f"kvzip keeps the prompt's {protected} template prefix / sink tokens: budget must exceed "
                f"them, got budget={self.budget}"
            )
        run = self._pass = _Pass(prefix, n)
        mark = cache.checkpoint()
        handles = []
        if self.kvzip_plus:
            for idx, module in self._modules.items():
                handles.append(module.register_forward_pre_hook(self._record_norm(idx), with_kwargs=True))
        try:
            for start, end, repeat in self.repeat_inputs(ids, prefix):
                run.start, run.end = start, end
                run.sink = prefix if self.n_sink is None else min(self.n_sink, start)
                forward(repeat)
                cache.rollback(mark)
        finally:
            for h in handles:
                h.remove()
            self._pass = None
            cache.release()
        self.prune_all(layers, run.scores, protected)

    def _prefix_length(self, ids: torch.Tensor) -> int:
        """Leading tokens of every row equal to the template prefix's."""
        want = torch.tensor((self._prompt or RepeatPrompt()).prefix, dtype=ids.dtype, device=ids.device)
        m = min(want.numel(), ids.shape[1] - 1)
        same = (ids[:, :m] == want[:m]).all(dim=0)
        return int(same.long().cumprod(0).sum()) if m > 0 else 0

    def _record_norm(self, idx: int):
        def hook(module, args, kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            if self._pass is not None and isinstance(h, torch.Tensor):
                self._pass.row_norms[idx] = h.float().norm(dim=-1)  # [batch, q]

        return hook

    def observe(self, layer, query: torch.Tensor, key: torch.Tensor, module) -> None:
        run = self._pass
        if run is None or layer.state != "ready":
            return  # prefill forwards: nothing to do
        row_scale = key_scale = None
        if self.kvzip_plus:
            row_scale = 1 / run.row_norms[layer.index]
            values = layer.values
            sub = torch.cat(
                [values[:, :, : run.sink], values[:, :, run.start : run.end], values[:, :, run.length :]],
                dim=2,
            )
            key_scale = head_output_norms(sub, self._out_proj[layer.index])
        scores = run.scores.get(layer.index)
        if scores is None:
            b, kv = key.shape[:2]
            scores = run.scores[layer.index] = torch.zeros(b, kv, run.length, device=key.device)
        scores[..., run.start : run.end] = reconstruction_scores(
            query, key, run.sink, run.start, run.end, module.scaling, layer.softcap, layer.sinks,
            row_scale, key_scale,
        )  # fmt: skip

    # ---- selection ------------------------------------------------------------------------------
    def counts(self, scores: torch.Tensor, protected: int) -> torch.Tensor:
        """Entries kept per (layer, batch row, KV head) `[layers, batch, kv_heads]` (protected
        included) from the scores `[layers, batch, kv_heads, n]` of the selectable entries."""
        nl, b, kv, n = scores.shape
        per_head = self.budget - protected
        if self.selection == "head":
            return torch.full((nl, b, kv), self.budget, dtype=torch.long, device=scores.device)
        if self.selection == "layer":
            flat = scores.reshape(nl, b, kv * n)
            top = flat.sort(dim=-1, descending=True, stable=True).indices[..., : kv * per_head]
            chosen = torch.zeros(nl, b, kv, dtype=torch.long, device=scores.device)
            chosen.scatter_add_(2, top // n, torch.ones_like(top))
            return chosen + protected
        flat = scores.permute(1, 0, 2, 3).reshape(b, nl * kv * n)  # per row: (layer, head, position)
        k = nl * kv * per_head
        ranked = flat.sort(dim=-1, descending=True, stable=True)
        if self.selection == "threshold":
            # The authors' rule: strictly above the K-th largest score (K - 1 entries without ties).
            chosen = flat > ranked.values[:, max(k - 1, 0), None]
        else:
            chosen = torch.zeros_like(flat, dtype=torch.bool).scatter_(1, ranked.indices[:, :k], True)
        per = chosen.view(b, nl, kv, n).sum(dim=-1).permute(1, 0, 2)
        return per + protected

    def prune_all(self, layers: list[tuple[int, CompressibleLayer]], scores: dict, protected: int) -> None:
        """Prune every compressible layer from its reconstruction scores."""
        # [layers, b, kv, n]; with n_sink (kvpress) the template prefix past the sinks was never
        # scored: 0, evicted first.
        stacked = torch.stack([self.shield(layer, scores[idx], self.budget) for idx, layer in layers])
        counts = self.counts(stacked[..., protected:], protected)
        stacked[..., :protected] = math.inf
        for (_, layer), s, c in zip(layers, stacked, counts):
            if self.selection == "head":
                layer.keep(self.select(s, self.budget))
            else:
                keep_top_per_head(layer, s, c)
            layer.compressed = True
