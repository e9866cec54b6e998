"""Throughput ratios of a serving benchmark's points (the CSVs of `scripts/bench_serving.py`): each
eviction config against the full cache at the same arrival process, concurrency and round. A leaf
shared by the benchmark (its summary and figures) and the results page, which reads the CSVs
without loading the benchmark."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def ratios(points: Sequence[dict[str, Any]], column: str = "tokens_per_s") -> dict[tuple[str, int, str], dict[int, float]]:  # fmt: skip
    """{(arrival, concurrency, config): {round: config's `column` / the full cache's}}: each ratio
    from two points of the same round (configurations interleaved within a round)."""
    full = {
        (p["arrival"], p["concurrency"], p["round"]): p[column]
        for p in points
        if p["config"] == "full" and p.get(column)
    }
    out: dict[tuple[str, int, str], dict[int, float]] = {}
    for p in points:
        den = full.get((p["arrival"], p["concurrency"], p["round"]))
        if p["config"] == "full" or not den or p.get(column) is None:
            continue
        out.setdefault((p["arrival"], p["concurrency"], p["config"]), {})[p["round"]] = p[column] / den
    return out
