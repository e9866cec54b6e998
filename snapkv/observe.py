"""Observation mode: record what SnapKV's observation window votes for and what generation really
attends to, on an unmodified transformers model (SnapKV, arXiv 2404.14469, §3, Figs. 2-5).

Recording (`record`), for one prompt of `L` tokens, observation window `w`, prefix `P = L - w`:

1. Prefill the first `L - tail` tokens with the model's own attention (sdpa), full cache,
   `logits_to_keep=1`. `tail = w`, or `input_windows * input_window` when the input windows of
   Fig. 2 are recorded too.
2. Switch to eager attention (`model.set_attn_implementation("eager")`, restored in `finally`) and
   forward the tail with `output_attentions=True`, in chunks (`input_window` tokens, or the one
   window). The last `w` rows of the last chunk are the observation window's attention over ALL
   `L` keys, causal inside the window, softmax over the full row: exactly SnapKV's votes
   (`snapkv.methods.base.window_attention`). Summed over the `w` queries, prefix columns kept.
3. Decode greedily, still eager with `output_attentions=True`: generated token `t` is fed at
   position `L + t`; its query row `[heads, 1, L + t + 1]` is recorded over the prefix columns
   `[:P]`. Row `t` is therefore the attention of the query *of generated token t* (teacher forcing
   over `prompt + generated[:t+1]` gives the same row at index `L + t`). EOS is never a stop: ids
   in `suppress_ids` get -inf logits (as `min_new_tokens` does), so the answer does not end.

Only full-attention layers are recorded (`snapkv.cache.full_attention_layers`, transformers' own
layer typing): sliding-window layers, of hybrids such as Gemma 3 or of a config with a
`sliding_window` and no `layer_types` (every layer), see a different key range. Batch size 1.
Heads are query heads (`[heads]` = the model's `num_attention_heads`; under GQA query head `h`
reads KV head `h // group`).

Memory: the generation attention is `layers x heads x T x P` values in `store_dtype`
(`recording_bytes`): SmolLM2-135M (30 layers, 9 heads), fp16: T=384, P=1.5K: 0.30 GiB; T=384,
P=2K: 0.40 GiB; T=512, P=8K: 2.1 GiB. Each eager chunk returns `layers x heads x chunk x L` fp32
attention weights at once (128 x 2K: 0.26 GiB). Fine for T <= ~512, L <= 8K on the tiny model;
not meant for 7B x 128K.

Metrics (all on the recorded tensors; `[..., P]` boolean masks over prefix positions):

- voted set: per head, the top `ceil(p * P)` prefix positions by the window's summed attention
  (`top_fraction`, p = 5%; optional SnapKV pooling first). Ties go to the earlier position.
- attended set: per head and per generation window of `gen_window` (128) consecutive generated
  tokens, the union over the window's tokens of the prefix positions whose attention weight is
  > theta (0.05) (`attended`). An incomplete last generation window is dropped.
- hit rate = |voted ∩ attended| / |attended| per (layer, head, generation window); heads with an
  empty attended set are left out (NaN), and the per-layer value is the mean over the remaining
  heads (`hit_rates`).
- baseline (`sink_recent`): the same number of positions chosen by position only (4 sinks + the
  most recent), scored with the same hit rate.
- overlap of two selections A, B (`overlap`): |A ∩ B| / min(|A|, |B|) (= |A ∩ B| / k for two
  top-k sets) and Jaccard |A ∩ B| / |A ∪ B|.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from snapkv.cache import full_attention_layers
from snapkv.compat import layer_types
from snapkv.forward import cache_kwarg, prefill, step
from snapkv.methods.base import pool


@dataclass
class Observation:
    """One recorded prompt + greedy generation.

    prompt_ids `[L]`, generated_ids `[T]`; `layers` = the recorded (full-attention) layer indices.
    votes `[n_layers, heads, P]` fp32: the observation window's attention summed over its `window`
    queries, prefix columns `P = L - window`.
    gen_attention `[n_layers, heads, T, P]` (`store_dtype`): row t = attention of generated token t
    over the prefix.
    input_votes `[n_input_windows, n_layers, heads, S]` fp32 or None: the summed attention of each
    of the last `n_input_windows` input windows of `input_window` tokens (oldest first, the last one
    ends at L), over the region `[:S]`, `S = L - n_input_windows * input_window`, that all of them see.
    """

    prompt_ids: torch.Tensor
    generated_ids: torch.Tensor
    window: int
    layers: list[int]
    votes: torch.Tensor
    gen_attention: torch.Tensor
    input_window: int = 0
    input_votes: torch.Tensor | None = None
    text: str | None = None
    seconds: float = 0.0
    attn_impl_prefill: str = ""  # the implementation of the prefix prefill (the recorded parts: eager)

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_ids.numel())

    @property
    def prefix_len(self) -> int:
        return self.prompt_len - self.window

    @property
    def new_tokens(self) -> int:
        return int(self.generated_ids.numel())

    @property
    def input_region(self) -> int:
        return 0 if self.input_votes is None else int(self.input_votes.shape[-1])

    def nbytes(self) -> int:
        t = [self.votes, self.gen_attention] + ([self.input_votes] if self.input_votes is not None else [])
        return sum(x.numel() * x.element_size() for x in t)


def recording_bytes(layers: int, heads: int, new_tokens: int, prefix: int, dtype=torch.float16) -> int:
    """Bytes of the generation attention of one recording: layers x heads x T x P x itemsize."""
    return layers * heads * new_tokens * prefix * torch.tensor([], dtype=dtype).element_size()


def record(
    model,
    input_ids: torch.Tensor | Iterable[int],
    *,
    window: int = 32,
    new_tokens: int = 256,
    input_windows: int = 0,
    input_window: int = 128,
    store_dtype: torch.dtype = torch.float16,
    suppress_ids: Iterable[int] = (),
    tokenizer=None,
) -> Observation:
    """Record the window votes and the generation attention of one prompt (see the module doc).

    input_ids `[L]` or `[1, L]`; window: SnapKV's observation window `w` (< L); new_tokens: T
    greedy tokens; input_windows / input_window: also record the votes of the last
    `input_windows` input windows of `input_window` tokens (Fig. 2; needs window <= input_window);
    suppress_ids: token ids never generated (EOS / end-of-turn: the answer keeps going).
    """
    ids = torch.as_tensor(input_ids if isinstance(input_ids, torch.Tensor) else list(input_ids))
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(
                f"record() takes one prompt (batch 1), got input_ids of shape {tuple(ids.shape)}"
            )
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be [L] or [1, L], got shape {tuple(ids.shape)}")
    length = ids.numel()
    if not isinstance(window, int) or not 0 < window < length:
        raise ValueError(f"window must be an integer in [1, L), got window={window!r}, L={length}")
    if not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens must be a positive integer, got new_tokens={new_tokens!r}")
    if input_windows < 0 or (input_windows and not window <= input_window):
        raise ValueError(
            f"input windows must hold the observation window: got input_windows={input_windows}, "
            f"input_window={input_window}, window={window}"
        )
    tail = max(window, input_windows * input_window)
    if tail >= length:
        raise ValueError(
            f"the eager tail ({tail} tokens: input_windows={input_windows} x input_window={input_window}, "
            f"window={window}) must be shorter than the prompt (L={length})"
        )
    device = next(model.parameters()).device
    ids = ids.to(device)
    layers = full_attention_layers(model.config)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no full-attention layer to record (layer types: "
            f"{sorted(set(layer_types(model.config)))})"
        )
    heads = model.config.get_text_config(decoder=True).num_attention_heads
    prefix, region = length - window, length - tail
    kw = cache_kwarg(model)
    suppress = torch.tensor(sorted(set(int(i) for i in suppress_ids)), dtype=torch.long, device=device)

    cache = DynamicCache(config=model.config)
    original = model.config._attn_implementation
    t0 = time.perf_counter()

    def decode(token: torch.Tensor):  # positions continue from the cache: length + t at step t
        return step(model, cache, token[None], output_attentions=True, cache_arg=kw)

    def pick(next_logits: torch.Tensor) -> torch.Tensor:
        logits = next_logits.float().clone()
        if suppress.numel():
            logits[..., suppress[suppress < logits.shape[-1]]] = -math.inf
        return logits.argmax(-1)

    att: list[torch.Tensor] = []
    input_votes = [] if input_windows else None

    def collect(start: int, end: int, out) -> None:
        nonlocal att
        att = [out.attentions[i][0] for i in layers]  # each [heads, end - start, region + end]
        if input_votes is not None:
            input_votes.append(torch.stack([a[:, :, :region].float().sum(1) for a in att]))

    with torch.inference_mode():
        # [:L - tail] through sdpa, full cache, last logits only
        prefill(model, ids[None, :region], cache, output_attentions=False)
        try:
            model.set_attn_implementation("eager")
            # Chunks of the eager tail: the input windows (oldest first), or the one observation window.
            out = prefill(
                model,
                ids[None, region:],
                cache,
                chunk_size=input_window if input_windows else None,
                on_chunk=collect,
                output_attentions=True,
            )
            # The last chunk ends at L: its last `window` rows are SnapKV's observation window.
            votes = torch.stack([a[:, -window:, :prefix].float().sum(1) for a in att])  # [n_layers, heads, P]
            del att
            gen = torch.empty(new_tokens, dtype=torch.long, device=device)
            gen_att = torch.empty(len(layers), heads, new_tokens, prefix, dtype=store_dtype, device=device)
            nxt = pick(out.logits[0, -1])
            for t in range(new_tokens):
                gen[t] = nxt
                out = decode(nxt.view(1))
                for li, i in enumerate(layers):
                    gen_att[li, :, t] = out.attentions[i][0, :, 0, :prefix]
                nxt = pick(out.logits[0, -1])
        finally:
            model.set_attn_implementation(original)
    seconds = time.perf_counter() - t0
    text = tokenizer.decode(gen.tolist(), skip_special_tokens=False) if tokenizer is not None else None
    return Observation(
        prompt_ids=ids.cpu(),
        generated_ids=gen.cpu(),
        window=window,
        layers=layers,
        votes=votes.cpu(),
        gen_attention=gen_att.cpu(),
        input_window=input_window if input_windows else 0,
        input_votes=torch.stack(input_votes).cpu() if input_votes else None,
        text=text,
        seconds=seconds,
        attn_impl_prefill=original,
    )


# ---- metrics ---------------------------------------------------------------------------------


def top_fraction(scores: torch.Tensor, p: float = 0.05) -> torch.Tensor:
    """Boolean mask `[..., n]` of the top `ceil(p * n)` (at least 1) entries of `scores` `[..., n]`
    along the last axis; ties go to the earlier position (stable sort, as `Method.select`)."""
    if not 0 < p <= 1:
        raise ValueError(f"p must be in (0, 1], got p={p!r}")
    n = scores.shape[-1]
    k = max(1, math.ceil(p * n - 1e-9))
    order = scores.float().sort(dim=-1, descending=True, stable=True).indices[..., :k]
    mask = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    return mask.scatter_(-1, order, True)


def voted(votes: torch.Tensor, p: float = 0.05, kernel_size: int = 1, pooling: str = "none") -> torch.Tensor:
    """The observation window's selection `[..., P]` (bool): top-p of the votes, after SnapKV's
    pooling if asked (kernel_size > 1 with pooling "max" / "avg")."""
    return top_fraction(pool(votes.float(), kernel_size, pooling), p)


def attended(gen_attention: torch.Tensor, theta: float = 0.05, gen_window: int = 128) -> torch.Tensor:
    """Positions attended above `theta`, per generation window: `[..., T, P]` -> `[..., W, P]` bool,
    W = T // gen_window (the incomplete last window is dropped). Union over the window's tokens."""
    if not isinstance(gen_window, int) or gen_window < 1:
        raise ValueError(f"gen_window must be a positive integer, got gen_window={gen_window!r}")
    t = gen_attention.shape[-2]
    n = t // gen_window
    if n == 0:
        raise ValueError(f"no complete generation window: {t} generated tokens < gen_window={gen_window}")
    above = gen_attention[..., : n * gen_window, :] > theta
    return above.unflatten(-2, (n, gen_window)).any(dim=-2)


