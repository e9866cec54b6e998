"""What the benchmark prints and plots: per-configuration medians with their noise figures, the
speed-target ratios computed per round and summarised as median and IQR over the kept rounds, and
the one line that holds all four ratios (the script's last line)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.machine import THREAD_ENV
from eval.stats import Spread, spread


@dataclass(frozen=True)
class Target:
    """A speed target: `num / den` (each a (method, "short" | "long", column)) `direction` `bound`."""

    key: str
    label: str
    num: tuple[str, str, str]
    den: tuple[str, str, str]
    direction: str
    bound: float


# The CPU speed targets (SmolLM2-135M fp32, 2 cores): `short` / `long` = the shortest / longest
# input length of the run, batch = the smallest batch size.
TARGETS = (
    Target("tpot snapkv(L)/full(S)", "TPOT snapkv({long}, b={budget}) / TPOT full({short})",
           ("snapkv", "long", "tpot_s"), ("full", "short", "tpot_s"), "<=", 1.05),
    Target("tpot full(L)/snapkv(L)", "TPOT full({long}) / TPOT snapkv({long}, b={budget})",
           ("full", "long", "tpot_s"), ("snapkv", "long", "tpot_s"), ">=", 2.0),
    Target("prefill snapkv/full(L)", "prefill+compress snapkv / prefill full at {long}",
           ("snapkv", "long", "prefill_s"), ("full", "long", "prefill_s"), "<=", 1.02),
    Target("prefill h2o/full(L)", "prefill+score h2o / prefill full at {long}",
           ("h2o", "long", "prefill_s"), ("full", "long", "prefill_s"), "<=", 1.15),
)  # fmt: skip


def _ok(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("status") == "ok"]


def kept_rounds(rows: Sequence[dict[str, Any]], all_rounds: bool = False) -> tuple[list[int], list[int]]:
    """(rounds used by the summary, all rounds) over the ok rows (a round of error rows only has no
    timings): the rounds not flagged noisy, or all of them when every round is or with `all_rounds`."""
    rows = _ok(rows)
    rounds = sorted({int(r["round"]) for r in rows})
    quiet = sorted({int(r["round"]) for r in rows if not _truthy(r.get("noisy"))})
    return (rounds if all_rounds else quiet or rounds), rounds


def _truthy(v: Any) -> bool:
    return v is True or str(v).lower() == "true"


def _float(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


# The columns each clock's ratios use (conf/bench.yaml `clock`): wall-clock seconds, this
# process's CPU seconds, or CPU in units of the reference forward timed beside it (`ref`).
CLOCK_COLUMNS = {
    "wall": {"prefill_s": "prefill_s", "tpot_s": "tpot_s"},
    "cpu": {"prefill_s": "prefill_cpu_s", "tpot_s": "tpot_cpu_s"},
    "ref": {"prefill_s": "prefill_ref", "tpot_s": "tpot_ref"},
}


def default_clock(rows: Sequence[dict[str, Any]]) -> str:
    """The clock a saved run's ratios read by default: `ref` when its rows have reference-clock
    values, else `cpu` (runs from before the reference clock)."""
    return "ref" if any(_float(r.get("tpot_ref")) is not None for r in _ok(rows)) else "cpu"


def _cells(ok: Sequence[dict[str, Any]]) -> tuple[list[int], dict[tuple[int, str, int], dict[str, Any]]]:
    """(the input lengths, ascending; each (round, method, length)'s row at the smallest batch)."""
    lengths = sorted({int(r["input_tokens"]) for r in ok})
    batch = min(int(r["batch_size"]) for r in ok)
    cell = {
        (int(r["round"]), r["method"], int(r["input_tokens"])): r for r in ok if int(r["batch_size"]) == batch
    }
    return lengths, cell


def round_ratios(rows: Sequence[dict[str, Any]], clock: str = "wall") -> dict[str, dict[int, float]]:
    """Each target's ratio per round, from the configurations of that same round only; `clock`
    picks the columns (CLOCK_COLUMNS: "wall" prefill_s / tpot_s, "cpu" the CPU-time ones, "ref"
    the reference-clock ones)."""
    if clock not in CLOCK_COLUMNS:
        raise ValueError(f"clock must be one of {sorted(CLOCK_COLUMNS)}, got clock={clock!r}")
    cols = CLOCK_COLUMNS[clock]
    ok = _ok(rows)
    if not ok:
        return {t.key: {} for t in TARGETS}
    lengths, cell = _cells(ok)
    at = {"short": lengths[0], "long": lengths[-1]}
    out: dict[str, dict[int, float]] = {}
    for t in TARGETS:
        per: dict[int, float] = {}
        for rnd in sorted({int(r["round"]) for r in ok}):
            a, b = (cell.get((rnd, m, at[w])) for m, w, _ in (t.num, t.den))
            num, den = cols[t.num[2]], cols[t.den[2]]
            x = _float(a.get(num)) if a else None
            y = _float(b.get(den)) if b else None
            if x is not None and y:
                per[rnd] = x / y
        out[t.key] = per
    return out


MEAN_TPOT_COLUMNS = {"cpu": "tpot_mean_cpu_s", "ref": "tpot_mean_ref"}


def decode_step_ratios(
    rows: Sequence[dict[str, Any]], clock: str = "ref", all_rounds: bool = False, mean: bool = False
) -> dict[str, Spread | None]:
    """Per method run at the longest input: its TPOT over the full cache's TPOT at the shortest
    input (a cache of the budget's size), one ratio per kept round from that round's own two
    configurations, summarised as median and IQR. What a decode step of each method costs beside
    a plain step over as many entries (decode-time eviction, hooks, bookkeeping). `mean`: the mean
    step instead of the median (a decode schedule's compressions amortised over its steps; clock
    cpu or ref)."""
    if clock not in CLOCK_COLUMNS:
        raise ValueError(f"clock must be one of {sorted(CLOCK_COLUMNS)}, got clock={clock!r}")
    if mean and clock not in MEAN_TPOT_COLUMNS:
        raise ValueError(f"the mean step is recorded for clock cpu or ref, got clock={clock!r}")
    col = MEAN_TPOT_COLUMNS[clock] if mean else CLOCK_COLUMNS[clock]["tpot_s"]
    return _over_full(rows, col, "shortest", all_rounds)


def _over_full(
    rows: Sequence[dict[str, Any]], col: str, full_at: str, all_rounds: bool
) -> dict[str, Spread | None]:
    """Per method run at the longest input: its `col` over the full cache's `col` at the shortest
    input (`full_at="shortest"`) or at the same input (`"same"`), one ratio per kept round from
    that round's own two configurations, summarised as median and IQR."""
    ok = _ok(rows)
    if not ok:
        return {}
    kept, _ = kept_rounds(rows, all_rounds)
    lengths, cell = _cells(ok)
    n, base = lengths[-1], (lengths[0] if full_at == "shortest" else lengths[-1])
    out = {}
    for m in sorted({m for (_, m, length) in cell if length == n and m != "full"}):
        per = []
        for rnd in kept:
            a, b = cell.get((rnd, m, n)), cell.get((rnd, "full", base))
            x = _float(a.get(col)) if a else None
            y = _float(b.get(col)) if b else None
            if x is not None and y:
                per.append(x / y)
        out[m] = spread(per)
    return out


def prefill_ratios(
    rows: Sequence[dict[str, Any]], clock: str = "ref", all_rounds: bool = False
) -> dict[str, Spread | None]:
    """Per method run at the longest input: its prefill (+ scoring and compression) over the full
    cache's prefill at the same input, one ratio per kept round from that round's own two
    configurations, summarised as median and IQR: what a method's selection adds to the prefill."""
    if clock not in CLOCK_COLUMNS:
        raise ValueError(f"clock must be one of {sorted(CLOCK_COLUMNS)}, got clock={clock!r}")
    return _over_full(rows, CLOCK_COLUMNS[clock]["prefill_s"], "same", all_rounds)


def kept_ratios(
    rows: Sequence[dict[str, Any]], clock: str = "wall", all_rounds: bool = False
) -> dict[str, list[float]]:
    """Each target's per-round ratios over the kept rounds only (every round with `all_rounds`)."""
    kept, _ = kept_rounds(rows, all_rounds)
    return {k: [v for r, v in per.items() if r in kept] for k, per in round_ratios(rows, clock).items()}


def ratio_spreads(rows: Sequence[dict[str, Any]], clock: str = "wall") -> dict[str, Spread | None]:
    """Each target's median and IQR over the kept rounds."""
    return {k: spread(v) for k, v in kept_ratios(rows, clock).items()}


def rounds_needed(values: Sequence[float], tolerance: float = 0.10) -> tuple[float, int] | None:
    """`(relative sd of the per-round ratios, rounds per run)` so that two runs' medians agree within
    `tolerance` with ~95% confidence: 1.96 * sqrt(2) * 1.2533 * sd / sqrt(n) <= tolerance (normal
    approximation; 1.2533 sd / sqrt(n) is the standard error of a median). None for < 2 values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if len(xs) < 2:
        return None
    mid = statistics.median(xs)
    if mid <= 0:
        return None
    rel_sd = statistics.pstdev(xs) / mid
    return rel_sd, max(1, math.ceil((1.96 * math.sqrt(2) * 1.2533 * rel_sd / tolerance) ** 2))


def verdict(t: Target, s: Spread | None) -> str:
    if s is None:
        return "n/a"
    if s.meets(t.bound, t.direction):
        return "MET"
    median_ok = s.median <= t.bound if t.direction == "<=" else s.median >= t.bound
    return "MEDIAN ONLY (IQR crosses)" if median_ok else "NOT MET"


def config_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration: medians over the kept rounds with the IQR/median noise figure and the
    median CPU other processes used meanwhile."""
    kept, _ = kept_rounds(rows)
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in rows:
        if int(r["round"]) in kept:
            groups.setdefault((r["method"], int(r["batch_size"]), int(r["input_tokens"])), []).append(r)
    table = []
    for (method, batch, length), g in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        ok = _ok(g)
        rec: dict[str, Any] = dict(method=method, batch_size=batch, input_tokens=length, n=len(g), ok=len(ok))
        for col in (
            "prefill_s",
            "tpot_s",
            "prefill_cpu_s",
            "tpot_cpu_s",
            "ref_prefill_cpu_s",
            "ref_decode_cpu_s",
            "peak_mem_bytes",
            "decode_peak_mem_bytes",
            "kv_bytes",
            "kv_index_bytes",
            "other_cores",
        ):
            rec[col] = spread(_float(r.get(col)) for r in ok)
        table.append(rec)
    return table


def _ratio(s: Spread | None, na: str = "n/a", sep: str = ", ") -> str:
    """A ratio as `median [Q1, Q3]` (`na` when there is none)."""
    return na if s is None else f"{s.median:.3f} [{s.q1:.3f}{sep}{s.q3:.3f}]"


def _fmt(s: Spread | None, scale: float = 1.0, digits: int = 2, noise: bool = True) -> str:
    if s is None:
        return "-"
    text = f"{s.median * scale:.{digits}f}"
    return f"{text} ±{100 * s.rel_iqr:.0f}%" if noise and not math.isnan(s.rel_iqr) else text


def summary_text(rows: Sequence[dict[str, Any]], cfg: Any) -> str:
    """The printed summary; its last line holds all four ratios with their IQRs."""
    kept, rounds = kept_rounds(rows)
    quiet = [r for r in rounds if not any(_truthy(x.get("noisy")) for x in rows if int(x["round"]) == r)]
    ok = _ok(rows)
    lengths = sorted({int(r["input_tokens"]) for r in ok}) or [0]
    lines = [
        f"per configuration: median over {len(kept)} kept of {len(rounds)} rounds "
        "(±: IQR / median; ref ms: CPU of one prefill / decode reference forward, the machine's speed meanwhile; "
        "other cores: CPU other processes used meanwhile)",
        f"{'method':>13} {'batch':>5} {'length':>7} {'ok':>4} {'prefill s':>14} {'TPOT ms':>14} "
        f"{'prefill cpu s':>14} {'TPOT cpu ms':>14} {'ref ms':>17} {'peak GiB':>9} {'decode GiB':>10} {'KV MiB':>8} "
        f"{'idx MiB':>7} "
        f"{'other cores':>11}",
    ]
    for rec in config_table(rows):
        lines.append(
            f"{rec['method']:>13} {rec['batch_size']:>5} {rec['input_tokens']:>7} {rec['ok']:>2}/{rec['n']:<1} "
            f"{_fmt(rec['prefill_s']):>14} {_fmt(rec['tpot_s'], 1e3, 1):>14} "
            f"{_fmt(rec['prefill_cpu_s']):>14} {_fmt(rec['tpot_cpu_s'], 1e3, 1):>14} "
            f"{_fmt(rec['ref_prefill_cpu_s'], 1e3, 0, False) + ' / ' + _fmt(rec['ref_decode_cpu_s'], 1e3, 0, False):>17} "
            f"{_fmt(rec['peak_mem_bytes'], 2**-30, 2, False):>9} {_fmt(rec['decode_peak_mem_bytes'], 2**-30, 2, False):>10} "
            f"{_fmt(rec['kv_bytes'], 2**-20, 1, False):>8} "
            f"{_fmt(rec['kv_index_bytes'], 2**-20, 2, False):>7} {_fmt(rec['other_cores'], 1, 2, False):>11}"
        )
    max_other = {
        r: max((_float(x.get("other_cores")) or 0.0) for x in rows if int(x["round"]) == r) for r in rounds
    }
    lines.append(
        f"rounds kept: {len(quiet)} of {len(rounds)} under the noise threshold "
        f"({cfg.noise_threshold} other cores)"
        + ("" if quiet else "; NONE was, so the summary uses all rounds")
        + "; max other cores per round: "
        + ", ".join(f"{max_other[r]:.2f}" for r in rounds)
    )
    first = ok[0] if ok else {}
    lines.append(
        "threads: "
        + ", ".join(
            f"{k}={first.get(k, '')!s}"
            for k in ("torch_threads", "cpu_count", *(e.lower() for e in THREAD_ENV))
        )
    )
    spreads = ratio_spreads(rows, cfg.clock)
    lines.append(
        f"\nratios of {cfg.clock} times (per round, median [Q1, Q3] over {len(kept)} rounds; a target is MET "
        "when the IQR is on its side):"
    )
    fields = dict(long=lengths[-1], short=lengths[0], budget=cfg.budget)
    for t in TARGETS:
        s = spreads[t.key]
        shown = _ratio(s, "n/a (configuration not run)")
        lines.append(
            f"  {t.label.format(**fields)}: {shown}  target {t.direction} {t.bound}  {verdict(t, spreads[t.key])}"
        )
    if cfg.clock == "ref":
        raw = ratio_spreads(rows, "cpu")
        lines.append(
            "  the same rounds in raw CPU time (no reference): "
            + "; ".join(f"{t.key} {_ratio(raw[t.key])}" for t in TARGETS)
        )
    per_round = kept_ratios(rows, cfg.clock)
    needed = []
    for t in TARGETS:
        est = rounds_needed(per_round[t.key])
        if est is not None:
            needed.append(f"{t.key} sd {est[0]:.0%} -> {est[1]}")
    if needed:
        lines.append(
            "per-round spread on this machine, and the rounds a run needs for two runs' medians to agree "
            "within 10% (~95%): " + "; ".join(needed)
        )
    lines += method_ratio_lines(rows, cfg.clock)
    lines.append(last_line(rows, cfg.clock))
    return "\n".join(lines)


def method_ratio_lines(rows: Sequence[dict[str, Any]], clock: str = "ref") -> list[str]:
    """Every method run at the longest input (quantized storages `method+name` included), per kept
    round then median [Q1, Q3]: its decode step over the full cache's at the same input (what the
    method and its storage cost a step beside the plain cache it replaces, e.g. dequantization)
    and at the shortest input (beside a plain cache of about the kept size), and its prefill over
    the full cache's at the same input. [] where the full cache did not run at the longest input."""
    tpot = CLOCK_COLUMNS[clock]["tpot_s"]
    same, short = _over_full(rows, tpot, "same", False), _over_full(rows, tpot, "shortest", False)
    prefill = prefill_ratios(rows, clock)
    if all(v is None for v in same.values()):
        return []
    lengths, _ = _cells(_ok(rows))
    out = [
        f"per method at {lengths[-1]} tokens ({clock} times; median [Q1, Q3] of per-round ratios): decode step / "
        f"full's at {lengths[-1]}, / full's at {lengths[0]}; prefill / full's at {lengths[-1]}"
    ]
    for m in same:
        out.append(
            f"  {m:>16}  step {_ratio(same[m])}  step {_ratio(short.get(m))}  prefill {_ratio(prefill.get(m))}"
        )
    return out


def last_line(rows: Sequence[dict[str, Any]], clock: str = "wall") -> str:
    """One line: every target ratio as median [Q1,Q3] and its verdict, plus the clock and rounds used."""
    kept, rounds = kept_rounds(rows)
    spreads = ratio_spreads(rows, clock)
    parts = []
    for t in TARGETS:
        s = spreads[t.key]
        value = _ratio(s, sep=",")
        parts.append(f"{t.key} {value} {t.direction}{t.bound} {verdict(t, s).split(' ')[0]}")
    return f"RATIOS ({clock}) " + " | ".join(parts) + f" | rounds {len(kept)}/{len(rounds)}"


def _kv_points(table: list[dict[str, Any]], method: str, batch: int, scale: float) -> list[tuple[int, float]]:
    """(input tokens, KV bytes x `scale`) of one series: the median `kv_bytes` plus the median
    `kv_index_bytes` (none where the rows predate it)."""
    pts = []
    for t in table:
        if t["method"] == method and t["batch_size"] == batch and t["kv_bytes"] is not None:
            index = t["kv_index_bytes"].median if t.get("kv_index_bytes") is not None else 0.0
            pts.append((t["input_tokens"], (t["kv_bytes"].median + index) * scale))
    return sorted(pts)


def plot(rows: Sequence[dict[str, Any]], out: Path) -> list[Path]:
    """TPOT and peak memory vs input length (medians over the kept rounds), and the longest input
    each method ran: `<out stem>_{tpot,peak_mem,longest}.png` beside the CSV. The peak memory
    figure draws beside each configuration's measured peak (solid) its peak while decoding (dotted:
    `decode_peak_mem_bytes`, where the rows have it) and the KV bytes its cache counts (dashed:
    `kv_bytes` + `kv_index_bytes`, quantized storage as stored), accounting and reality on one axis."""
    # Lazy: matplotlib only when plotting, and pyplot only after the Agg backend is chosen.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = config_table(rows)
    paths = []
    series = sorted({(t["method"], t["batch_size"]) for t in table})
    first = rows[0]
    for key, ylabel, scale, stem in [("tpot_s", "decode ms / token (TPOT)", 1e3, "tpot"),
                                     ("peak_mem_bytes", "peak memory; KV bytes dashed (GiB)", 1 / 2**30, "peak_mem")]:  # fmt: skip
        fig, ax = plt.subplots(figsize=(5.5, 3.8))
        for method, batch in series:
            pts = sorted((t["input_tokens"], t[key].median * scale) for t in table
                         if t["method"] == method and t["batch_size"] == batch and t[key] is not None)  # fmt: skip
            if pts:
                (line,) = ax.plot(*zip(*pts), marker="o", label=f"{method} (batch {batch})")
            during = sorted((t["input_tokens"], t["decode_peak_mem_bytes"].median * scale) for t in table
                            if stem == "peak_mem" and t["method"] == method and t["batch_size"] == batch
                            and t.get("decode_peak_mem_bytes") is not None)  # fmt: skip
            if during:
                ax.plot(*zip(*during), marker="x", linestyle=":", color=line.get_color() if pts else None,
                        label=f"{method} (batch {batch}) decoding")  # fmt: skip
            kv = _kv_points(table, method, batch, scale) if stem == "peak_mem" else []
            if kv:
                ax.plot(*zip(*kv), marker=".", linestyle="--", color=line.get_color() if pts else None,
                        label=f"{method} (batch {batch}) KV bytes")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("input tokens")
        if stem == "peak_mem" and any(t.get("decode_peak_mem_bytes") is not None for t in table):
            ylabel = ylabel.replace(";", "; decoding dotted;", 1)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{first['model']} ({first['dtype']}, {first['device']}; median of rounds)", fontsize=9)
        fig.tight_layout()
        path = out.with_name(f"{out.stem}_{stem}.png")
        fig.savefig(path, dpi=150)
        plt.close(fig)
        paths.append(path)
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    methods = sorted({r["method"] for r in rows})
    longest = [
        max([t["input_tokens"] for t in table if t["method"] == m and t["ok"]] or [0]) for m in methods
    ]
    ax.barh(methods, longest, color="#4C72B0")
    for i, v in enumerate(longest):
        ax.text(v, i, f" {v:,}", va="center", fontsize=8)
    ax.set_xlabel("longest input that ran (tokens)")
    fig.tight_layout()
    path = out.with_name(f"{out.stem}_longest.png")
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return paths + [path]


# ------------------------------------------------------------------------ agreement of several runs
@dataclass(frozen=True)
class RunSummary:
    """One benchmark run as the agreement table shows it."""

    name: str
    spreads: dict[str, Spread | None]
    per_round: dict[str, list[float]]
    kept: int
    rounds: int
    other_cores: Spread | None


def summarise_run(
    name: str, rows: Sequence[dict[str, Any]], clock: str = "cpu", all_rounds: bool = False
) -> RunSummary:
    """One run's ratios over its kept rounds (the summary's rule: rounds flagged noisy left out,
    unless all are), or over every round with `all_rounds`."""
    kept, rounds = kept_rounds(rows, all_rounds)
    other = spread(_float(r.get("other_cores")) for r in _ok(rows))
    per_round = kept_ratios(rows, clock, all_rounds)
    spreads = {k: spread(v) for k, v in per_round.items()}
    return RunSummary(name, spreads, per_round, len(kept), len(rounds), other)


def agreement(runs: Sequence[RunSummary], tolerance: float = 0.10) -> tuple[str, bool]:
    """`(markdown, agree)`: each run's target ratios (median [Q1, Q3]), the noise it ran under, and
    per ratio the spread of the runs' medians, max/min - 1; `agree` when every spread is within
    `tolerance` (the issue's "three consecutive runs within 10%")."""
    head = ["run", *[t.key for t in TARGETS], "median other cores", "rounds used"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        cells = [run.name]
        for t in TARGETS:
            s = run.spreads.get(t.key)
            cells.append(_ratio(s))
        cells.append("n/a" if run.other_cores is None else f"{run.other_cores.median:.2f}")
        quiet = "quiet" if run.kept < run.rounds else "all"
        cells.append(f"{run.kept} of {run.rounds} ({quiet})")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    agree = bool(runs)
    for t in TARGETS:
        medians = [r.spreads[t.key].median for r in runs if r.spreads.get(t.key) is not None]
        if len(medians) < len(runs) or not medians or min(medians) <= 0:
            lines.append(f"- {t.key}: a run has no value")
            agree = False
            continue
        rel = max(medians) / min(medians) - 1
        ok = rel <= tolerance
        agree &= ok
        meets = sum(r.spreads[t.key].meets(t.bound, t.direction) for r in runs)
        pooled = [v for r in runs for v in r.per_round.get(t.key, [])]
        est = rounds_needed(pooled, tolerance)
        need = (
            ""
            if est is None
            else f"; per-round sd {est[0]:.0%} over {len(pooled)} rounds -> {est[1]} rounds a run"
        )
        lines.append(
            f"- {t.key}: medians {', '.join(f'{m:.3f}' for m in medians)}; max/min - 1 = {rel:.1%} "
            f"({'within' if ok else 'NOT within'} {tolerance:.0%}); target {t.direction} {t.bound}: "
            f"IQR on its side in {meets} of {len(runs)} runs; pooled median {spread(pooled).median:.3f}{need}"
        )
    lines.append("")
    lines.append(f"AGREE within {tolerance:.0%}: {'yes' if agree else 'NO'} ({len(runs)} runs)")
    return "\n".join(lines), agree
