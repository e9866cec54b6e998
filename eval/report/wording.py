"""How the results page words a comparison: a config's `Line` (its comparisons with the full cache
and SnapKV), the verdict Holm's p and a TOST let a sentence state (`said`, `grouped`), and the few
words on how rows ran (`provenance`). Shared by the page and the sections that render their own
tables (`eval.report.equal_bytes`, `eval.report.serving`), so every section says the same thing the
same way."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pandas as pd

from eval.stats import Comparison, verdict

MARGIN = 10.0  # points (x100): the TOST margin of a "same as" statement
NAMED = 5  # comparisons named per verdict in a reading line (the table has every one)
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass
class Line:
    """One config of a table: its score on the samples it shares with the full cache, and its
    comparisons with the full cache and with SnapKV (None where that baseline did not run)."""

    label: str
    method: str
    n: int
    score: float
    partial: float
    vs_full: Comparison | None = None
    holm_full: float = math.nan
    same_full: object = None  # eval.stats.Equivalence against the full cache
    vs_ref: Comparison | None = None
    holm_ref: float = math.nan
    ref_label: str = ""
    whole: bool = False  # ran every sample the full cache ran
    full: Line | None = None  # the full-cache config it is compared with (the same protocol)


def said(c: Comparison, p_holm: float, equivalence=None) -> str:
    """`eval.stats.verdict` of `c` with Holm's p in place of its own."""
    return verdict(replace(c, p=p_holm, p_exact=math.nan), equivalence)


def p_text(p: float) -> str:
    return "—" if math.isnan(p) else ("<0.001" if p < 0.001 else f"{p:.3f}")


def diff_text(c: Comparison | None) -> str:
    if c is None:
        return ""
    ci = "" if math.isnan(c.lo) else f" [{c.lo:+.1f}, {c.hi:+.1f}]"
    return f"{c.diff:+.1f}{ci}"


def n_units_text(c: Comparison) -> str:
    return f"{c.n}" if c.n == c.n_units else f"{c.n} ({c.n_units} units)"


def p_is(p: float) -> str:
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


def grouped(lines: Sequence[Line], which: str) -> list[str]:
    """`which` ("full" / "ref") comparisons sorted by what `eval.stats.verdict` says of them with
    Holm's p (and, against the full cache, a TOST at `MARGIN`): above zero, below zero, same within
    ±MARGIN, no difference detected; each with its difference, p and units."""
    groups: dict[str, list[tuple[float, str, float, int]]] = {
        "above zero": [],
        "below zero": [],
        "same": [],
        "none": [],
    }
    for ln in lines:
        c, p = getattr(ln, f"vs_{which}"), getattr(ln, f"holm_{which}")
        if c is None or math.isnan(c.p_read):
            continue
        v = said(c, p, ln.same_full if which == "full" else None)
        if v in ("above zero", "below zero"):
            text = f"{ln.label} {c.diff:+.1f} ({p_is(p)}, n = {c.n_units})"
        else:  # "same within ±m (TOST p = …, n = …)" / "no difference detected (p = …, n = …)"
            text = f"{ln.label} {c.diff:+.1f} ({v.split('(', 1)[1].rstrip(')')})"
        key = v if v in ("above zero", "below zero") else ("same" if v.startswith("same") else "none")
        groups[key].append((abs(c.diff), text, p, c.n_units))
    names = {"same": f"same within ±{MARGIN:g} by a TOST", "none": "no difference detected"}
    return [f"{names.get(k, k)}: {_listed(v)}" for k, v in groups.items() if v]


def _listed(items: list[tuple[float, str, float, int]]) -> str:
    """The `NAMED` largest differences by name; the others counted, with their range of Holm p and n."""
    items = sorted(items, key=lambda t: -t[0])
    named = ", ".join(t[1] for t in items[:NAMED])
    rest = items[NAMED:]
    if not rest:
        return named
    ps, ns = [t[2] for t in rest], sorted({t[3] for t in rest})
    n = f"n = {ns[0]}" if len(ns) == 1 else f"n = {ns[0]}-{ns[-1]}"
    holm_p = p_is(min(ps)) + (f" to {max(ps):.3f}" if max(ps) > min(ps) else "")
    return f"{named} and {len(rest)} more (Holm {holm_p}, {n}; the table)"


def provenance(rows: pd.DataFrame) -> str:
    """models' dtype(s), row count and the code versions they ran, in a few words."""
    dtypes = "/".join(sorted({DTYPES.get(str(d), str(d)) for d in rows["dtype"].dropna()})) or "dtype ?"
    shas = rows["git_sha"].dropna().astype(str).str[:7]
    commits = sorted(set(shas))
    what = f"{len(rows)} rows, {dtypes}"
    if commits:
        what += f", {len(commits)} commit{'s' if len(commits) > 1 else ''} ({', '.join(commits[:3])}"
        what += ", ..." if len(commits) > 3 else ""
        what += ")"
    dirty = int(rows["git_dirty"].map(lambda v: v is True).sum())
    if dirty:
        what += f", {dirty} from an uncommitted tree"
    return what
