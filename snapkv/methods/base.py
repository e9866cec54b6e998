"""Base class of every compression method, and the scoring helpers they share.

A method (kvpress style) is a small dataclass: its fields are the hyper-parameters, and it says how
to score the cached entries of one layer. This base class owns everything else: protection of the
leading (sink) / trailing (window, recent) entries and of the prompt's protected end (`protect`:
the chat template's generation prompt, or the whole question), top-k, gather, decode-time eviction
and the bookkeeping on the cache layer. Shapes follow transformers: queries
`[batch, heads, q, head_dim]`, keys `[batch, kv_heads, k, head_dim]`, scores `[batch, kv_heads, k]`.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from snapkv.cache import CompressibleLayer
from snapkv.methods.checks import Check, check_all, integer, one_of

GQA_REDUCTIONS = ("mean", "max", "sum")
# Where pooling goes relative to the GQA group reduction (SnapKV-family scores, see methods/snapkv.py).
GQA_ORDERS = ("reduce_first", "pool_first")
# Pooling of the scores along the sequence (`pool`).
POOLINGS = ("max", "avg", "none")
# Storage order of kept entries (`kept_order` of SnapKV, SnapKV-D, R-KV): ascending positions, or
# the order the original's top-k gathers them in (what its later pooling and protection then see).
KEPT_ORDERS = ("position", "topk")
# What a decode schedule's `interval` counts (`DecodeSchedule.count_from`).
SCHEDULE_COUNTS = ("prefill", "start")
# What of the prompt's end is never evicted (`Method.protect`): nothing, the chat template's
# generation prompt (what follows the user's content: end of turn, assistant header), or the whole
# question part (the question and the generation prompt).
PROTECTS = ("none", "generation_prompt", "question")


@dataclass
class DecodeSchedule:
    """When and how a scoring method compresses the cache again while generating.

    - `interval`: every `interval` tokens fed after the prompt (counted per layer from the end of
      prefill, reset at each scheduled step) is a scheduled step; None / 0: off (compress once, at
      the end of prefill).
    - `count_from`: "prefill" (the above) or "start": a forward is a scheduled step when the tokens
      before it, prompt included, are a multiple of `interval` (R-KV's `length % divide_length ==
      0`, tested after each forward for the next one). Left out of `params()` at "prefill".
    - `buffer`: at a scheduled step the layer is compressed only when it holds more than
      `target + buffer` entries per KV head (0: whenever it holds more than `target`). With
      `interval=1` this is "compress back to `target` whenever the cache exceeds `target + buffer`".
    - `target`: entries per KV head kept by a scheduled compression: an int, a ratio in (0, 1) of
      the tokens the layer has seen (`int(target x seen)`), or None: the method's own budget for the
      layer (`Method.layer_budget`, so PyramidKV keeps its pyramid). Never fewer than the
      method's protected entries.
    - `window`: the latest tokens (prompt tokens first, then generated ones) whose queries
      `[batch, heads, window, head_dim]` are kept and passed as `query` to the method's `score()`;
      None: the method's own observation window (`min_last_chunk`: SnapKV's `window`, 1 for
      window-free methods). SnapKV's scores may take fewer (`Method.decode_window_floor`): the
      scheduled steps then vote with those queries only, the `window` entries staying protected.

    At a scheduled step, after the step's attention: `score(layer, window_queries, layer.keys,
    module)`, then `prune(layer, scores, target)`, exactly as at the end of prefill. Per-step
    eviction with the method's running scores is this same schedule (`EveryStep`), which
    `evict_during_decode: true` is stored as.
    """

    # Whether the schedule scores with the method's running scores (`EveryStep`) rather than with the
    # window's queries. A class attribute, not a field: no config spells it, so neither the
    # `method.decode_schedule.*` keys nor the hashes of scheduled configs change.
    per_step: ClassVar[bool] = False

    interval: int | None = None
    buffer: int = 0
    target: int | float | None = None
    window: int | None = None
    count_from: str = "prefill"

    @property
    def on(self) -> bool:
        return bool(self.interval)

    checks: ClassVar[dict[str, Check]] = {
        "interval": integer(0, none=True, rule="null or an integer >= 0"),
        "buffer": integer(0),
        "window": integer(1, none=True, rule="null or a positive integer"),
        "count_from": one_of(SCHEDULE_COUNTS),
    }

    def validate(self) -> None:
        check_all(self.checks, self, prefix="decode_schedule.")
        t = self.target  # an int or a ratio: two kinds of value, one rule each
        if t is not None and (
            isinstance(t, bool)
            or not isinstance(t, int | float)
            or (isinstance(t, int) and t <= 0)
            or (isinstance(t, float) and not 0 < t < 1)
        ):
            raise ValueError(
                f"decode_schedule.target must be null, a positive integer or a ratio in (0, 1), got target={t!r}"
            )


@dataclass
class EveryStep(DecodeSchedule):
    """Per-step eviction: the decode schedule `interval=1`, back to the layer's budget (`target`
    None, no `buffer`), scored by the method's running scores rather than by window queries: the
    method's `observe` sees every forward after the prefill (where a window schedule keeps the
    forward's queries), then the scheduled step (`compress_decode`) evicts with `decode_score`, a
    decode step's one surplus entry dropped in place (`CompressibleLayer.evict_in_place`).

    `evict_during_decode: true` (H2O, TOVA, K-norm; StreamingLLM's class says True) is stored as
    this schedule in `Method.decode_schedule`, and is the only way to it: configs and rows keep
    spelling it by the flat switch, and `params()` leaves the schedule out, so their hashes do not
    move. Two differences from a window schedule of interval 1 are kept: its evictions count in
    `decode_evicted` only, not in `decode_compressions` (the compressions with the window's
    queries; rows of per-step eviction always said 0), and its in-place evictions leave the entries
    out of position order (a window schedule's prune stores them in the method's kept order)."""

    per_step: ClassVar[bool] = True

    interval: int | None = 1


class OwnPass:
    """What a method with its own pass over the model after the prefill (KVzip's context
    reconstruction) adds to `Method` (a mixin: `class KVzip(OwnPass, Method)`); the hooks run
    `after_prefill` for the methods that are one (`isinstance`), and the entry points that build
    prompts from text run `post_init_from_tokenizer` through the function of that name. Such a
    method compresses nothing per layer at the end of prefill (`Method.compress_prefill`): its
    selection needs every layer's scores from the pass."""

    def post_init_from_tokenizer(self, tokenizer, chat_template: bool) -> None:
        """Called by `snapkv.generate` and the shared protocols before a prompt built with
        `tokenizer` is prefilled (`chat_template`: whether prompts go through its chat template): a
        pass that feeds text (KVzip's repeat prompt) tokenizes it here. Token-id entry points
        (`generate_ids`, `compress_context`) do not call it."""

    def after_prefill(self, ids: torch.Tensor, cache, forward) -> None:
        """Called once the whole prompt `ids` `[batch, n]` is in `cache` (every compressible layer
        through `compress_prefill`), before anything else is fed: the method selects from a further
        pass over the model, through `forward(new_ids)` (the model on `new_ids` `[batch, m]` at the
        next positions; its attention calls reach only `observe`, the session's phase being
        "score"), restores the cache (`cache.checkpoint()` / `rollback()`) and prunes. The pass's
        wall time is recorded as `cache.scoring_s`."""
        raise NotImplementedError


def post_init_from_tokenizer(method: Method, tokenizer, chat_template: bool) -> None:
    """`method.post_init_from_tokenizer(tokenizer, chat_template)` for a method with its own pass
    (`OwnPass`); nothing for the others, which feed no text of their own."""
    if isinstance(method, OwnPass):
        method.post_init_from_tokenizer(tokenizer, chat_template)


class GenerateCheck:
    """What a method that cannot run inside `model.generate` in some configuration adds to `Method`
    (a mixin: `class StreamingLLM(GenerateCheck, Method)`, whose compacted positions need
    `snapkv.generate`'s own position bookkeeping); `snapkv.apply` and left-padded batches ask the
    methods that are one through `check_model_generate(method)`."""

    def check_model_generate(self) -> None:
        """ValueError if the method cannot run inside `model.generate` (`snapkv.apply`)."""


def check_model_generate(method: Method) -> None:
    """ValueError if `method` cannot run inside `model.generate` (`snapkv.apply`, and left-padded
    batches, which support what it supports): asked of the methods that are a `GenerateCheck`."""
    if isinstance(method, GenerateCheck):
        method.check_model_generate()


class OwnAttention:
    """What a method that computes some forwards' attention itself, fused with its scoring, adds to
    `Method` (a mixin: `class H2O(OwnAttention, Method)`; H2O and TOVA); the attention hooks ask the
    methods that are one (`isinstance`), and the model's own attention runs for the others."""

    def prefill_attention(self, layer: CompressibleLayer, query, key, value, module) -> torch.Tensor | None:
        """Optionally compute a prefill chunk's attention output `[batch, q, heads, d]` itself (e.g.
        fused with scoring, H2O); None: the model's own attention function runs. Only called for
        plain causal prefill chunks (no padding). A method that returns the output takes the
        chunk's statistics from the same computation: `observe` is not called for that forward."""
        return None

    def decode_attention(self, layer: CompressibleLayer, query, key, value, module) -> torch.Tensor | None:
        """Optionally compute a decode step's attention output `[batch, 1, heads, d]` itself, from
        the attention row the method scores with (H2O, TOVA: the step's softmax is both their score
        and the attention, as in the originals, which read the model's attention weights); None:
        the model's own attention function runs. Only called for one-token forwards after the
        prefill, on unpadded layers with plain scaled softmax. As with `prefill_attention`, a
        returned output means `observe` is not called for that forward."""
        return None


class KeptOrder(ABC):
    """What a method that may store its kept entries in its original's order adds to `Method` (a
    mixin: `class SnapKV(KeptOrder, Method)`; SnapKV, SnapKV-D, R-KV), for its `kept_order` field
    (KEPT_ORDERS): at "topk", `Method.select` returns `topk_order`'s indices instead of ascending
    positions; at "position" the method selects as every other one."""

    # Whether, at kept_order "topk", a layer that holds exactly its budget (or a scheduled step's
    # target, without `buffer`) is compressed too: nothing is dropped, the entries take top-k order
    # (R-KV's code compresses unless `kv_cache_len < budget`). Such a reordering does not mark the
    # layer compressed nor count as a scheduled compression.
    reorders_at_budget: ClassVar[bool] = False

    @abstractmethod
    def topk_order(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """Indices `[batch, kv_heads, budget]` of the entries to keep given `scores` `[batch,
        kv_heads, stored]`, in the order the original stores them (a class that takes the mixin
        without it cannot be instantiated)."""

    def reorders(self) -> bool:
        """Whether a layer at exactly its budget is reordered (`reorders_at_budget`, at "topk")."""
        return self.reorders_at_budget and self.kept_order == "topk"


@dataclass
class Method:
    """A KV-cache compression method. `budget` = entries kept per KV head per layer (None: no limit).

    What a method defines (kvpress style: a dataclass whose fields are its hyper-parameters):

    - declarations (class attributes, no code): `name`, `checks` (each parameter's values),
      `legacy_params` / `left_out_at_default` (rows and hashes written before a switch existed),
      `schedulable`, `observation_window` and `decode_window_floor` (what the last prefill chunk and
      a decode schedule's window must hold), `prompt_state`;
    - hooks, each with a no-op / uniform default, the only methods a method overrides:

      | hook | default | e.g. |
      |---|---|---|
      | `validate()` | nothing | SnapKV's `window < budget` (rules relating several fields) |
      | `post_init_from_model(model)` | nothing | StreamingLLM's RoPE frequencies |
      | `protected()` | `(0, 0)` | SnapKV's window, StreamingLLM's sinks and recent tokens |
      | `observe(layer, query, key, module)` | nothing | H2O's accumulated attention |
      | `score(layer, query, key, module)` | zeros | every scorer |
      | `decode_score(layer)` | zeros | per-step eviction's running scores (H2O, TOVA, K-norm) |
      | `layer_budget(layer)` | `budget` | PyramidKV's pyramid, K-norm's `skip_layers` |
      | `cache_layer(index, num_layers)` | `CompressibleLayer` | per-head storage (Ada-KV) |
      | `prune(layer, scores, budget)` | top-k keep | Ada-KV's head budgets, CriticalKV's two stages |
      | `compress(layer, query, key, module, budget)` | `score` + `prune` | ChunkKV's whole chunks |

      and `upgrade_params(params)` (a class method: rows written by an older version, Ada-KV's old
      `normalize`);
    - a mixin for a need of one method or two, whose hooks the base class and the session ask for
      with `isinstance`: `OwnAttention` (H2O, TOVA), `OwnPass` (KVzip), `GenerateCheck`
      (StreamingLLM), `KeptOrder` (SnapKV, SnapKV-D, R-KV).

    Everything else is a template the base class owns and methods do not override: parameter
    checks (`__post_init__`, `check_schedule`), `params()`, protection (`protected_tail`, `shield`,
    `select`), `compress_prefill`, `compress_decode` and the per-step eviction it runs. Budget
    policies and selections around any scorer (`snapkv.methods.compose.ScorerWrapper`) delegate the
    scorer's part of those to it. Three templates are still overridden where the method's step is
    not the template's (`tests/test_method_hooks.py` lists them): StreamingLLM's `victims` and
    `evicts_in_place` and TOVA's `victims` (per-step eviction's victim as one slot for every head,
    from positions alone or one head's scores: the decode hot path; StreamingLLM's compacted
    positions re-rotate in `prune` yet evict in place with original positions), and Expected
    Attention's `compress_decode` (its statistics re-fitted to the window's queries before a
    scheduled step scores, and dropped after it).
    """

    name: ClassVar[str] = ""

    # Values that reproduce what this method computed before a switch was added, for rows written
    # before it existed (`upgrade_params`): e.g. SnapKV rows without `gqa_order` were computed with
    # `pool_first`. A new switch whose default changes results adds its old value here.
    legacy_params: ClassVar[dict[str, Any]] = {}

    # Fields left out of `params()` (hence of config hashes) while at their default: switches
    # added after rows of the method were written.
    left_out_at_default: ClassVar[tuple[str, ...]] = ()

    # Whether `decode_schedule` may be turned on: methods without scores (full) or with their own
    # decode-time scoring state (H2O's accumulated attention, StreamingLLM's rolling window) say no.
    schedulable: ClassVar[bool] = True

    # The field holding how many of the latest queries `score()` reads (SnapKV's observation
    # `window`): the last prefill chunk must hold that many (`min_last_chunk`); None: one.
    observation_window: ClassVar[str | None] = None

    # Whether a scheduled step's `score()` needs all `min_last_chunk` queries, so that
    # `decode_schedule.window` may not be fewer. False: it votes with the schedule's window, down to
    # the current token alone (SnapKV; the `window` entries stay protected).
    decode_window_floor: ClassVar[bool] = True

    # Whether `layer.method_state` holds statistics of the prompt only (Expected Attention's query
    # fit): dropped once the layer's prefill compression ran.
    prompt_state: ClassVar[bool] = False

    # What each parameter's values may be (see snapkv.methods.checks), checked before `validate()`;
    # merged along the class hierarchy (`param_checks`): a subclass replaces an entry by naming it,
    # and drops it with None.
    checks: ClassVar[dict[str, Check | None]] = {"budget": integer(none=True), "protect": one_of(PROTECTS)}

    budget: int | None = None
    # Compression while generating (see DecodeSchedule); keyword-only, so it never shifts positional
    # arguments. Left out of `params()` while off: configs without a schedule keep their hashes.
    decode_schedule: DecodeSchedule | None = field(default=None, kw_only=True)
    # The end of the prompt that is never evicted (PROTECTS; see `protected_tail`): the prompt's
    # last tokens as the entry points mark them (`CompressedCache.protect`), kept like the window
    # and the sinks, within the budget. Keyword-only; left out of `params()` at "none", so configs
    # that protect nothing keep their hashes. A method whose original never compresses the
    # generation prompt redeclares the default (docs/methods.md).
    protect: str = field(default="none", kw_only=True)

    def __post_init__(self) -> None:
        # Each parameter on its own first (the schedule's fields too), then the rules relating them
        # (`validate()`, which may read the schedule), then what the method refuses in a schedule.
        check_all(self.param_checks(), self, self.name)
        schedule = self.decode_schedule
        if schedule is None or isinstance(schedule, EveryStep):
            # EveryStep is the normalised `evict_during_decode` (a copy, `dataclasses.replace`):
            # the flag below decides again.
            schedule = DecodeSchedule()
        elif isinstance(schedule, Mapping):
            unknown = sorted(set(schedule) - {f.name for f in dataclasses.fields(DecodeSchedule)})
            if unknown:
                raise ValueError(
                    f"unknown decode_schedule key(s) {unknown}; it takes interval, buffer, target, window, "
                    "count_from"
                )
            schedule = DecodeSchedule(**schedule)
        elif not isinstance(schedule, DecodeSchedule):
            raise ValueError(f"decode_schedule must be a mapping, got decode_schedule={schedule!r}")
        self.decode_schedule = schedule
        schedule.validate()
        self.validate()
        if schedule.on:
            self.check_schedule(schedule)
        # `evict_during_decode`: a field of H2O, TOVA and K-norm (StreamingLLM's class says True).
        if getattr(self, "evict_during_decode", False):
            self.decode_schedule = EveryStep()  # the one decode-time mechanism, on running scores

    def check_schedule(self, schedule: DecodeSchedule) -> None:
        """ValueError when this method cannot run `schedule` (it is on), from its declarations
        (`schedulable`, `evict_during_decode`, `cache_layer`, `min_last_chunk` and
        `decode_window_floor`, `protected()`). Not overridden: a rule of one method that relates the
        schedule to its parameters is part of its `validate()`, which sees the schedule."""
        if not self.schedulable:
            raise ValueError(
                f"{self.name} cannot take a decode_schedule (interval={schedule.interval}): it has no "
                "scores to compress with while decoding, or evicts with its own state"
            )
        if getattr(self, "evict_during_decode", False):
            raise ValueError(
                f"{self.name} already evicts while decoding: decode_schedule (interval={schedule.interval}) "
                "needs evict_during_decode=false"
            )
        if not self.cache_layer(0, 1).evicts_after_compression:
            raise ValueError(
                f"{self.name} keeps per-head lengths (per-head storage cannot evict while decoding): "
                f"decode_schedule (interval={schedule.interval}) is not supported"
            )
        if self.decode_window_floor and schedule.window is not None and schedule.window < self.min_last_chunk:
            raise ValueError(
                f"decode_schedule.window must be >= the method's observation window "
                f"{self.min_last_chunk}, got window={schedule.window}"
            )
        first, last = self.protected()
        if isinstance(schedule.target, int) and schedule.target <= first + last:
            raise ValueError(
                f"decode_schedule.target must exceed the {first + last} protected entries, "
                f"got target={schedule.target}"
            )

    @classmethod
    def param_checks(cls) -> dict[str, Check | None]:
        """`checks` of the class and its parents, a subclass's entry replacing its parent's."""
        merged: dict[str, Check | None] = {}
        for klass in reversed(cls.__mro__):
            merged.update(klass.__dict__.get("checks", {}))
        return merged

    @classmethod
    def upgrade_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        """The parameters of a row written by an older version, as today's names and values for
        what really ran: switches the row does not name get their `legacy_params` value. A hook (a
        class method) for a migration that is not a missing value (Ada-KV's old `normalize`)."""
        return {**{k: v for k, v in cls.legacy_params.items() if k not in params}, **params}

    @property
    def min_last_chunk(self) -> int:
        """Tokens the last prefill chunk must hold (the field `observation_window` names: SnapKV's
        window; 1 without one); chunked prefill merges a shorter last chunk into the one before."""
        return getattr(self, self.observation_window) if self.observation_window else 1

    # ---- the hooks: what a method defines (each has a no-op / uniform default) ----------------
    def validate(self) -> None:
        """ValueError for a combination of parameters the method cannot run (each parameter on its
        own, the decode schedule's fields included, is checked by `checks` first)."""

    def post_init_from_model(self, model) -> None:
        """Called once per session, before the first forward (kvpress's hook): a method that needs
        something from the model takes it here (StreamingLLM's compacted positions: the RoPE
        frequencies). ValueError if the method cannot run on this model."""

    def layer_budget(self, layer: CompressibleLayer) -> int | None:
        """Entries kept per KV head in this layer (uniform by default; PyramidKV-style schedules
        override this). Layers may end up with different lengths: the attention wrapper then
        builds a per-layer mask."""
        return self.budget

    def cache_layer(self, index: int, num_layers: int) -> CompressibleLayer:
        """The cache layer a compressible layer gets (`CompressedCache(config, method.cache_layer)`);
        methods with per-head lengths (Ada-KV) return `snapkv.headwise.HeadwiseLayer`."""
        return CompressibleLayer(
            index=index, num_layers=num_layers, decode_eviction=self.decode_schedule.per_step
        )

    def protected(self) -> tuple[int, int]:
        """(leading, trailing) entries always kept, e.g. StreamingLLM's sinks, SnapKV's window."""
        return 0, 0

    def observe(self, layer: CompressibleLayer, query: torch.Tensor, key: torch.Tensor, module) -> None:
        """Called after attention for every forward on the layer (prefill chunks and decoding):
        methods that accumulate statistics (H2O) update `layer.scores` here; other per-layer state
        a method keeps goes in `layer.method_state` (an object of the method's own type)."""

    def score(self, layer: CompressibleLayer, query: torch.Tensor, key: torch.Tensor, module) -> torch.Tensor:
        """Scores `[batch, kv_heads, stored]` of the stored entries at the end of prefill; higher is kept.
        `query` is the last prefill chunk's queries, `key` all stored keys."""
        return torch.zeros(key.shape[:3], device=key.device)

    def decode_score(self, layer: CompressibleLayer) -> torch.Tensor:
        """Scores of the stored entries for decode-time eviction."""
        return torch.zeros(layer.positions.shape, device=layer.positions.device)

    def prune(self, layer: CompressibleLayer, scores: torch.Tensor, budget: int) -> None:
        """Keep `budget` entries per KV head given `scores` `[batch, kv_heads, stored]`: the one
        overridable step of `compress_prefill` and `compress_decode` (Ada-KV splits the layer's
        budget across heads; StreamingLLM re-rotates the kept keys with compacted positions)."""
        layer.keep(self.select(scores, budget))

    def compress(
        self, layer: CompressibleLayer, query: torch.Tensor, key: torch.Tensor, module, budget: int
    ) -> None:
        """Score the stored entries with `query` and keep `budget` per KV head (the step both
        `compress_prefill` and `compress_decode` take; ChunkKV keeps whole chunks)."""
        self.prune(layer, self.shield(layer, self.score(layer, query, key, module), budget), budget)

    # ---- owned by the base class -------------------------------------------------------------
    def params(self) -> dict[str, Any]:
        params = dataclasses.asdict(self)
        if not self.decode_schedule.on or self.decode_schedule.per_step:
            # Off: the hash of a config without a schedule. Per-step: `evict_during_decode` names it.
            params.pop("decode_schedule")
        elif self.decode_schedule.count_from == "prefill":
            params["decode_schedule"].pop("count_from")  # added later: scheduled configs keep their hashes
        for name in self.left_out_at_default:
            # Switches added after rows were written: at their default, those rows keep their hashes.
            if params.get(name) == type(self).__dataclass_fields__[name].default:
                params.pop(name)
        if self.protect == "none":
            params.pop("protect")  # nothing protected: the hash of a config without the switch
        return params

    def protected_tail(self, question: int, generation_prompt: int) -> int:
        """How many of the prompt's last tokens `protect` keeps, given the question part's length
        `question` (the question and the template's generation prompt: `encode_prompt`'s second
        part) and the generation prompt's `generation_prompt` (0 without a chat template)."""
        if self.protect == "question":
            return max(question, generation_prompt)
        if self.protect == "generation_prompt":
            return generation_prompt
        return 0

    def check_protected(self, tail: int) -> None:
        """ValueError when `tail` protected prompt tokens and the sinks / recent tokens leave no entry
        to evict while decoding (per-step eviction drops one unprotected entry per step; once the
        prompt's end is older than the recent tokens they no longer overlap). Compressions through
        `select` check the same at every prune."""
        first, last = self.protected()
        if (
            tail
            and self.decode_schedule.per_step
            and self.budget is not None
            and first + last + tail > self.budget
        ):
            raise ValueError(
                f"{self.name} protects {first + last + tail} entries while decoding ({first} sinks, "
                f"{last} recent, {tail} for protect={self.protect!r}): budget must be at least that, "
                f"got budget={self.budget}"
            )

    def shield(self, layer: CompressibleLayer, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """`scores` `[batch, kv_heads, stored]` with the entries of the layer's protected span
        (`CompressibleLayer.protected_span`, positions `[start, end)`) at +inf, so every selection
        keeps them (the rank-based ones as the window's entries); `scores` itself without a span.
        Every path that prunes passes its scores through here. ValueError when the span alone
        holds more entries than `budget` (`select` also counts the sinks / window)."""
        span = layer.protected_span
        if span is None:
            return scores
        positions = layer.positions
        inside = (positions >= span[0]) & (positions < span[1])
        held = int(inside.sum(dim=-1).max())
        if held > budget:
            raise ValueError(
                f"{self.name} protects {held} entries of the prompt's end in layer {layer.index} "
                f"(protect), more than the {budget} that layer keeps: raise budget (got "
                f"budget={self.budget})"
            )
        return scores.float().masked_fill(inside, math.inf)

    def decode_target(self, layer: CompressibleLayer) -> int | None:
        """Entries per KV head a scheduled compression keeps in `layer` (None: never compressed,
        e.g. K-norm's `skip_layers`); at least the protected entries."""
        budget = self.layer_budget(layer)
        target = self.decode_schedule.target
        if budget is None or target is None:
            return budget
        first, last = self.protected()
        n = int(target * layer.seen) if isinstance(target, float) else target
        return max(n, first + last + 1)

    def compress_decode(self, layer: CompressibleLayer, query: torch.Tensor | None, module) -> bool:
        """A scheduled step (`decode_schedule`): prune the stored entries to `decode_target` when the
        layer holds more than target + buffer, scored with `query`, the window's queries `[batch,
        heads, window, head_dim]`, or on per-step eviction (`EveryStep`; `query` unused) with the
        method's running scores (`decode_score`; evicted entries never return). Returns whether it
        pruned (a `KeptOrder` reordering of a layer at exactly its target, without `buffer`, drops
        nothing: False)."""
        target = self.decode_target(layer)
        if target is None or layer.stored <= target + self.decode_schedule.buffer:
            # Not the per-step eviction's path (it holds target + 1 here): a layer at its target is
            # reordered by a method that `reorders()`.
            if isinstance(self, KeptOrder) and self.reorders() and not self.decode_schedule.buffer:
                if layer.stored == target:
                    self.compress(layer, query, layer.keys, module, target)
            return False
        if not self.decode_schedule.per_step:
            self.compress(layer, query, layer.keys, module, target)
            return True
        if layer.stored == target + 1 and layer.pads is None and layer.owns_buffers and self.evicts_in_place:
            # A decode step's one surplus entry, dropped without copying the layer (not in a padded
            # batch's row view, whose tensors are slices of the batch's).
            layer.evict_in_place(self.victims(layer))
        else:
            self.prune(layer, self.shield(layer, self.decode_score(layer), target), target)
        layer.compressed = True
        return True

    def select(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """Indices `[batch, kv_heads, budget]` (ascending) of the entries to keep: the protected
        ones (`protected()`, and those `shield` set to +inf), then the top-scored. ValueError when
        the protected entries alone exceed `budget`. A `KeptOrder` method at kept_order "topk":
        its original's storage order instead (`topk_order`)."""
        if isinstance(self, KeptOrder) and self.kept_order == "topk":
            return self.topk_order(scores, budget)
        n = scores.shape[-1]
        first, last = self.protected()
        scores = scores.float().clone()
        if first:
            scores[..., :first] = math.inf
        if last:
            scores[..., max(n - last, 0) :] = math.inf
        held = int((scores == math.inf).sum(dim=-1).max()) if n > budget else 0
        if held > budget:
            raise ValueError(
                f"{self.name} protects {held} entries (sinks / window, and protect={self.protect!r}), "
                f"more than its budget: budget must be at least {held}, got budget={budget}"
            )
        # A stable sort, not topk: ties (frequent after max-pooling) go to the earlier position on
        # every device, so selections are reproducible.
        order = scores.sort(dim=-1, descending=True, stable=True).indices
        return order[..., :budget].sort(dim=-1).values

    def compress_prefill(
        self, layer: CompressibleLayer, query: torch.Tensor, key: torch.Tensor, module
    ) -> None:
        """End of prefill (template): the layer's budget, then `compress` (`score`, then `prune`).
        Nothing per layer for a method with its own pass (`OwnPass`: it selects after the pass,
        from every layer's scores); a `KeptOrder` method that `reorders()` a layer holding exactly
        its budget; `prompt_state`: the prompt's statistics dropped after."""
        if isinstance(self, OwnPass):
            return
        budget = self.layer_budget(layer)
        # Short prompts are left uncompressed (the result row says so).
        if budget is not None and layer.stored > budget:
            self.compress(layer, query, key, module, budget)
            layer.compressed = True
        elif layer.stored == budget and isinstance(self, KeptOrder) and self.reorders():
            self.compress(layer, query, key, module, budget)  # nothing dropped: the entries take top-k order
        if self.prompt_state:
            layer.method_state = None

    @property
    def evicts_in_place(self) -> bool:
        """Whether per-step eviction may drop a decode step's one surplus entry in place
        (`CompressibleLayer.evict_in_place`: no copy of the layer): when `prune` is the base
        class's plain top-k keep. A method whose `prune` re-rotates keys or splits the budget
        (StreamingLLM's compacted positions, Ada-KV) takes the ordered path."""
        return type(self).prune is Method.prune

    def victims(self, layer: CompressibleLayer) -> torch.Tensor | int:
        """`[batch, kv_heads]` (or one int: the same slot in every row and head): the entry
        `select(scores, stored - 1)` would drop, found by position rather than by index (in-place
        evictions leave the entries out of position order); see `victim_by_position`."""
        return victim_by_position(
            self.decode_score(layer), layer.positions, layer.seen, self.protected(), layer.protected_span
        )


def victim_by_position(
    scores: torch.Tensor,
    positions: torch.Tensor,
    seen: int,
    protected: tuple[int, int],
    span: tuple[int, int] | None = None,
) -> torch.Tensor:
    """`[..., n]` scores and positions -> `[...]` the slot a per-step eviction drops: the protected
    first / last entries (`protected`, `Method.protected()`) are the oldest / newest positions (the
    protected ones are never evicted, so positions `[0, first)` and `[seen - last, seen)` are all
    present), and those of the protected `span` `[start, end)` (`CompressibleLayer.protected_span`);
    of the lowest-scored of the rest, the newest (the stable sort keeps the earlier of a tie)."""
    first, last = protected
    held = positions >= seen - last
    if first:
        held |= positions < first
    if span is not None:
        held |= (positions >= span[0]) & (positions < span[1])
    s = scores.float().masked_fill(held, math.inf)
    low = s.amin(dim=-1, keepdim=True)
    return torch.where(s == low, positions, -1).argmax(dim=-1)


# ---- scoring helpers -------------------------------------------------------------------------


def grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """`[batch, heads, q, d]` -> `[batch, kv_heads, group, q, d]` (a view: no repeated K/V)."""
    b, h, q, d = query.shape
    return query.view(b, kv_heads, h // kv_heads, q, d)


def reduce_group(x: torch.Tensor, how: str, dim: int = 2) -> torch.Tensor:
    if how == "mean":
        return x.mean(dim)
    if how == "max":
        return x.amax(dim)
    if how == "sum":
        return x.sum(dim)
    raise ValueError(f"gqa_reduce must be one of {GQA_REDUCTIONS}, got gqa_reduce={how!r}")


def softmax_scores(logits: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over the last axis of fp32 logits `[batch, kv_heads, group, q, k]`; `sinks`
    `[heads]` (gpt-oss `s_aux`): one extra logit per query head in the denominator, dropped after
    (the model's own eager attention does the same), so scores are the weights the model used."""
    if sinks is None:
        return logits.softmax(dim=-1)
    b, kv, g, q, _ = logits.shape
    sink = sinks.to(logits.device, logits.dtype).view(1, kv, g, 1, 1).expand(b, kv, g, q, 1)
    return torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]


def soft_cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Attention logit soft-capping (Gemma 2): `softcap * tanh(logits / softcap)`, in place."""
    if softcap:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits


def window_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    window: int,
    scaling: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the last `window` queries over ALL keys, summed over the window queries.

    query `[batch, heads, q>=window, d]`, key `[batch, kv_heads, L, d]` (the last `window` keys are
    the window's own tokens). Softmax in fp32 over the full row, causal inside the window block,
    with the module's logit soft-capping and attention sinks when it has them. Returns
    `[batch, kv_heads, group, L]`; memory `heads x window x L` (never L x L).
    """
    kv_heads, length = key.shape[1], key.shape[2]
    if window == 1:
        # The last query alone (a decode step, TOVA): it sees every key, so no mask; one matmul
        # per KV head for the group's rows (fewer small operations: this runs every layer and step).
        q = grouped(query[:, :, -1:], kv_heads).float().squeeze(3)  # [b, kv, g, d]
        logits = soft_cap(torch.matmul(q, key.float().transpose(-1, -2)) * scaling, softcap)
        return softmax_scores(logits.unsqueeze(3), sinks).squeeze(3)
    q = grouped(query[:, :, -window:], kv_heads).float()
    logits = soft_cap(torch.einsum("bhgqd,bhkd->bhgqk", q, key.float()) * scaling, softcap)
    # Window query i sits at position L-window+i and may not see the window keys after it.
    causal = torch.ones(window, window, dtype=torch.bool, device=key.device).triu(1)
    logits[..., length - window :].masked_fill_(causal, -math.inf)
    return softmax_scores(logits, sinks).sum(dim=-2)


def attention_output(probs: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One query's attention output `[batch, 1, heads, d]` (the model's layout after attention)
    from its softmax row `probs` `[batch, kv_heads, group, L]` (fp32) and `value` `[batch, kv_heads,
    L, d]`: the weighted sum in fp32, cast to `dtype`."""
    b, kv, g, _ = probs.shape
    out = torch.matmul(probs, value.float())  # [b, kv, g, d]
    return out.reshape(b, 1, kv * g, -1).to(dtype)


def pool(scores: torch.Tensor, kernel_size: int, how: str) -> torch.Tensor:
    """Pool along the last (sequence) axis, stride 1, padding kernel//2 (the SnapKV code's pooling,
    `count_include_pad` as in F.avg_pool1d's default); output length = input length."""
    if how == "none" or kernel_size == 1:
        return scores
    shape = scores.shape
    x = scores.reshape(-1, 1, shape[-1])
    if how == "max":
        x = F.max_pool1d(x, kernel_size, stride=1, padding=kernel_size // 2)
    elif how == "avg":
        x = F.avg_pool1d(x, kernel_size, stride=1, padding=kernel_size // 2)
    else:
        raise ValueError(f"pooling must be one of {POOLINGS}, got pooling={how!r}")
    return x[..., : shape[-1]].reshape(shape)


def blockwise_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    value: torch.Tensor | None = None,
    block: int = 256,
    max_block_bytes: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal softmax attention in query blocks: each key's column sum and, given `value`, the output.

    query `[batch, heads, q, d]` at ascending `query_positions` `[q]`; key / value
    `[batch, kv_heads, L, d]` at `key_positions` `[batch, kv_heads, L]` (ascending per head; per-head
    after compression). A query sees the keys whose position is <= its own. `softcap` / `sinks`: the
    module's logit soft-capping and per-head sink logits `[heads]`, applied as its own attention
    does (see `softmax_scores`). Returns the column sums
    `[batch, kv_heads, group, L]` (fp32) and the output `[batch, heads, q, d]` (query dtype) or None.
    Memory: one block of fp32 logits (`max_block_bytes`), never q x L. Default bound: 8 MiB on CPU
    (the block stays in L3: the softmax/sum passes are cache-bound), 256 MiB on GPU; at least 16
    query rows per block.
    """
    b, kv_heads, length, d = key.shape
    nq, g = query.shape[2], query.shape[1] // kv_heads
    if max_block_bytes is None:
        max_block_bytes = 8 * 2**20 if key.device.type == "cpu" else 256 * 2**20
    per_row = max(1, b * kv_heads * g * length * 4)
    block = max(min(16, block), min(block, max_block_bytes // per_row))
    sums = torch.zeros(b, kv_heads, g, length, dtype=torch.float32, device=key.device)
    out = None if value is None else query.new_empty(b, kv_heads, g, nq, value.shape[-1])
    kt, v = key.float().transpose(-1, -2), None if value is None else value.float()
    qg = grouped(query, kv_heads)
    kpos = key_positions.contiguous()
    # Keys visible to each query, per head; sorted positions make both bounds a searchsorted:
    # keys [0, first) are visible to every query of a block (no mask needed), keys past `end` to
    # none (the causal upper triangle is skipped: ~2x less work in prefill).
    seen = torch.searchsorted(kpos, query_positions.expand(b, kv_heads, -1).contiguous(), right=True)
    ends, firsts = seen.amax(dim=(0, 1)), seen.amin(dim=(0, 1))
    for s in range(0, nq, block):
        t = min(s + block, nq)
        first, end = int(firsts[s]), int(ends[t - 1])
        rows = (t - s) * g
        # The group's query heads stacked into one matrix per KV head: [g*rows, d] x [d, end].
        q = qg[:, :, :, s:t].float().reshape(b, kv_heads, rows, d)
        logits = torch.matmul(q, kt[..., :end]).view(b, kv_heads, g, t - s, end).mul_(scaling)
        soft_cap(logits, softcap)
        if first < end:
            hidden = kpos[:, :, None, None, first:end] > query_positions[s:t].view(1, 1, 1, -1, 1)
            logits[..., first:end].masked_fill_(hidden, -math.inf)
        probs = softmax_scores(logits, sinks)  # one fused pass per row (rows fit in cache)
        sums[..., :end] += probs.sum(dim=-2)
        if out is not None:
            pv = torch.matmul(probs.view(b, kv_heads, rows, end), v[:, :, :end])
            out[:, :, :, s:t] = pv.view(b, kv_heads, g, t - s, -1).to(out.dtype)
    return sums, None if out is None else out.view(b, kv_heads * g, nq, -1)


def causal_column_sums(
    query: torch.Tensor,
    key: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    block: int = 256,
    max_block_bytes: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ over queries of each key's causal softmax attention `[batch, kv_heads, group, L]` (fp32),
    in query blocks (see `blockwise_attention`)."""
    return blockwise_attention(
        query, key, query_positions, key_positions, scaling, None, block, max_block_bytes, softcap, sinks
    )[0]
