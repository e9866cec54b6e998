"""Engine parity: does an engine's run agree with the harness' closest configuration?

Two levels:

- tokens (`first_divergence`): on the same prompt ids, greedy tokens of the engine against the
  harness' transformers path; identical, or the first step where they differ and the reference's
  logit margin there (top-1 minus the engine's token: a margin near 0 is a near-tie that float
  rounding may flip, a large one a real difference).
- accuracy (`agreement`, `parity_table`): the rows of an engine config against the transformers
  rows of the same task, model and method with the same sinks, window / recent and budget
  (`closest`), paired by sample: the share of samples scored the same, the flips each way, and the
  engine-minus-harness difference x100 with its paired interval and p (`eval.stats.compare`,
  units = contexts, strata = datasets), plus an equivalence test at a stated margin
  (`eval.stats.tost`).

    python -m eval.engines.parity RESULTS_DIR [RESULTS_DIR ...] [--margin 5]   # a markdown table of
                                                                  # every engine config in the folders
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from eval import stats
from eval.store import ResultStore

# Method parameters that must match between an engine config and the harness config it is held
# against (what the engine's eviction expresses: `eval.engines.openvino.METHODS`).
MATCHED_PARAMS = ("budget", "window", "recent", "recent_ratio")


@dataclass(frozen=True)
class Divergence:
    """The first step (0-based, into the new tokens) where the engine's greedy token differs from
    the reference's; `margin`: the reference's logit of its own token minus that of the engine's."""

    step: int
    reference: int
    engine: int
    margin: float

    def text(self) -> str:
        return (
            f"first divergence at new token {self.step}: reference {self.reference}, engine "
            f"{self.engine}, reference logit margin {self.margin:.4g}"
        )


def first_divergence(
    reference: Sequence[int], engine: Sequence[int], logits: Sequence[Any]
) -> Divergence | None:
    """None when the two greedy outputs are identical; else where they first differ. `logits`: the
    reference's logits of each step `[vocab]` (or `[1, vocab]`), step i choosing `reference[i]`.
    A length difference alone (one stopped earlier) diverges at the shorter one's end, margin NaN."""
    for i, (a, b) in enumerate(zip(reference, engine)):
        if a != b:
            row = np.asarray(logits[i], dtype=np.float64).reshape(-1)
            return Divergence(i, int(a), int(b), float(row[a] - row[b]))
    if len(reference) != len(engine):
        n = min(len(reference), len(engine))
        ref = int(reference[n]) if n < len(reference) else -1
        eng = int(engine[n]) if n < len(engine) else -1
        return Divergence(n, ref, eng, math.nan)
    return None


@dataclass(frozen=True)
class Agreement:
    """Paired scores of an engine config and a harness config (`agreement`)."""

    n: int  # paired samples
    same: float  # share of pairs with equal scores
    identical: float  # share of pairs whose generated texts are identical (NaN: no predictions)
    engine_better: int
    harness_better: int
    engine_mean: float  # x100
    harness_mean: float  # x100
    comparison: stats.Comparison  # engine - harness, x100
    equivalence: stats.Equivalence | None

    def verdict(self) -> str:
        return stats.verdict(self.comparison, self.equivalence)


def _pair_key(df: pd.DataFrame) -> pd.Series:
    # The same prompt: the sample id and its prompt text's hash (a row without one, written before
    # rows recorded it, pairs only with rows without one: an older prompt may differ).
    sha = df["prompt_sha"] if "prompt_sha" in df.columns else pd.Series("", index=df.index)
    return df["sample_id"].astype(str) + "|" + sha.fillna("").astype(str)


def agreement(engine_rows: pd.DataFrame, harness_rows: pd.DataFrame, margin: float | None = 5.0) -> Agreement:
    """`engine_rows` against `harness_rows` (status ok rows; paired by sample id and prompt hash):
    agreement, flips, and engine - harness x100 with its paired interval (units: `context_id` where
    present, else the sample; strata: `dataset`), and a TOST at `margin` points (None: none).
    ValueError when no sample is in both."""
    e = engine_rows[engine_rows["status"] == "ok"].copy()
    h = harness_rows[harness_rows["status"] == "ok"].copy()
    e["_key"], h["_key"] = _pair_key(e), _pair_key(h)
    pairs = e.merge(h, on="_key", suffixes=("_e", "_h"))
    if pairs.empty:
        raise ValueError(
            "no sample is in both the engine's and the harness' rows (same sample_id and prompt)"
        )
    se, sh = pairs["score_e"].to_numpy(float), pairs["score_h"].to_numpy(float)
    # the same greedy text: on the full cache, token parity on real prompts (a tokenizer's decode of
    # different ids can coincide, so this is an upper bound on identical tokens)
    identical = (
        float((pairs["prediction_e"] == pairs["prediction_h"]).mean())
        if "prediction_e" in pairs.columns
        else math.nan
    )
    unit_col = "context_id_e" if "context_id_e" in pairs.columns else "sample_id_e"
    units = pairs[unit_col].where(pairs[unit_col].notna(), pairs["sample_id_e"]).astype(str).tolist()
    strata = pairs["dataset_e"].astype(str).tolist() if "dataset_e" in pairs.columns else None
    comparison = stats.compare(se, sh, units=units, strata=strata)
    equivalence = stats.tost(100 * (se - sh), margin, units=units) if margin else None
    return Agreement(
        n=len(pairs),
        same=float(np.mean(se == sh)),
        identical=identical,
        engine_better=int((se > sh).sum()),
        harness_better=int((se < sh).sum()),
        engine_mean=100 * float(se.mean()),
        harness_mean=100 * float(sh.mean()),
        comparison=comparison,
        equivalence=equivalence,
    )


