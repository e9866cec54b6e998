"""Rebuild every committed table and figure from committed results (never runs a model).

    python scripts/make_figures.py [results=results] [out=results/figures]

At whatever scale was run, from the results store and the benchmark CSVs:
- each results folder's report (report.md, summary.csv, needle heatmaps, score-vs-budget);
- Table 1: LongBench, dataset x method config (+ average), Markdown and LaTeX;
- decode latency and peak memory vs input length (from `scripts/bench_speed.py` CSVs in bench/,
  and its subfolders of validation runs, drawn next to each CSV; bench/*.csv also in the figures folder);
- pooling ablation (max vs avg vs none): needle score vs budget, one line per pooling;
- budget x window sweep: needle score vs budget, one line per observation window;
- digits as single tokens: SnapKV's kept positions around the needle (results/digits/kept_positions.*)
  and the kernel / span ablation next to the full cache (results/digits/ rows);
- the observation analysis figures (re-plotted from results/observation/*.csv).
Inputs that are absent are skipped with a note; the experiments that make them are named.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import pandas as pd  # noqa: E402

from eval import report  # noqa: E402
from eval.analysis.digits import digits_ablation_figure, kept_positions_figure  # noqa: E402
from eval.analysis.observation import replot  # noqa: E402
from eval.bench.report import plot  # noqa: E402
from eval.plots import score_vs_budget  # noqa: E402
from eval.store import ResultStore  # noqa: E402
from eval.tables import column_order, md_table, slug  # noqa: E402

DEFAULTS = dict(results="results", out="results/figures")


def load(path: Path) -> pd.DataFrame:
    raw = ResultStore.load_dir(path) if path.is_dir() else pd.DataFrame()
    return report.prepare(raw) if not raw.empty else raw


def reports(root: Path) -> list[Path]:
    """Re-run `python scripts/report.py` on every results folder (those holding result rows)."""
    done = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        if any(sub.rglob("*.jsonl")) and sub.name not in ("figures", "observation", "bench", "gpu"):
            report.main([str(sub)])
            done.append(sub / "report.md")
    return done


def table1(df: pd.DataFrame, out: Path) -> list[Path]:
    """Table 1: LongBench dataset x method config (+ average), one table per model (configs of
    different models are never averaged together), Markdown and LaTeX."""
    lb = df[(df["task"] == "longbench") & df["ok"]]
    if lb.empty:
        print("table 1: no LongBench rows (python run.py -m experiment=longbench_multinews ...)")
        return []
    sections, latex = ["# Table 1 (LongBench)\n"], []
    for model, part in lb.groupby("model", sort=True):
        per = part.groupby(["dataset", "config_label"])["score"].mean().mul(100).unstack()
        n = part.groupby(["dataset", "config_label"]).size().unstack()
        order = column_order(part)
        per, n = per[[c for c in order if c in per]], n[[c for c in order if c in n]]
        per.loc["Average"] = per.mean()
        per = per.round(2)
        counts = ", ".join(f"{c}: {int(v)}" for c, v in n.sum().items())
        sections.append(
            f"## {model}\n\nScores x100 (samples per config: {counts}).\n\n"
            + md_table(
                ["dataset", *per.columns], [[i, *row] for i, row in zip(per.index, per.values.tolist())]
            )
            + "\n"
        )
        latex.append(
            per.to_latex(
                float_format="%.2f",
                caption=f"LongBench scores (x100), {model}",
                label=f"tab:longbench-{slug(model)}",
            )
        )
    md = out / "table1_longbench.md"
    md.write_text("\n".join(sections), encoding="utf-8")
    tex = out / "table1_longbench.tex"
    tex.write_text("\n".join(latex), encoding="utf-8")
    return [md, tex]


def latency(root: Path, out: Path) -> list[Path]:
    bench = root / "bench"
    # bench/*.csv, and the validation runs one folder down (validation/, validation8k/, ...)
    csvs = sorted([*bench.glob("*.csv"), *bench.glob("*/*.csv")]) if bench.is_dir() else []
    if not csvs:
        print("latency: no bench CSVs (python scripts/bench_speed.py ... out=results/bench/NAME.csv)")
        return []
    written = []
    for path in csvs:
        df = pd.read_csv(path)
        if not {"method", "input_tokens", "tpot_s", "dtype"} <= set(df.columns):
            continue  # not a scripts/bench_speed.py CSV (e.g. bench/kvpress/: per-round ratios)
        if "round" not in df:  # a one-run CSV from before the interleaved rounds: one round
            df = df.assign(round=0)
        rows = df.to_dict("records")
        # next to the CSV (where scripts/bench_speed.py first drew them, linked from docs/benchmarking.md) and
        # in the figures folder
        written += plot(rows, path)
        if path.parent == bench:  # the validation runs' plots stay next to their CSVs only
            written += plot(rows, out / path.name)
    return written


def sweep_lines(params: pd.Series, param: str) -> pd.Series:
    """A line label per row: `param=value`, plus every other method parameter that differs between
    the rows (e.g. gqa_order: rows from before that switch beside today's), so configs that ran
    differently are separate lines, never averaged into one. The budget is the x axis."""
    keys = sorted({k for p in params for k in p} - {param, "budget"})
    varying = [k for k in keys if params.map(lambda p, k=k: repr(p.get(k))).nunique() > 1]
    return params.map(lambda p: " ".join([f"{param}={p.get(param)}", *(f"{k}={p.get(k)}" for k in varying)]))


def sweep_figure(root: Path, out: Path, param: str, stem: str) -> list[Path]:
    """Needle score vs budget, one line per value of SnapKV's `param`, from results/<stem>/ (the
    experiment of the same name), one figure per model (`<stem>_<model>[_partial].png`); the full
    cache on the same samples as a dashed line."""
    df = load(root / stem)
    d = df[(df["task"] == "needle") & df["ok"] & (df["method"] == "snapkv")].copy() if not df.empty else df
    if d.empty or d["method_params"].map(lambda p: p.get(param)).nunique() < 2:
        print(f"{stem}: no {param} sweep found (python run.py -m experiment={stem})")
        return []
    everything = load(root)
    full_all = everything[
        (everything["task"] == "needle") & everything["ok"] & (everything["method"] == "full")
    ]
    written = []
    for model, m in d.groupby("model", sort=True):
        m = m.assign(line=sweep_lines(m["method_params"], param))
        full = full_all[full_all["sample_id"].isin(set(m["sample_id"])) & (full_all["model"] == model)]
        if set(full["sample_id"]) == set(m["sample_id"]):  # a reference line only on the same samples
            m = pd.concat([m, full.drop_duplicates("sample_id").assign(line="full")])
        for y, label in (("score", "needle exact"), ("partial", "needle partial credit")):
            path = out / f"{stem}_{slug(model)}{'' if y == 'score' else '_partial'}.png"
            score_vs_budget(
                m,
                path,
                title=f"SnapKV {param} x budget ({model})",
                y=y,
                line="line",
                ylabel=f"{label} x100",
                scale=100,
            )
            written.append(path)
    return written


def digits(root: Path, out: Path) -> list[Path]:
    """The digits figures (`eval.analysis.digits`) from results/digits/."""
    sub, written = root / "digits", []
    if (sub / "kept_positions.csv").is_file():
        meta = json.loads((sub / "kept_positions.json").read_text(encoding="utf-8"))
        fig = kept_positions_figure(pd.read_csv(sub / "kept_positions.csv"), meta)
        written.append(out / "digits_kept_positions.png")
        fig.savefig(written[-1], dpi=150)
    else:
        print("digits: no kept positions (python scripts/kept_positions.py)")
    df = load(sub)
    d = df[(df["task"] == "needle") & df["ok"] & (df["method"] == "snapkv")] if not df.empty else df
    if d.empty:
        print("digits: no ablation rows (python run.py -m experiment=digits_ablation)")
        return written
    everything = load(root)
    full = everything[(everything["task"] == "needle") & everything["ok"] & (everything["method"] == "full")]
    full = full[full["sample_id"].isin(set(d["sample_id"])) & (full["model"] == d["model"].iloc[0])]
    if set(full["sample_id"]) == set(d["sample_id"]):  # the full cache only on the same samples
        d = pd.concat([d, full.drop_duplicates("sample_id")])
    fig = digits_ablation_figure(d, f"SnapKV kernel / span ablation, budget 512 ({d['model'].iloc[0]})")
    written.append(out / "digits_ablation.png")
    fig.savefig(written[-1], dpi=150)
    return written


def observation(root: Path, out: Path) -> list[Path]:
    obs = root / "observation"
    if not (obs.is_dir() and any(obs.glob("*.csv"))):
        print("observation: no CSVs (python scripts/observation.py)")
        return []
    return replot(obs)


def main(argv: list[str]) -> int:
    cfg = OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.from_dotlist(argv))
    root, out = Path(cfg.results), Path(cfg.out)
    if not root.is_dir():
        print(f"error: results folder not found: {root}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    written = reports(root)
    df = load(root)
    if not df.empty:
        written += table1(df, out)
        written += sweep_figure(root, out, "pooling", "pooling_ablation")
        written += sweep_figure(root, out, "window", "sweep_window_budget")
        written += digits(root, out)
    written += latency(root, out)
    written += observation(root, out)
    print("\n".join(f"wrote {p}" for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
