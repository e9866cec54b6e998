"""Noise on a shared machine, measured: CPU that other processes used while a timing ran, load
average, thread settings; and the median / IQR summaries the benchmark and the report print.

A timing on a shared node is only as good as the CPU it had to itself. `CpuNoise` reads the
machine-wide busy time (`/proc/stat` through psutil: every CPU's user + nice + system + irq +
softirq + steal) and this process's own CPU time (all its threads) at the start and the end of a
block; the difference is what *other* processes (and the hypervisor, `steal`) used meanwhile:

    other_cpu_s = Δ machine busy - Δ own CPU       other_cores = other_cpu_s / Δ wall

`other_cores` is the mean number of cores others kept busy (0 on a quiet machine, up to the core
count). A measurement above a threshold is flagged, not silently averaged in.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import psutil

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")


def _busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


def _own_cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()  # all threads of this process
    return t.user + t.system


@dataclass
class CpuNoise:
    """Context manager: CPU used by other processes while the block ran (see module doc).

    After the block: `wall_s`, `own_cpu_s` (this process, all threads), `other_cpu_s`,
    `other_cores` (= other_cpu_s / wall_s), `load_start` / `load_end` (1-minute load average).
    """

    wall_s: float = 0.0
    own_cpu_s: float = 0.0
    other_cpu_s: float = 0.0
    other_cores: float = 0.0
    load_start: float = 0.0
    load_end: float = 0.0
    _start: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0), repr=False)

    def __enter__(self) -> CpuNoise:
        self._proc = psutil.Process()
        self.load_start = os.getloadavg()[0]
        self._start = (time.perf_counter(), _busy_s(), _own_cpu_s(self._proc))
        return self

    def __exit__(self, *exc) -> None:
        t1, busy1, own1 = time.perf_counter(), _busy_s(), _own_cpu_s(self._proc)
        t0, busy0, own0 = self._start
        self.wall_s = t1 - t0
        self.own_cpu_s = own1 - own0
        # Clamped at 0: /proc/stat and the per-process counters tick at different moments.
        self.other_cpu_s = max(0.0, (busy1 - busy0) - self.own_cpu_s)
        self.other_cores = self.other_cpu_s / self.wall_s if self.wall_s > 0 else 0.0
        self.load_end = os.getloadavg()[0]

    def fields(self) -> dict[str, float]:
        return {
            "wall_s": self.wall_s,
            "own_cpu_s": self.own_cpu_s,
            "other_cpu_s": self.other_cpu_s,
            "other_cores": self.other_cores,
            "load_start": self.load_start,
            "load_end": self.load_end,
        }


class PhaseProbe:
    """Context manager: per-forward CPU time and noise of a model, split into prefill (forwards of
    more than one token per row) and decode (one token) with forward hooks.

    Fields: `prefill_cpu_s` (this process's CPU over the prefill forwards, all threads),
    `tpot_cpu_s` (median CPU per decode forward), `prefill_other_cores` / `decode_other_cores`
    (cores other processes kept busy during those forwards). With one thread a forward's CPU time is
    its work: other processes that take the core away lengthen the wall time, not this.
    """

    def __init__(self, model):
        self.model = model
        self.calls: list[tuple[int, float, float, float]] = []  # (tokens, wall, own cpu, other cpu)

    def _pre(self, module, args, kwargs) -> None:
        self._start = (time.perf_counter(), time.process_time(), _busy_s())

    def _post(self, module, args, kwargs, output) -> None:
        t0, c0, b0 = self._start
        wall, own = time.perf_counter() - t0, time.process_time() - c0
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens = ids.shape[-1] if ids is not None else 0
        self.calls.append((tokens, wall, own, max(0.0, _busy_s() - b0 - own)))

    def __enter__(self) -> PhaseProbe:
        self._handles = [
            self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.model.register_forward_hook(self._post, with_kwargs=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def fields(self) -> dict[str, float | None]:
        pre = [c for c in self.calls if c[0] > 1]
        dec = [c for c in self.calls if c[0] == 1]

        def cores(calls) -> float | None:
            wall = sum(c[1] for c in calls)
            return sum(c[3] for c in calls) / wall if wall > 0 else None

        tpot = spread(c[2] for c in dec)
        return {
            "prefill_cpu_s": sum(c[2] for c in pre) if pre else None,
            "tpot_cpu_s": tpot.median if tpot else None,
            "prefill_other_cores": cores(pre),
            "decode_other_cores": cores(dec),
        }


def thread_settings() -> dict[str, str | int]:
    """Thread settings that change CPU timings: torch's intra-op threads and the OpenMP/MKL
    environment (empty string: unset)."""
    import torch

    out: dict[str, str | int] = {"torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count() or 0}
    out.update({k.lower(): os.environ.get(k, "") for k in THREAD_ENV})
    return out


@dataclass(frozen=True)
class Spread:
    """Median and interquartile range of a sample (linear-interpolation quartiles, numpy's default)."""

    median: float
    q1: float
    q3: float
    n: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def rel_iqr(self) -> float:
        """IQR / median: the noise figure printed beside a median."""
        return self.iqr / self.median if self.median else math.nan

    def meets(self, target: float, direction: str) -> bool:
        """Whether the whole IQR lies on the right side of `target` (`direction` "<=" or ">=")."""
        if direction == "<=":
            return self.q3 <= target
        if direction == ">=":
            return self.q1 >= target
        raise ValueError(f"direction must be '<=' or '>=', got direction={direction!r}")


def _quantile(sorted_xs: Sequence[float], p: float) -> float:
    pos = p * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def spread(values: Iterable[float | None]) -> Spread | None:
    """Median and quartiles of the finite values (None when there are none)."""
    xs = sorted(float(v) for v in values if v is not None and math.isfinite(float(v)))
    if not xs:
        return None
    return Spread(_quantile(xs, 0.5), _quantile(xs, 0.25), _quantile(xs, 0.75), len(xs))


def timing_summary(rows, by: Sequence[str] = ("config_label",), columns: Sequence[str] | None = None):
    """Per-group medians of the timing columns of result rows, each with its noise figure beside it.

    rows: a pandas DataFrame of result rows (harness rows or benchmark rows). For every column in
    `columns` (default: those of prefill_s / ttft_s / tpot_s present) the table holds `<col>_median`
    and `<col>_iqr_pct` (IQR / median, %: how much the repeated measurements disagree), plus `n`
    (ok rows) and, where the rows carry it (benchmark rows; harness rows since the runner records
    it), `other_cores_median`: the cores other processes kept busy meanwhile (NaN when no row of the
    group has it). Timings in harness rows are bookkeeping: print them only with these figures
    beside them (eval/report.py's cost table does).
    """
    import pandas as pd

    columns = [c for c in (columns or ("prefill_s", "ttft_s", "tpot_s")) if c in rows.columns]
    ok = rows[rows["status"] == "ok"] if "status" in rows.columns else rows
    out = []
    for key, g in ok.groupby(list(by), sort=True):
        rec = dict(zip(by, key if isinstance(key, tuple) else (key,)))
        rec["n"] = len(g)
        for c in columns:
            s = spread(g[c])
            rec[f"{c}_median"] = s.median if s else math.nan
            rec[f"{c}_iqr_pct"] = 100 * s.rel_iqr if s else math.nan
        if "other_cores" in g.columns:
            s = spread(g["other_cores"])
            rec["other_cores_median"] = s.median if s else math.nan
        out.append(rec)
    return pd.DataFrame(out)