def hit_rate(voted_mask: torch.Tensor, attended_mask: torch.Tensor) -> torch.Tensor:
    """|voted ∩ attended| / |attended| over the last axis (fp32); NaN where attended is empty.
    The masks broadcast (e.g. voted `[L, H, 1, P]` against attended `[L, H, W, P]`)."""
    hits = (voted_mask & attended_mask).sum(-1).float()
    total = attended_mask.sum(-1).float()
    return torch.where(total > 0, hits / total.clamp(min=1), torch.full_like(hits, math.nan))


def nanmean(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Mean over `dim` ignoring NaN (NaN where all are NaN)."""
    ok = ~x.isnan()
    n = ok.sum(dim)
    s = torch.where(ok, x, torch.zeros_like(x)).sum(dim)
    return torch.where(n > 0, s / n.clamp(min=1), torch.full_like(s, math.nan))


def hit_rates(
    obs: Observation,
    p: float = 0.05,
    theta: float = 0.05,
    gen_window: int = 128,
    kernel_size: int = 1,
    pooling: str = "none",
    selection: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer hit rate of the observation window's top-p selection against what each generation
    window attends to. Returns (rate `[W, n_layers]`: mean over heads with a non-empty attended
    set, NaN if none; per_head `[W, n_layers, heads]`, NaN for an empty attended set).
    selection: a boolean mask `[n_layers, heads, P]` (or broadcastable) scored instead of the
    window's votes, e.g. `sink_recent` as a position-only baseline."""
    v = voted(obs.votes, p, kernel_size, pooling) if selection is None else selection  # [n_layers, heads, P]
    a = attended(obs.gen_attention, theta, gen_window)  # [n_layers, heads, W, P]
    per_head = hit_rate(v[..., None, :], a).permute(2, 0, 1)  # [W, n_layers, heads]
    return nanmean(per_head, -1), per_head


def sink_recent(prefix: int, p: float = 0.05, n_sink: int = 4) -> torch.Tensor:
    """A position-only selection of the same size as `top_fraction` (k = ceil(p * prefix)): the
    first `n_sink` positions plus the most recent `k - n_sink` of the prefix (StreamingLLM's shape).
    The baseline that tells whether the window's votes know more than "sinks + recency". `[prefix]`"""
    k = max(1, math.ceil(p * prefix - 1e-9))
    mask = torch.zeros(prefix, dtype=torch.bool)
    mask[: min(n_sink, k)] = True
    if k > n_sink:
        mask[prefix - (k - n_sink) :] = True
    return mask


def input_window_hit_rates(
    obs: Observation, p: float = 0.05, theta: float = 0.05, gen_window: int = 128
) -> torch.Tensor:
    """Fig. 2: hit rate `[n_input_windows, W, n_layers]` of each input window's top-p selection
    against each generation window's attended positions, both restricted to the region `[:S]` that
    every input window sees (k = ceil(p * S))."""
    if obs.input_votes is None:
        raise ValueError("this observation has no input windows (record with input_windows > 0)")
    s = obs.input_region
    v = top_fraction(obs.input_votes, p)  # [I, n_layers, heads, S]
    a = attended(obs.gen_attention[..., :s], theta, gen_window)  # [n_layers, heads, W, S]
    per_head = hit_rate(v[:, :, :, None], a[None])  # [I, n_layers, heads, W]
    return nanmean(per_head, -2).transpose(1, 2)  # [I, W, n_layers]


def overlap(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Overlap of two selections (bool masks `[..., n]`): (|a ∩ b| / min(|a|, |b|), Jaccard
    |a ∩ b| / |a ∪ b|), fp32 `[...]`; NaN where a set is empty."""
    inter = (a & b).sum(-1).float()
    union = (a | b).sum(-1).float()
    small = torch.minimum(a.sum(-1), b.sum(-1)).float()
    nan = torch.full_like(inter, math.nan)
    return (
        torch.where(small > 0, inter / small.clamp(min=1), nan),
        torch.where(union > 0, inter / union.clamp(min=1), nan),
    )


def common_prefix(seqs: Iterable[torch.Tensor | list[int]]) -> int:
    """Length of the longest common prefix of token sequences (the shared document of prompts that
    differ only in their trailing instruction)."""
    seqs = [torch.as_tensor(s).flatten() for s in seqs]
    n = min(s.numel() for s in seqs)
    same = torch.ones(n, dtype=torch.bool)
    for s in seqs[1:]:
        same &= seqs[0][:n] == s[:n]
    bad = (~same).nonzero()
    return int(bad[0]) if bad.numel() else n
