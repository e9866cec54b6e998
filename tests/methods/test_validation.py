"""A bad parameter names itself: `build_method` raises a ValueError whose message holds the
offending value (or the rule it breaks), for every method and switch, before any model is loaded.

Errors that need more than the parameters (a model, a cache, a padded batch) are tested beside
their method."""

from __future__ import annotations

import re

import pytest
from method_catalogue import NOT_SCHEDULABLE

from snapkv import build_method

# (method, keyword arguments, regex the message must match)
CASES = [
    # SnapKV and the window / pooling / GQA switches it shares with its family
    ("snapkv", dict(budget=16, window=16), "window"),
    ("snapkv", dict(budget=16, window=0), "window=0"),
    ("snapkv", dict(budget=64, pooling="median"), "median"),
    ("snapkv", dict(budget=64, kernel_size=0), "kernel_size=0"),
    ("snapkv", dict(budget=64, gqa_reduce="min"), "min"),
    ("snapkv", dict(budget=64, gqa_order="first"), "gqa_order='first'"),
    ("snapkv", dict(budget=-3), "budget=-3"),
    ("snapkv", dict(budget=64, windw=4), "windw"),  # a misspelt parameter
    *[("snapkv", dict(span=bad), re.escape(f"span={bad!r}")) for bad in (0, -2, 2.5, "8")],
    # `protect`, on every method; StreamingLLM's cache is its sinks and recent tokens alone
    ("snapkv", dict(budget=64, protect="all"), "protect='all'"),
    ("knorm", dict(budget=64, protect=None), "protect=None"),
    ("full", dict(protect="answer"), "protect='answer'"),
    ("streamingllm", dict(budget=64, protect="generation_prompt"), "protect='generation_prompt'"),
    # H2O, StreamingLLM
    ("h2o", dict(budget=8, recent=8), "recent=8"),
    ("streamingllm", dict(budget=4, n_sink=4), "n_sink=4"),
    ("streamingllm", dict(budget=64, positions="shifted"), "shifted"),
    # PyramidKV
    ("pyramidkv", dict(budget=30, window=16), "budget too small"),
    ("pyramidkv", dict(budget=30, window=16, beta=20), "budget=30"),
    ("pyramidkv", dict(budget=64, beta=0.5), "beta=0.5"),
    ("pyramidkv", dict(budget=None), "budget=None"),
    ("pyramidkv", dict(budget=16, window=16), "window"),
    ("pyramidkv", dict(budget=64, schedule="round"), "schedule='round'"),
    ("pyramidkv", dict(budget=64, short_prompt="pad"), "short_prompt='pad'"),
    # Ada-KV
    ("adakv", dict(budget=64, alpha=1.5), "alpha=1.5"),
    ("adakv", dict(budget=64, layout="ragged"), "ragged"),
    ("adakv", dict(budget=64, base="h2o"), "base='h2o'"),
    ("adakv", dict(budget=64, normalize="yes"), "normalize"),
    ("adakv", dict(budget=64, normalize="mass"), "normalize='mass'"),
    ("adakv", dict(budget=64, normalize=1), "normalize=1"),
    ("adakv", dict(budget=64, allocation="fair"), "allocation='fair'"),
    ("adakv", dict(budget=20, window=8, base="pyramidkv"), "budget too small"),
    ("adakv", dict(budget=64, floor=0.2), "floor"),
    # CriticalKV
    ("criticalkv", dict(budget=64, base="h2o"), "base='h2o'"),
    ("criticalkv", dict(budget=64, first_stage_ratio=1.5), "first_stage_ratio=1.5"),
    ("criticalkv", dict(budget=64, epsilon=-1.0), "epsilon=-1.0"),
    ("criticalkv", dict(budget=64, base="adakv", allocation="even"), "allocation='even'"),
    ("criticalkv", dict(budget=16, window=16), "window"),
    # Expected Attention
    ("expected_attention", dict(budget=4, n_sink=4), "n_sink=4"),
    ("expected_attention", dict(budget=64, n_future_positions=0), "n_future_positions=0"),
    ("expected_attention", dict(budget=64, epsilon=-0.1), "epsilon=-0.1"),
    ("expected_attention", dict(budget=64, use_vnorm="yes"), "use_vnorm='yes'"),
    ("adakv_expected_attention", dict(budget=64, alpha=2), "alpha=2"),
    ("adakv_expected_attention", dict(budget=64, layout="ragged"), "layout='ragged'"),
    # TOVA
    ("tova", dict(budget=40, keep_last="yes"), "keep_last='yes'"),
    ("tova", dict(budget=40, evict_during_decode=1), "evict_during_decode=1"),
    ("tova", dict(budget=None), "budget=None"),
    # K-norm
    ("knorm", dict(budget=40, skip_layers=0), "skip_layers=0"),
    ("knorm", dict(budget=40, skip_layers=[-1]), r"skip_layers=\[-1\]"),
    ("knorm", dict(budget=40, prune_after=-2), "prune_after=-2"),
    ("knorm", dict(budget=40, evict_during_decode="yes"), "evict_during_decode='yes'"),
    ("knorm", dict(budget=None), "budget=None"),
    ("knorm", dict(budget=40, keep_ratio=0), "keep_ratio=0"),
    ("knorm", dict(budget=40, keep_ratio=1.5), "keep_ratio=1.5"),
    ("knorm", dict(budget=40, keep_ratio=True), "keep_ratio=True"),
    # ChunkKV
    ("chunkkv", dict(budget=40, window=8, chunk_length=0), "chunk_length=0"),
    ("chunkkv", dict(budget=40, window=8, chunk_length=40), "chunk_length=40"),  # 40 > budget - window
    ("chunkkv", dict(budget=40, window=8, chunk_score="max"), "chunk_score='max'"),
    ("chunkkv", dict(budget=40, window=8, reuse_layers=0), "reuse_layers=0"),
    ("chunkkv", dict(budget=None, window=8), "budget=None"),
    # The scorer inside a wrapper (snapkv.methods.compose)
    *[
        (name, dict(budget=64, scorer="h2o"), "scorer='h2o'")
        for name in ("pyramidkv", "adakv", "criticalkv", "chunkkv")
    ],
    ("adakv", dict(budget=64, scorer="pyramidkv"), "scorer='pyramidkv'"),  # a wrapper is not a scorer
    ("adakv", dict(budget=64, scorer="tova", window=16), "window=16"),  # SnapKV's, not TOVA's
    ("pyramidkv", dict(budget=64, scorer="knorm", kernel_size=5), "kernel_size=5"),
    ("adakv", dict(budget=64, scorer="tova", scorer_params=dict(keep_lst=True)), "keep_lst"),
    ("adakv", dict(budget=64, scorer="tova", scorer_params=dict(keep_last="yes")), "keep_last='yes'"),
    ("chunkkv", dict(budget=64, scorer="tova", scorer_params=dict(budget=8)), "budget"),
    ("chunkkv", dict(budget=64, scorer_params=dict(window=8)), "window"),  # a flat field of the snapkv scorer
    (
        "criticalkv",
        dict(budget=64, scorer="knorm", scorer_params=dict(evict_during_decode=True)),
        "evict_during_decode",
    ),
    ("criticalkv", dict(budget=64, scorer="tova", scorer_params=[("keep_last", True)]), "scorer_params"),
    ("pyramidkv", dict(budget=4, scorer="expected_attention"), "n_sink=4"),  # the scorer's own rule
    ("pyramidkv", dict(budget=20, scorer="expected_attention", beta=20), "budget too small"),  # 4 sinks + 20
    (
        "chunkkv",
        dict(budget=12, scorer="expected_attention", chunk_length=10),
        "chunk_length=10",
    ),  # 4 sinks + 10
    (
        "pyramidkv",
        dict(budget=64, scorer="expected_attention", decode_schedule=dict(interval=4)),
        "scorer='expected_attention'",
    ),
    # Decode schedules
    ("snapkv", dict(budget=64, decode_schedule=dict(interval=-1)), "interval=-1"),
    ("snapkv", dict(budget=64, decode_schedule=dict(interval=2.5)), "interval=2.5"),
    ("snapkv", dict(budget=64, decode_schedule=dict(interval=4, buffer=-2)), "buffer=-2"),
    ("snapkv", dict(budget=64, decode_schedule=dict(interval=4, target=0)), "target=0"),
    ("snapkv", dict(budget=64, decode_schedule=dict(interval=4, target=1.0)), "target=1.0"),
    ("snapkv", dict(budget=64, decode_schedule=dict(interval=4, target=32)), "target=32"),  # <= the window
    ("snapkv", dict(budget=64, decode_schedule=dict(interval=4, window=0)), "window=0"),
    # < window=8: R-KV's scores need the window's queries (SnapKV's family may vote with fewer)
    ("snapkv_d", dict(budget=64, decode_schedule=dict(interval=4, window=4)), "window=4"),
    ("snapkv", dict(budget=64, decode_schedule=dict(interval=4, count_from="end")), "count_from='end'"),
    # Storage order of kept entries
    ("snapkv", dict(budget=64, kept_order="slot"), "kept_order='slot'"),
    ("snapkv_d", dict(budget=64, kept_order="score"), "kept_order='score'"),
    ("rkv", dict(budget=64, kept_order=None), "kept_order=None"),
    ("pyramidkv", dict(budget=64, kept_order="topk"), r"unknown parameter.*kept_order"),
    ("adakv", dict(budget=64, kept_order="topk"), r"unknown parameter.*kept_order"),
    ("chunkkv", dict(budget=64, kept_order="topk"), r"unknown parameter.*kept_order"),
    # a wrapper stores its own selection in position order: the scorer's storage order cannot apply
    ("adakv", dict(budget=64, scorer_params=dict(kept_order="topk")), "kept_order='topk'"),
    # Top-k order votes with the tokens appended since the last compression only: 32 > interval 4
    ("snapkv", dict(budget=64, kept_order="topk", decode_schedule=dict(interval=4)), "interval=4"),
    (
        "snapkv",
        dict(budget=64, kept_order="topk", decode_schedule=dict(interval=4, window=8)),
        "decode_schedule.window=8",
    ),
    ("snapkv", dict(budget=64, decode_schedule=dict(intervall=4)), "intervall"),
    ("snapkv", dict(budget=64, decode_schedule=64), "decode_schedule=64"),
    ("tova", dict(budget=64, decode_schedule=dict(interval=4)), "evict_during_decode"),
    (
        "knorm",
        dict(budget=64, evict_during_decode=True, decode_schedule=dict(interval=4)),
        "evict_during_decode",
    ),
    *[
        (
            name,
            {**({} if name == "full" else dict(budget=64)), "decode_schedule": dict(interval=4)},
            "interval=4",
        )
        for name in sorted(NOT_SCHEDULABLE)
    ],
    # An unknown method
    ("pyramid", dict(), "pyramid"),
]


def _id(case) -> str:
    """`name-key=value-...`, nested dicts flattened (`decode_schedule.interval=4`)."""
    name, params, _ = case

    def items(d, prefix=""):
        for k, v in d.items():
            yield from items(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}={v!r}"]

    return "-".join([name, *items(params)])


@pytest.mark.parametrize("name,params,bad", CASES, ids=[_id(c) for c in CASES])
def test_a_bad_parameter_raises_a_value_error_naming_it(name, params, bad):
    with pytest.raises(ValueError, match=bad):
        build_method(name, **params)