def _params(row: pd.Series) -> dict:
    p = row.get("method_params")
    return p if isinstance(p, dict) else {}


def closest(df: pd.DataFrame, engine_hash: str) -> pd.DataFrame:
    """The transformers rows held against the engine config `engine_hash`: same task, model and
    method, the same `MATCHED_PARAMS`, no engine, the same prompt protocol. Several harness configs
    can match (e.g. other kernel sizes): the one at its method's defaults elsewhere comes first, by
    fewest differing parameters."""
    mine = df[df["method_hash"] == engine_hash]
    first = mine.iloc[0]
    params = _params(first)
    engine_col = df["engine"] if "engine" in df.columns else pd.Series(None, index=df.index)
    cand = df[
        engine_col.isna()
        & (df["task"] == first["task"])
        & (df["model"] == first["model"])
        & (df["method"] == first["method"])
    ]
    keep = cand.apply(
        lambda r: all(_params(r).get(k) == params.get(k) for k in MATCHED_PARAMS if k in params), axis=1
    )
    cand = cand[keep.astype(bool)] if len(cand) else cand
    if cand.empty:
        return cand
    differing = cand.groupby("method_hash").apply(
        lambda g: sum(_params(g.iloc[0]).get(k) != v for k, v in params.items()), include_groups=False
    )
    return cand[cand["method_hash"] == differing.sort_values(kind="stable").index[0]]


def parity_table(df: pd.DataFrame, margin: float | None = 5.0) -> str:
    """A markdown table: one line per engine config in `df` (rows of `ResultStore.load_dir`) held
    against its closest harness config (`closest`); a config without one says so."""
    lines = [
        "| task | model | engine config | harness config | n | same score | same text | engine better "
        "| harness better | engine | harness | engine − harness [95% CI] | verdict |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    if "engine" not in df.columns:
        return "\n".join(lines)
    # one line per engine config and model (a config's hash leaves the model out)
    for (_, _, h), rows in df[df["engine"].notna()].groupby(["task", "model", "method_hash"], sort=True):
        first = rows.iloc[0]
        label = f"{first['engine']} {first['method']} {_short(_params(first))} #{h}"
        base = closest(df[(df["task"] == first["task"]) & (df["model"] == first["model"])], h)
        if base.empty:
            lines.append(f"| {first['task']} | {first['model']} | {label} | none | | | | | | | | | |")
            continue
        a = agreement(rows, base, margin)
        c = a.comparison
        ci = f"{c.diff:+.1f} [{c.lo:+.1f}, {c.hi:+.1f}]" if not math.isnan(c.lo) else f"{c.diff:+.1f}"
        harness = f"{first['method']} {_short(_params(base.iloc[0]))} #{base.iloc[0]['method_hash']}"
        lines.append(
            f"| {first['task']} | {first['model']} | {label} | {harness} | {a.n} | {100 * a.same:.0f}% | "
            f"{'' if math.isnan(a.identical) else f'{100 * a.identical:.0f}%'} | {a.engine_better} | {a.harness_better} | {a.engine_mean:.1f} | {a.harness_mean:.1f} | {ci} | "
            f"{a.verdict()} |"
        )
    return "\n".join(lines)


def _short(params: dict) -> str:
    return " ".join(f"{k}={params[k]}" for k in MATCHED_PARAMS if params.get(k) is not None)


def load_dirs(results_dirs: Sequence[str | Path]) -> pd.DataFrame:
    """The rows of several results folders together (e.g. an engine's rows in one, the harness rows
    they are held against in another), each row's `file` prefixed with its folder."""
    frames = []
    for d in results_dirs:
        df = ResultStore.load_dir(d)
        frames.append(df.assign(file=str(d) + "/" + df["file"].astype(str)) if "file" in df.columns else df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Engine configs against the harness' closest configs.")
    parser.add_argument("results_dirs", nargs="+", metavar="results_dir")
    parser.add_argument("--margin", type=float, default=5.0, help="TOST margin in points (x100)")
    args = parser.parse_args(argv)
    print(parity_table(load_dirs(args.results_dirs), args.margin or None))


if __name__ == "__main__":
    main()
