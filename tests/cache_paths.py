"""The distinct cache paths a compressed generation of the catalogue takes, and which cases of the
catalogue x architecture matrices run in the fast tier.

The fast tier runs every catalogue entry on `FULL_ARCH` and, on every architecture, the entry that
represents each path (`REPRESENTATIVES`): every method and every (path, architecture) pair stays
covered. The rest of the cross product is marked `slow` (the e2e tier, `pytest -m slow`) and runs
there with the same assertions. The per-method matrices of rollback and left-padded rows are split
the same way. `tests/test_core.py` checks the coverage, and each representative's
case checks that its run really took the path (`assert_takes_its_paths`), so the split cannot rot
when a method, a layout or an entry changes. StreamingLLM's compacted positions (not a catalogue entry) and
left-padded rows have matrices of their own (tests/test_rollback.py, tests/test_padding.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from method_catalogue import CATALOGUE, W

import snapkv.hooks as hooks
from snapkv.headwise import LAYOUTS

# What a compressed generation's cache does: its storage after the prefill's compression (one of
# the first four) and what decoding does to it (either of the last two, or neither).
PATHS = (
    "uniform",  # every compressible layer and head keeps one length
    "per_layer",  # compressible layers keep different lengths: a mask per layer
    *(f"per_head_{layout}" for layout in LAYOUTS),  # heads keep different lengths (snapkv.headwise)
    "decode_eviction",  # entries evicted while decoding
    "decode_schedule",  # scheduled compressions while decoding
)
FULL_ARCH = "llama"  # every catalogue entry runs on it in the fast tier
REPRESENTATIVES = {
    "uniform": ("snapkv", dict(budget=40, window=W, kernel_size=5)),
    "per_layer": ("pyramidkv", dict(budget=40, window=W, kernel_size=5)),
    "per_head_padded": ("adakv", dict(budget=40, window=W, layout="padded")),
    "per_head_varlen": ("adakv", dict(budget=40, window=W, layout="varlen")),
    "decode_eviction": ("h2o", dict(budget=40, evict_during_decode=True)),
    "decode_schedule": (
        "snapkv",
        dict(budget=40, window=W, kernel_size=5, decode_schedule=dict(interval=2, target=36)),
    ),
}
# The tiny Gemma 3 has one full-attention layer, the only one compressed: no other to differ from.
UNREACHABLE = {("per_layer", "gemma3")}
# Each representative's position in CATALOGUE (lists built by `catalogue(budget=...)` keep its order).
REPRESENTATIVE_INDEX = {path: CATALOGUE.index(entry) for path, entry in REPRESENTATIVES.items()}


def is_fast(arch: str, index: int) -> bool:
    """Whether the case of `arch` and the entry at `index` (CATALOGUE's order) runs in the fast tier."""
    return arch == FULL_ARCH or index in REPRESENTATIVE_INDEX.values()


def tier(arch: str, index: int) -> tuple:
    """The marks of that case: none in the fast tier, `slow` otherwise."""
    return () if is_fast(arch, index) else (pytest.mark.slow,)


def entry_tier(arch: str, name: str, params: dict) -> tuple:
    """`tier` for a matrix over entries of its own: the case runs in the fast tier on FULL_ARCH, or
    where the entry is a path's representative."""
    fast = arch == FULL_ARCH or (name, params) in REPRESENTATIVES.values()
    return () if fast else (pytest.mark.slow,)


def fast_cases(cases: list) -> list[tuple]:
    """(arch, name, params) of the fast cases of a matrix of `pytest.param(arch, ..., name, params)`."""
    return [
        (p.values[0], p.values[-2], p.values[-1]) for p in cases if not any(m.name == "slow" for m in p.marks)
    ]


@contextlib.contextmanager
def recording_caches() -> Iterator[list]:
    """Collect, in the yielded list, the caches of the sessions that compress meanwhile."""
    caches: list = []
    original = hooks.Session.after_attention

    def spy(self, module, layer, query, key):
        if not any(cache is self.cache for cache in caches):
            caches.append(self.cache)
        return original(self, module, layer, query, key)

    hooks.Session.after_attention = spy
    try:
        yield caches
    finally:
        hooks.Session.after_attention = original


def taken_paths(cache, method) -> frozenset[str]:
    """The paths a generation took, read off its cache at the end: the storage (lengths per layer,
    per head) and what decoding did (a decode schedule's compressions evict too: eviction counts as
    the per-step path only where the method evicts at every step)."""
    layers = [layer for _, layer in cache.compressible_layers()]
    paths = {f"per_head_{layer.layout}" for layer in layers if layer.per_head}
    if not paths:
        paths.add("per_layer" if len({layer.stored for layer in layers}) > 1 else "uniform")
    if method.decode_schedule.per_step and any(layer.decode_evicted for layer in layers):
        paths.add("decode_eviction")
    if any(layer.decode_compressions for layer in layers):
        paths.add("decode_schedule")
    return frozenset(paths)


def assert_takes_its_paths(arch: str, name: str, params: dict, cache, method) -> None:
    """Where (name, params) represents a path, the run on `arch` took it (or, where the path is
    out of the architecture's reach, did not)."""
    taken = taken_paths(cache, method)
    for path, entry in REPRESENTATIVES.items():
        if entry == (name, params):
            assert (path in taken) == ((path, arch) not in UNREACHABLE), (path, arch, sorted(taken))
