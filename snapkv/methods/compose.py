"""Methods by composition: a budget policy or a selection rule wrapped around any scorer.

As kvpress composes presses (`AdaKVPress(press)`, `CriticalKVPress(press)`, `ChunkKVPress(press)`
around a `ScorerPress`), PyramidKV's layer pyramid, Ada-KV's head allocation, CriticalKV's two-stage
selection and ChunkKV's chunks are wrappers (`ScorerWrapper` subclasses) that take their per-entry
scores from an inner method, the scorer, and decide only how many entries each layer / head keeps
and which. The scorer is named by `scorer` (default `snapkv`: SnapKV's window vote, what these
methods used in their papers) and may be any registered method whose selection is the base class's
plain score + top-k (`is_scorer`: SnapKV, TOVA, K-norm, Expected Attention, ...).

What the scorer contributes: `score()` `[batch, kv_heads, stored]`, its protected entries
(`protected()`: SnapKV's window, Expected Attention's sinks, TOVA's `keep_last`), the queries its
score needs from the last prefill chunk (`min_last_chunk`), what it accumulates while the prompt is
fed (`observe`: Expected Attention's query statistics) and what it takes from the model
(`post_init_from_model`). What it does not: budgets (the wrapper's; K-norm's `skip_layers` /
`prune_after` are not used) and decode-time eviction (a scorer is built with
`evict_during_decode=False`; the wrapper's own `decode_schedule` compresses while decoding).

Parameters: SnapKV's (`window`, `kernel_size`, `pooling`, `gqa_reduce`, `gqa_order`, `span`) are the
wrappers' own flat fields, as they always were: they configure the `snapkv` scorer, and with another
scorer they must stay at their defaults. Another scorer's parameters are `scorer_params` (a mapping,
e.g. `{"keep_last": True}` for TOVA); its `budget` is the wrapper's. `scorer` and `scorer_params`
are left out of `params()` at their defaults (`snapkv`, empty), so every SnapKV-scored config keeps
its hash; with another scorer, SnapKV's fields are left out instead (they do not run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from snapkv.methods.base import GenerateCheck, KeptOrder, Method, OwnAttention, OwnPass
from snapkv.methods.registry import METHODS, build_method
from snapkv.methods.snapkv import SnapKV

# The flat fields that configure the `snapkv` scorer (SnapKV's own parameters, its budget aside).
SNAPKV_FIELDS = ("window", "kernel_size", "pooling", "gqa_reduce", "gqa_order", "span")


def is_scorer(cls: type) -> bool:
    """Whether a method class can be wrapped: it scores (`score` overridden) and keeps the base
    class's selection (`compress`, `prune`), without a prefill pass of its own (`prefill_attention`,
    an `OwnPass`), running wherever its wrapper runs (`model.generate` too: not a `GenerateCheck`)
    and without being a wrapper itself."""
    return (
        isinstance(cls, type)
        and issubclass(cls, Method)
        and not issubclass(cls, ScorerWrapper)
        and cls.score is not Method.score
        and cls.compress is Method.compress
        and cls.prune is Method.prune
        and not (
            issubclass(cls, OwnAttention) and cls.prefill_attention is not OwnAttention.prefill_attention
        )
        and not issubclass(cls, (OwnPass, GenerateCheck))
    )


def scorers() -> list[str]:
    """Registered methods a wrapper takes as `scorer`, sorted."""
    return sorted(name for name, cls in METHODS.items() if is_scorer(cls))


@dataclass
class ScorerWrapper(Method):
    """A method whose scores come from an inner scorer method (module docstring); subclasses own
    budgets (`layer_budget`, `cache_layer`) and selection (`prune` / `compress`). What the base
    class owns and a scorer declares (`min_last_chunk`, `protected_tail`) comes from the scorer."""

    budget: int | None = 1024
    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"
    gqa_reduce: str = "mean"
    gqa_order: str = "reduce_first"
    span: int | None = None
    # The inner scorer (a registered method, `is_scorer`) and its parameters other than budget;
    # keyword-only, so they never shift positional arguments, and out of `params()` at their defaults.
    scorer: str = field(default="snapkv", kw_only=True)
    scorer_params: dict[str, Any] = field(default_factory=dict, kw_only=True)

    checks = {k: v for k, v in SnapKV.checks.items() if k in ("budget", *SNAPKV_FIELDS)}
    # The scorer's prompt statistics (Expected Attention's) are not needed after the prefill.
    prompt_state = True

    def validate(self) -> None:
        super().validate()
        # Built here, after the wrapper's own checks: the scorer's checks and rules (SnapKV's
        # window < budget) then run on a value the wrapper already accepts field by field.
        self.scorer_method = self.build_scorer()
        scorer, schedule = self.scorer_method, self.decode_schedule
        if schedule.on and (
            type(scorer).compress_decode is not Method.compress_decode
            or (isinstance(scorer, KeptOrder) and scorer.reorders_at_budget)
        ):
            # Its scheduled steps are not the base class's (Expected Attention's statistics of the
            # window's queries, SnapKV-D's reordering of a full cache), and only the scorer's own
            # compress_decode runs them.
            raise ValueError(
                f"{self.name} with scorer={self.scorer!r} cannot take a decode_schedule "
                f"(interval={schedule.interval}): the scorer prepares its own scheduled steps"
            )

    def build_scorer(self) -> Method:
        """The inner scorer, from `scorer`, `scorer_params` and the flat fields (ValueError naming
        a bad scorer, a parameter the scorer does not take, or a flat SnapKV field set for another
        scorer)."""
        names = scorers()
        if self.scorer not in names:
            raise ValueError(f"scorer must be one of {tuple(names)}, got scorer={self.scorer!r}")
        if not isinstance(self.scorer_params, Mapping):
            raise ValueError(f"scorer_params must be a mapping, got scorer_params={self.scorer_params!r}")
        self.scorer_params = dict(self.scorer_params)  # one type in params() and result rows
        own = {"budget", "decode_schedule"} | (set(SNAPKV_FIELDS) if self.scorer == "snapkv" else set())
        clash = sorted(own & set(self.scorer_params))
        if clash:
            raise ValueError(
                f"scorer_params may not set {clash}: they are {self.name}'s own parameters "
                f"(method.{clash[0]}), got scorer_params={self.scorer_params!r}"
            )
        if self.scorer == "snapkv":
            params = {k: getattr(self, k) for k in SNAPKV_FIELDS}
        else:
            defaults = {f.name: f.default for f in dataclasses.fields(type(self))}
            for k in SNAPKV_FIELDS:
                if getattr(self, k) != defaults[k]:
                    raise ValueError(
                        f"{k} is a parameter of the snapkv scorer, not of scorer={self.scorer!r}: leave it "
                        f"at {defaults[k]!r} (its own parameters go in scorer_params), got {k}={getattr(self, k)!r}"
                    )
            params = {}
        if self.scorer_params.get("kept_order", "position") != "position":
            # The wrapper gathers what it keeps itself, ascending by position.
            raise ValueError(
                f"{self.name} stores its kept entries in position order: scorer_params.kept_order "
                f"must be 'position', got kept_order={self.scorer_params['kept_order']!r}"
            )
        cls = METHODS[self.scorer]
        if "evict_during_decode" in cls.__dataclass_fields__:
            # The wrapper compresses once at the end of prefill (or on its own decode_schedule).
            if self.scorer_params.get("evict_during_decode", False) is not False:
                raise ValueError(
                    f"{self.name} evicts only at the end of prefill or on its decode_schedule: "
                    f"scorer_params.evict_during_decode must be false, got "
                    f"evict_during_decode={self.scorer_params['evict_during_decode']!r}"
                )
            params["evict_during_decode"] = False
        return build_method(self.scorer, **{**params, **self.scorer_params, "budget": self.budget})

    def params(self) -> dict[str, Any]:
        params = super().params()
        if self.scorer == "snapkv":
            params.pop("scorer")  # the default: the hash of every config written before it existed
        else:
            for k in SNAPKV_FIELDS:  # at their defaults (validate): not what this config runs
                params.pop(k)
        if not self.scorer_params:
            params.pop("scorer_params")
        return params

    @classmethod
    def upgrade_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        upgraded = super().upgrade_params(params)
        if params.get("scorer", "snapkv") != "snapkv":
            # Another scorer's rows name no SnapKV field (`params`), and no legacy SnapKV value ran.
            upgraded = {k: v for k, v in upgraded.items() if k not in SNAPKV_FIELDS or k in params}
        return upgraded

    # ---- the scorer's part -------------------------------------------------------------------
    def post_init_from_model(self, model) -> None:
        self.scorer_method.post_init_from_model(model)

    @property
    def min_last_chunk(self) -> int:
        return self.scorer_method.min_last_chunk

    def protected(self) -> tuple[int, int]:
        return self.scorer_method.protected()

    def protected_tail(self, question: int, generation_prompt: int) -> int:
        # The scorer's `protect` (its default, or scorer_params.protect) holds inside the wrapper too:
        # kvpress' AdaKVPress(KnormPress) never compresses the generation prompt either.
        return max(
            super().protected_tail(question, generation_prompt),
            self.scorer_method.protected_tail(question, generation_prompt),
        )

    def observe(self, layer, query: torch.Tensor, key: torch.Tensor, module) -> None:
        self.scorer_method.observe(layer, query, key, module)

    def score(self, layer, query: torch.Tensor, key: torch.Tensor, module) -> torch.Tensor:
        return self.scorer_method.score(layer, query, key, module)

    def protected_entries(self) -> str:
        """How the error messages name the protected entries: `window=32` for the snapkv scorer."""
        first, last = self.protected()
        if self.scorer == "snapkv":
            return f"window={self.window}"
        return f"{first + last} protected entries of scorer {self.scorer}"
