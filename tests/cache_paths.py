"""The distinct cache paths a compressed generation of the catalogue takes, and which cases of the
catalogue x architecture matrices run in the fast tier.

The fast tier runs, on `FULL_ARCH`, one entry per mechanism of the catalogue (`mechanism`: a method,
or a wrapper around another method's scorer) and, on every architecture, the entry that represents
each path (`REPRESENTATIVES`): every method, every composition and every (path, architecture) pair
stays covered. The other entries of a method are its switches: they change which entries its scores
keep, which tests/methods/ checks against the original's code for every switch in the fast tier,
while the cache plumbing they go through (storage, own attention, own pass, decode-time eviction)
is the method's own and the path's, run by the kept entries. The rest of the cross product is
marked `slow` (`pytest -m slow`) and runs there with the same assertions. The per-method matrices
of rollback and left-padded rows, and the catalogue-wide tests on one architecture, are split the
same way. `tests/test_core.py` checks the coverage, and each representative's case checks that its
run really took the path (`assert_takes_its_paths`), so the split cannot rot when a method, a
layout or an entry changes. StreamingLLM's compacted positions (not a catalogue entry) and
left-padded rows have matrices of their own (tests/test_rollback.py, tests/test_padding.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
from method_catalogue import CATALOGUE, W, ids

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
FULL_ARCH = "llama"  # one entry per mechanism runs on it in the fast tier
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


def mechanism(name: str, params: dict) -> tuple[str, str | None]:
    """What an entry runs beyond its switches: the method, and the scorer a wrapper (PyramidKV,
    Ada-KV, CriticalKV, ChunkKV) runs inside it (snapkv.methods.compose)."""
    return name, params.get("scorer")


def variants(entries: list[tuple[str, dict]]) -> set[int]:
    """Indices of the entries whose mechanism an earlier entry of `entries` already runs."""
    seen, out = set(), set()
    for i, (name, params) in enumerate(entries):
        key = mechanism(name, params)
        if key in seen:
            out.add(i)
        seen.add(key)
    return out


# Catalogue entries that are a further switch setting of a mechanism and no path's representative.
VARIANT_INDEX = variants(CATALOGUE) - set(REPRESENTATIVE_INDEX.values())


def is_fast(arch: str, index: int) -> bool:
    """Whether the case of `arch` and the entry at `index` (CATALOGUE's order; an index past its end
    is an entry of the test's own) runs in the fast tier."""
    return index in REPRESENTATIVE_INDEX.values() or (arch == FULL_ARCH and index not in VARIANT_INDEX)


def tier(arch: str, index: int) -> tuple:
    """The marks of that case: none in the fast tier, `slow` otherwise."""
    return () if is_fast(arch, index) else (pytest.mark.slow,)


def entry_tier(arch: str, name: str, params: dict, entries: list[tuple[str, dict]] = CATALOGUE) -> tuple:
    """`tier` for a matrix over `entries` of its own: the case runs in the fast tier where the entry
    is a path's representative, or on FULL_ARCH where it is the first entry of its mechanism."""
    first = (name, params) in entries and entries.index((name, params)) not in variants(entries)
    fast = (name, params) in REPRESENTATIVES.values() or (arch == FULL_ARCH and first)
    return () if fast else (pytest.mark.slow,)


def catalogue_cases(entries: list[tuple[str, dict]] = CATALOGUE) -> list:
    """`pytest.param(name, params)` of catalogue `entries` for a test on FULL_ARCH alone, tiered by
    `entry_tier` (the first entry of each mechanism and the paths' representatives fast)."""
    return [
        pytest.param(name, params, id=case, marks=entry_tier(FULL_ARCH, name, params))
        for (name, params), case in zip(entries, ids(entries))
    ]


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
