"""The report's protocol section (eval/protocols.py): how a compressed cache does on questions it
never saw, and what sharing it saves. Built from `eval.report.prepare`d rows, per task x model, only
where the rows carry several question indices or several protocols.

- Decay: per method and protocol, the score x100 at each question index (1..N, the order questions
  are asked about a context), the full cache's rows beside the methods'.
- Reuse penalty: score under a protocol minus score under `query_aware` on the same questions
  (paired by sample_id, ok rows of both), x100, with n, the contexts, a 95% bootstrap interval of
  the mean difference that resamples whole contexts and the exact sign-flip p over contexts
  (`eval.stats.compare_differences`, seeded: the same rows give the same interval; a context's
  questions share its haystack and, shared, one cache, so the context is the unit); also over
  questions 2..N alone, where `first_question` differs from `query_aware` (its question 1 is
  `query_aware`'s run).
- Compression loss per protocol: score minus the full cache's under the same protocol (paired), and
  its shift from `query_aware` (a paired difference of differences): what compression costs apart
  from what the protocol costs every cache.
- Amortised cost: per method and protocol, the prefill + compression per question (median over
  questions of `context_prefill_s` / N for the shared protocols, where one compressed context serves
  its N questions; `prefill_s` for the per-question ones), the median question ttft and tpot, the
  KV bytes per question (the compressed context's `kv_bytes` / N, resp. each question's own cache)
  and the mean `rollback_bytes`.
- One figure per task x model, `protocols_<task>_<model>.png`: score vs question index, one panel
  per protocol, one line per method, the full cache dashed black (under `query_aware`, grey dotted,
  where it did not run under that protocol).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.figure import Figure

from eval import protocols
from eval.plots import DPI, natural_sorted, score_limits
from eval.stats import FEW_UNITS, MIN_N, RESAMPLES, SEED, compare_differences
from eval.tables import cell, md_table, slug

INTRO = (
    "`protocol` (eval/protocols.py): query_aware compresses each question with its context, "
    "context_only the context alone for each question; first_question (question 1 inside the "
    "window), multi_request (no question in the window) and multi_turn (a conversation keeping the "
    "answers) compress each context once and ask all of its questions on that cache."
)
NUMERIC = ("question_index", "questions_in_context", "context_prefill_s", "rollback_bytes")


# ---------------------------------------------------------------------------------------------- frame
def _numeric(df: pd.DataFrame, col: str) -> pd.Series:
    if col not in df.columns:
        return pd.Series(math.nan, index=df.index, dtype=float)
    return pd.to_numeric(df[col], errors="coerce")


def frame(df: pd.DataFrame) -> pd.DataFrame:
    """`df` (prepared rows) with `method_key` (the config label without its protocol suffix), the
    1-based `question`, `shares` (questions one compressed context serves: N for the shared
    protocols, 1 otherwise) and numeric protocol columns."""
    out = df.copy()
    for col in NUMERIC:
        out[col] = _numeric(out, col)
    out["method_key"] = [
        label.replace(protocols.label_suffix(p), "", 1) if protocols.label_suffix(p) else label
        for label, p in zip(out["config_label"], out["protocol"])
    ]
    out["question"] = out["question_index"].fillna(0).astype(int) + 1
    n = out["questions_in_context"].where(out["questions_in_context"] > 0)
    out["shares"] = np.where(out["protocol"].isin(protocols.SHARED), n, 1.0)
    # Rows from before context_prefill_s: their prefill was their own context's.
    out["context_prefill_s"] = out["context_prefill_s"].fillna(_numeric(out, "prefill_s"))
    return out


def applies(part: pd.DataFrame) -> bool:
    """Whether rows of one task x model call for the protocol section."""
    qi = _numeric(part, "question_index").dropna()
    return qi.nunique() > 1 or part["protocol"].nunique() > 1


def _order(part: pd.DataFrame) -> list[tuple[str, str]]:
    """(method_key, protocol) pairs: the full cache first, then methods by name; protocols in
    `protocols.PROTOCOLS` order."""
    keys = part[["method_key", "method", "protocol"]].drop_duplicates()
    methods = natural_sorted(keys["method_key"].unique())
    full = set(keys.loc[keys["method"] == "full", "method_key"])
    methods = [m for m in methods if m in full] + [m for m in methods if m not in full]
    rank = {p: i for i, p in enumerate(protocols.PROTOCOLS)}
    pairs = set(zip(keys["method_key"], keys["protocol"]))
    return [(m, p) for m in methods for p in sorted({p for mm, p in pairs if mm == m}, key=rank.get)]


# ---------------------------------------------------------------------------------------------- decay
def decay(part: pd.DataFrame) -> pd.DataFrame:
    """Score x100 per (method_key, protocol) and question number (ok rows of a `frame`), with `n`
    (ok rows) and `all` (mean over every question)."""
    ok = part[part["ok"] & part["score"].notna()]
    index = pd.MultiIndex.from_tuples(_order(part), names=["method_key", "protocol"])
    if ok.empty:
        return pd.DataFrame({"n": 0, "all": math.nan}, index=index)
    means = ok.groupby(["method_key", "protocol", "question"])["score"].mean().mul(100).unstack("question")
    out = means.reindex(index)
    groups = ok.groupby(["method_key", "protocol"])
    out["n"] = groups.size().reindex(out.index).fillna(0).astype(int)
    out["all"] = groups["score"].mean().mul(100).reindex(out.index)
    counts = ok.groupby(["method_key", "protocol", "question"]).size().unstack("question").reindex(out.index)
    out.attrs["counts"] = counts.fillna(0).astype(int)  # ok rows per question: decay_table's cell n
    return out


def decay_table(part: pd.DataFrame, title: str) -> str:
    table = decay(part)
    questions = [c for c in table.columns if c not in ("n", "all")]
    counts = table.attrs.get("counts")
    rows, uneven_any = [], False
    for (m, p), r in table.iterrows():
        ns = [int(counts.at[(m, p), q]) for q in questions] if counts is not None and questions else []
        uneven = len(set(ns)) > 1
        uneven_any |= uneven
        cells = [
            f"{r[q]:.2f} ({n})" if uneven and n else r[q]
            for q, n in zip(questions, ns or [0] * len(questions))
        ]
        rows.append([m, p, int(r["n"]), *cells, r["all"]])
    headers = ["method", "protocol", "n", *(f"q{q}" for q in questions), "all"]
    note = (
        "\n\nWhere a row's questions rest on different numbers of contexts (a run not finished), each "
        "cell gives its n in brackets."
        if uneven_any
        else ""
    )
    return (
        f"### Score per question — {title}\n\nScore x100 (mean over ok rows) at each question index, "
        "in the order the questions are asked about a context; n: ok rows over all questions.\n\n"
        + md_table(headers, rows, text_columns=2)
        + note
    )


# ------------------------------------------------------------------------------------- reuse penalty
def _penalty(d: pd.Series, clusters: pd.Series | None = None) -> dict[str, float]:
    """n, contexts, mean `penalty`, `low` / `high` and `p` (the exact sign-flip p over contexts where
    there are fewer than `FEW_UNITS`, else the bootstrap's) of the differences `d` [n], each
    context (`clusters`) one unit."""
    if d.empty:
        return {"n": 0, "contexts": 0, "penalty": math.nan, "low": math.nan, "high": math.nan, "p": math.nan}
    c = compare_differences(d.to_numpy(float), None if clusters is None else clusters.to_numpy())
    return {"n": c.n, "contexts": c.n_units, "penalty": c.diff, "low": c.lo, "high": c.hi, "p": c.p_read}


def _context(rows: pd.DataFrame) -> pd.Series:
    """Each row's context (its sample_id where it has none): the bootstrap's cluster."""
    return rows["context_id"].where(rows["context_id"].notna(), rows["sample_id"])


def reuse_penalty(part: pd.DataFrame) -> pd.DataFrame:
    """Per (method_key, protocol other than query_aware): score x100 minus `query_aware`'s on the same
    sample_ids (ok rows of both): n, mean `penalty`, `low` / `high` (95% paired bootstrap), and the
    same over questions 2..N (`*_later`). Empty where no query_aware rows share sample_ids."""
    ok = part[part["ok"] & part["score"].notna()]
    records = []
    for method_key, protocol in _order(part):
        if protocol == "query_aware":
            continue
        mine = ok[(ok["method_key"] == method_key) & (ok["protocol"] == protocol)]
        ref = ok[(ok["method_key"] == method_key) & (ok["protocol"] == "query_aware")]
        pairs = mine.assign(cluster=_context(mine))[["sample_id", "question", "score", "cluster"]].merge(
            ref[["sample_id", "score"]], on="sample_id", suffixes=("", "_ref")
        )
        if pairs.empty:
            continue
        d = (pairs["score"] - pairs["score_ref"]) * 100
        later_rows = pairs["question"] > 1
        later = _penalty(d[later_rows], pairs.loc[later_rows, "cluster"])
        records.append(
            {
                "method_key": method_key,
                "protocol": protocol,
                **_penalty(d, pairs["cluster"]),
                **{f"{k}_later": v for k, v in later.items()},
            }
        )
    return pd.DataFrame.from_records(
        records,
        columns=["method_key", "protocol", "n", "contexts", "penalty", "low", "high", "p", "n_later", "contexts_later",
                 "penalty_later", "low_later", "high_later", "p_later"],
    )  # fmt: skip


def _interval(lo: float, hi: float) -> str:
    return "—" if math.isnan(lo) else f"[{lo:+.2f}, {hi:+.2f}]"


def _p(p: float) -> str:
    return "—" if p is None or math.isnan(p) else ("<0.001" if p < 0.001 else f"{p:.3f}")


def _n(n, contexts) -> str:
    return "—" if not n else f"{int(n)} ({int(contexts)})"


STATS_NOTE = (
    f"95% paired bootstrap intervals resampling whole contexts ({RESAMPLES} resamples, seed {SEED}: a "
    f"context's questions are not independent); p: the exact sign-flip p over contexts below {FEW_UNITS} "
    f"of them (with few contexts the percentile interval is too narrow: read the p), else the "
    f"bootstrap's; n (contexts): questions, in brackets the contexts they come from; below {MIN_N} "
    "contexts the interval and p are withheld (—)."
)


def _signed(v: float) -> str:
    return "—" if v is None or math.isnan(v) else f"{v:+.2f}"


def penalty_table(part: pd.DataFrame, title: str) -> str | None:
    table = reuse_penalty(part)
    if table.empty:
        return None
    rows = [
        [r.method_key, r.protocol, _n(r.n, r.contexts), _signed(r.penalty), _interval(r.low, r.high), _p(r.p),
         _n(r.n_later, r.contexts_later), _signed(r.penalty_later), _interval(r.low_later, r.high_later),
         _p(r.p_later)]
        for r in table.itertuples()
    ]  # fmt: skip
    headers = ["method", "protocol", "n (contexts)", "penalty", "95% CI", "p", "n (q≥2)", "penalty (q≥2)",
               "95% CI (q≥2)", "p (q≥2)"]  # fmt: skip
    return (
        f"### Reuse penalty — {title}\n\nScore x100 under the protocol minus under query_aware on the same "
        f"questions (paired by sample_id); {STATS_NOTE} q≥2: the questions after the first.\n\n"
        + md_table(headers, rows, text_columns=2)
    )


def compression_penalty(part: pd.DataFrame) -> pd.DataFrame:
    """Per (method_key, protocol), compressed methods only: score x100 minus the full cache's under the
    SAME protocol on the same sample_ids (`loss`, `low` / `high`, n), and how that loss moves from
    query_aware to this protocol (`shift` = loss here minus loss under query_aware, on the sample_ids
    all four rows share; `shift_low` / `shift_high`, `n_shift`). The loss separates what compression
    costs from what the protocol costs every cache (the full cache too: a later question asked after
    an empty assistant turn, a conversation's own drift); the shift is SnapKV's thesis in one number:
    near 0 where the question in the window does not matter, negative where the kept entries were
    chosen for a question that is no longer the one asked. Empty without full-cache rows."""
    ok = part[part["ok"] & part["score"].notna()]
    full_keys = natural_sorted(ok.loc[ok["method"] == "full", "method_key"].unique())
    if not full_keys:
        return pd.DataFrame()
    full = ok[ok["method_key"] == full_keys[0]]
    records = []
    for method_key, protocol in _order(part):
        if method_key in full_keys:
            continue
        mine = ok[(ok["method_key"] == method_key) & (ok["protocol"] == protocol)]
        mine = mine.assign(cluster=_context(mine))[["sample_id", "score", "cluster"]]
        base = full[full["protocol"] == protocol][["sample_id", "score"]]
        pairs = mine.merge(base, on="sample_id", suffixes=("", "_full"))
        if pairs.empty:
            continue
        loss = _penalty((pairs["score"] - pairs["score_full"]) * 100, pairs["cluster"])
        qa_mine = ok[(ok["method_key"] == method_key) & (ok["protocol"] == "query_aware")]
        qa = qa_mine[["sample_id", "score"]].merge(
            full[full["protocol"] == "query_aware"][["sample_id", "score"]],
            on="sample_id",
            suffixes=("_qa", "_qa_full"),
        )
        four = pairs.merge(qa, on="sample_id")
        shift = (
            _penalty(
                ((four["score"] - four["score_full"]) - (four["score_qa"] - four["score_qa_full"])) * 100,
                four["cluster"],
            )
            if protocol != "query_aware"
            else _penalty(pd.Series(dtype=float))
        )
        records.append(
            {
                "method_key": method_key,
                "protocol": protocol,
                "n": loss["n"],
                "contexts": loss["contexts"],
                "loss": loss["penalty"],
                "low": loss["low"],
                "high": loss["high"],
                "p": loss["p"],
                "n_shift": shift["n"],
                "contexts_shift": shift["contexts"],
                "shift": shift["penalty"],
                "shift_low": shift["low"],
                "shift_high": shift["high"],
                "shift_p": shift["p"],
            }
        )
    return pd.DataFrame.from_records(records)


def compression_table(part: pd.DataFrame, title: str) -> str | None:
    table = compression_penalty(part)
    if table.empty:
        return None
    rows = [
        [r.method_key, r.protocol, _n(r.n, r.contexts), _signed(r.loss), _interval(r.low, r.high), _p(r.p),
         _n(r.n_shift, r.contexts_shift), _signed(r.shift), _interval(r.shift_low, r.shift_high), _p(r.shift_p)]
        for r in table.itertuples()
    ]  # fmt: skip
    headers = [
        "method",
        "protocol",
        "n (contexts)",
        "vs full",
        "95% CI",
        "p",
        "n (shift)",
        "shift vs query_aware",
        "95% CI (shift)",
        "p (shift)",
    ]
    return (
        f"### Compression loss per protocol — {title}\n\nScore x100 minus the full cache's under the same "
        "protocol on the same questions (what compression costs, apart from what the protocol costs "
        "every cache), and the shift of that loss from query_aware to the protocol on the questions "
        f"all four runs share (negative: the cache kept entries for a question it is no longer asked); "
        f"{STATS_NOTE}\n\n" + md_table(headers, rows, text_columns=2)
    )


# ---------------------------------------------------------------------------------------------- cost
def amortised(part: pd.DataFrame) -> pd.DataFrame:
    """Per (method_key, protocol), over ok rows: `contexts`, mean questions per context `N`,
    `prefill_per_question_s` (median of context_prefill_s / shares), median `ttft_s` and `tpot_s`,
    mean `kv_bytes_per_question` (kv_bytes / shares) and mean `rollback_bytes` (NaN: none rolled back)."""
    ok = part[part["ok"]]
    records = []
    for method_key, protocol in _order(part):
        g = ok[(ok["method_key"] == method_key) & (ok["protocol"] == protocol)]
        if g.empty:
            continue
        contexts = _context(g)
        records.append(
            {
                "method_key": method_key,
                "protocol": protocol,
                "contexts": contexts.nunique(),
                "N": g["questions_in_context"].mean(),
                "prefill_per_question_s": (g["context_prefill_s"] / g["shares"]).median(),
                "ttft_s": g["ttft_s"].median(),
                "tpot_s": g["tpot_s"].median(),
                "kv_bytes_per_question": (g["kv_bytes"] / g["shares"]).mean(),
                "rollback_bytes": g["rollback_bytes"].mean(),
            }
        )
    return pd.DataFrame.from_records(records)


def cost_table(part: pd.DataFrame, title: str) -> str:
    table = amortised(part)
    rows = [
        [r.method_key, r.protocol, r.contexts, cell(r.N, 1), cell(r.prefill_per_question_s, 4),
         cell(r.ttft_s, 4), cell(r.tpot_s * 1000, 2), cell(r.kv_bytes_per_question / 2**20, 3),
         cell(r.rollback_bytes / 2**20, 3)]
        for r in table.itertuples()
    ]  # fmt: skip
    headers = [
        "method", "protocol", "contexts", "N", "prefill s / question", "ttft s", "tpot ms",
        "KV MiB / question", "rollback MiB",
    ]  # fmt: skip
    return (
        f"### Amortised cost — {title}\n\nPrefill + compression per question: the context's, divided by "
        "the N questions its compressed cache serves (shared protocols), else each question's own "
        "(median). ttft (from the question's feed; query_aware / context_only and first_question's "
        "question 1: prefill included) and tpot: medians. KV MiB / question: the compressed cache's "
        "bytes / N (shared protocols), else each question's cache. rollback MiB: mean bytes a "
        "rollback kept alive beyond the cache (— : no rollback).\n\n"
        + md_table(headers, rows, text_columns=2)
    )


# ------------------------------------------------------------------------------------------- report
def sections(df: pd.DataFrame) -> list[str]:
    """The report's "Protocols" section (markdown lines) for a `prepare`d frame; [] when no task x
    model has several question indices or several protocols."""
    parts: list[str] = []
    data = frame(df)
    for (task, model), part in data.groupby(["task", "model"], sort=True):
        if not applies(part):
            continue
        title = f"{task} — {model}"
        tables = [
            decay_table(part, title),
            penalty_table(part, title),
            compression_table(part, title),
            cost_table(part, title),
        ]
        parts += ["", "\n\n".join(t for t in tables if t)]
    return ["", "## Protocols", "", INTRO] + parts if parts else []


def figure(part: pd.DataFrame, title: str) -> Figure:
    """Score x100 vs question number, one panel per protocol, one line per method (a `frame`'s ok
    rows of one task x model); the full cache dashed black, or grey dotted under query_aware where
    it did not run under the panel's protocol."""
    ok = part[part["ok"] & part["score"].notna()]
    table = decay(part)
    questions = [c for c in table.columns if c not in ("n", "all")]
    panels = [p for p in protocols.PROTOCOLS if p in set(ok["protocol"])]
    full = set(ok.loc[ok["method"] == "full", "method_key"])
    # The method's name where it has one config here, else the whole config label.
    methods = part[["method_key", "method"]].drop_duplicates()
    configs = methods["method"].value_counts()
    names = {k: (m if configs[m] == 1 else k) for k, m in zip(methods["method_key"], methods["method"])}
    fig = Figure(figsize=(3.6 * len(panels) + 2.5, 4), layout="constrained")
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    values = table[questions].to_numpy().ravel().tolist()
    palette = colormaps["tab20"]
    colors: dict[str, tuple] = {}
    legend: dict[str, object] = {}
    for ax, protocol in zip(axes, panels):
        lines = [(m, p) for m, p in table.index if p == protocol]
        if not any(m in full for m, _ in lines):
            lines += [(m, "query_aware") for m, p in table.index if p == "query_aware" and m in full]
        for m, p in lines:
            y = table.loc[(m, p), questions].to_numpy(dtype=float)
            if m in full:
                style = (
                    dict(color="black", linestyle="--")
                    if p == protocol
                    else dict(color="grey", linestyle=":")
                )
                label = names[m] if p == protocol else f"{names[m]} (query_aware)"
            else:
                colors.setdefault(m, palette(len(colors) % palette.N))
                style, label = dict(color=colors[m], linestyle="-"), names[m]
            (line,) = ax.plot(questions, y, marker="o", markersize=3, label=label, **style)
            legend.setdefault(label, line)
        ax.set_title(protocol)
        ax.set_xlabel("question")
        ax.set_xticks(questions)
        ax.grid(True, alpha=0.3)
    fig.legend(list(legend.values()), list(legend.keys()), loc="outside right upper", fontsize=7)
    axes[0].set_ylabel("score x100")
    axes[0].set_ylim(*score_limits(values))
    fig.suptitle(title)
    return fig


def plots(ok: pd.DataFrame, out: Path) -> list[Path]:
    """`protocols_<task>_<model>.png` for each task x model the section covers (ok rows)."""
    written = []
    data = frame(ok)
    for (task, model), part in data.groupby(["task", "model"], sort=True):
        if applies(part):
            path = out / f"protocols_{slug(task)}_{slug(model)}.png"
            out.mkdir(parents=True, exist_ok=True)
            figure(part, f"{task} — {model}: score per question").savefig(path, dpi=DPI, format="png")
            written.append(path)
    return written
