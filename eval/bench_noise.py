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


class Reference:
    """A fixed workload timed right beside the measured work: a forward of `tokens` fixed random
    token ids through the same model, no cache, `logits_to_keep=1`, with no compression session
    current (`snapkv.hooks.suspended`), so it touches nothing the measured generation holds.

    Why: on a shared VM the same work's CPU time drifts 20-35% within seconds and between
    processes (memory bandwidth and cache other tenants take show in no counter of this guest).
    A forward of the same model timed next to it drifts with it; measured here on 2 vCPUs with a
    single-threaded job on the other core:
    - decode (16-token reference after each step): the same full@512 step's raw medians spanned
      65.7-88.1 ms over four processes, the step over its reference 0.635-0.668;
    - prefill (after each of the 30 layers of an 8K prefill, six processes, three of them with a
      bursty third process): raw 49.9-53.4 CPU-s; in units of a 16-token reference 377-391 (3.6%,
      the burst shifting it up), of a 128-token reference 134.1-136.9 (2.1%, the burst not) -- a
      prefill is compute-bound GEMMs, and a longer reference is the same kind of work.
    `PhaseProbe` runs one after every decode step and one after every decoder layer of a prefill;
    a time divided by its neighbour reference is in "reference units", and the ratio of two
    configurations in those units cancels the machine's speed at the moments each one ran.
    """

    def __init__(self, model, vocab: int, tokens: int = 16, seed: int = 0):
        import torch

        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"reference tokens must be a positive integer, got tokens={tokens!r}")
        self.model, self.tokens = model, tokens
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(min(100, vocab - 1), vocab, (1, tokens), generator=gen).to(model.device)

    def run(self) -> tuple[float, float, float]:
        """Time one reference forward: (wall s, this process's CPU s, machine busy s)."""
        import torch

        from snapkv.hooks import suspended

        t0, c0, b0 = time.perf_counter(), time.process_time(), _busy_s()
        with suspended(), torch.inference_mode():
            self.model(input_ids=self.ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t0, time.process_time() - c0, _busy_s() - b0


@dataclass
class _Call:
    """One top-level forward as PhaseProbe saw it, the reference forwards it ran taken off."""

    tokens: int
    wall: float
    own: float
    other: float
    layers: list[tuple[float, float]] = field(default_factory=list)  # (layer CPU s, its reference's CPU s)
    ref_wall: float = 0.0  # wall time of the reference forwards run inside this call's span
    ref_cpu: float | None = None  # decode: CPU of the reference run right after it


class PhaseProbe:
    """Context manager: per-forward CPU time and noise of a model, split into prefill (forwards of
    more than one token per row) and decode (one token) with forward hooks.

    Fields: `prefill_cpu_s` (this process's CPU over the prefill forwards, all threads),
    `tpot_cpu_s` (median CPU per decode forward), `prefill_other_cores` / `decode_other_cores`
    (cores other processes kept busy during those forwards). With one thread a forward's CPU time is
    its work: other processes that take the core away lengthen the wall time, not this.

    With references (`Reference`): `prefill_reference` runs after every decoder layer of a prefill
    forward, `decode_reference` after every decode forward, and the fields add `prefill_ref` (the
    prefill in reference units: each layer's CPU over its own reference's, summed, plus the rest
    of the forward over the median reference), `tpot_ref` (median over decode steps of step CPU /
    the next reference's CPU), `ref_prefill_cpu_s` / `ref_decode_cpu_s` (median reference CPU) and
    `ref_prefill_tokens` / `ref_decode_tokens`. Every other field has the references' time taken
    off; `ref_wall(phase)` is their wall time inside the prefill, or inside each decode step, for
    the caller to take off its own clocks.
    """

    def __init__(
        self, model, prefill_reference: Reference | None = None, decode_reference: Reference | None = None
    ):
        self.model = model
        self.prefill_reference, self.decode_reference = prefill_reference, decode_reference
        self.calls: list[_Call] = []
        self._busy = False  # a reference forward is running: every hook stands aside

    def _pre(self, module, args, kwargs) -> None:
        if self._busy:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._tokens = ids.shape[-1] if ids is not None else 0
        self._layers: list[tuple[float, float]] = []
        self._taken = [0.0, 0.0, 0.0]  # reference (wall, cpu, busy) inside this call
        self._start = (time.perf_counter(), time.process_time(), _busy_s())

    def _post(self, module, args, kwargs, output) -> None:
        if self._busy:
            return
        t0, c0, b0 = self._start
        tw, tc, tb = self._taken
        wall, own = time.perf_counter() - t0 - tw, time.process_time() - c0 - tc
        other = max(0.0, _busy_s() - b0 - tb - own)
        call = _Call(self._tokens, wall, own, other, self._layers, ref_wall=tw)
        self.calls.append(call)
        if self.decode_reference is not None and call.tokens == 1:
            w, c, _ = self._run_reference(self.decode_reference)
            call.ref_wall, call.ref_cpu = w, c

    def _layer_pre(self, module, args, kwargs) -> None:
        if not self._busy and self._tokens > 1:
            self._layer_start = time.process_time()

    def _layer_post(self, module, args, kwargs, output) -> None:
        if self._busy or self._tokens <= 1:
            return
        cpu = time.process_time() - self._layer_start
        w, c, b = self._run_reference(self.prefill_reference)
        self._layers.append((cpu, c))
        self._taken = [self._taken[0] + w, self._taken[1] + c, self._taken[2] + b]

    def _run_reference(self, reference: Reference) -> tuple[float, float, float]:
        self._busy = True
        try:
            return reference.run()
        finally:
            self._busy = False

    def __enter__(self) -> PhaseProbe:
        self._handles = [
            self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.model.register_forward_hook(self._post, with_kwargs=True),
        ]
        if self.prefill_reference is not None:
            layers = getattr(self.model.get_decoder(), "layers", None)
            if layers is None:
                raise ValueError(
                    f"the reference clock needs the decoder's layers; {type(self.model).__name__} has none"
                )
            for layer in layers:
                self._handles.append(layer.register_forward_pre_hook(self._layer_pre, with_kwargs=True))
                self._handles.append(layer.register_forward_hook(self._layer_post, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def ref_wall(self, phase: str) -> float | list[float]:
        """Reference wall seconds inside the prefill forwards (phase "prefill": one number) or inside
        each decode forward's step, in order (phase "decode": a list)."""
        if phase == "prefill":
            return sum(c.ref_wall for c in self.calls if c.tokens > 1)
        if phase == "decode":
            return [c.ref_wall for c in self.calls if c.tokens == 1]
        raise ValueError(f"phase must be 'prefill' or 'decode', got phase={phase!r}")

    def fields(self) -> dict[str, float | None]:
        pre = [c for c in self.calls if c.tokens > 1]
        dec = [c for c in self.calls if c.tokens == 1]

        def cores(calls) -> float | None:
            wall = sum(c.wall for c in calls)
            return sum(c.other for c in calls) / wall if wall > 0 else None

        tpot = spread(c.own for c in dec)
        out: dict[str, float | None] = {
            "prefill_cpu_s": sum(c.own for c in pre) if pre else None,
            "tpot_cpu_s": tpot.median if tpot else None,
            "prefill_other_cores": cores(pre),
            "decode_other_cores": cores(dec),
        }
        if self.prefill_reference is not None:
            refs = spread(r for c in pre for _, r in c.layers)
            prefill_ref = None
            if pre and refs:
                prefill_ref = sum(
                    sum(cpu / r for cpu, r in c.layers if r > 0)
                    + (c.own - sum(cpu for cpu, _ in c.layers)) / refs.median
                    for c in pre
                )
            out.update(
                prefill_ref=prefill_ref,
                ref_prefill_cpu_s=refs.median if refs else None,
                ref_prefill_tokens=self.prefill_reference.tokens,
            )
        if self.decode_reference is not None:
            step = spread(c.own / c.ref_cpu for c in dec if c.ref_cpu)
            refs = spread(c.ref_cpu for c in dec if c.ref_cpu)
            out.update(
                tpot_ref=step.median if step else None,
                ref_decode_cpu_s=refs.median if refs else None,
                ref_decode_tokens=self.decode_reference.tokens,
            )
        return out


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
