"""A serving benchmark read from its CSVs (`scripts/bench_serving.py`), without loading the benchmark:
the throughput ratios of each eviction config against the full cache at the same arrival process,
concurrency and round (`ratios`, which the benchmark's own summary and figures use too), and the
results page's section "Where does eviction pay in a serving engine?" (`section`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from eval.engines.openvino import KV_BLOCK_SIZE
from eval.engines.parity import parity_table
from eval.report.wording import MARGIN, Line, diff_text, grouped, n_units_text, p_text
from eval.stats import Spread, compare, holm, spread, tost
from eval.store import ResultStore
from eval.tables import md_table


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


def pool_capacity(pool_blocks: int, prompt_tokens: int, new_tokens: int, budget: int | None, block: int) -> int:  # fmt: skip
    """How many requests of `prompt_tokens` + `new_tokens` a pool of `pool_blocks` KV blocks of
    `block` tokens holds whole: with the full cache (`budget` None) every token's block; with
    eviction at `budget` its kept area plus the block being written."""
    total = prompt_tokens + new_tokens
    if budget is None:
        return pool_blocks // math.ceil(total / block)
    return pool_blocks // (math.ceil(min(budget, total) / block) + 1)


# ------------------------------------------------------------------------- the results page section
FOLDER = "serving"  # results/serving/<model>/{points,requests,search}.csv (eval.bench.serving)
COMMAND = (
    "python scripts/bench_serving.py --model MODEL --search --rounds 3 "
    "--out results/serving/MODEL   # one folder per model"
)
BLOCK = KV_BLOCK_SIZE["CPU"]  # the serving benchmark's pool blocks (CPU)
PAY_ROUNDS = 3  # rounds below which a ratio's IQR is not read: one or two values are no spread
# Engine parity: the engine's rows (run.py engine=openvino) beside the transformers rows of the same
# task config (conf/experiment/engine_parity.yaml), so the same samples
PARITY = "serving/parity"
PARITY_COMMAND = (
    "python run.py -m experiment=engine_parity                                  # the harness\n"
    "python run.py -m experiment=engine_parity engine=openvino engine.threads=1  # the engine\n"
    "# and both with model=qwen2.5-coder-0.5b-instruct method=full,snapkv"
)


@dataclass
class Paying:
    """Where one eviction config starts to pay under one arrival process: `pays`, the smallest
    concurrency whose throughput ratio to the full cache (`ratios`) has its whole
    IQR over rounds above 1 (None: at none); `at`, where the ratio and the answers are read (`pays`,
    else the largest concurrency with a ratio); `line`, exact match minus the full cache there."""

    arrival: str
    config: str
    pays: int | None
    at: int | None
    top: int | None  # the largest concurrency with a ratio
    ratio: Spread | None
    line: Line | None = None
    full_exact: float = math.nan


def read_run(run: Path) -> tuple[list[dict], pd.DataFrame]:
    """A benchmark folder's points (`csv_records`) and requests (empty without requests.csv)."""
    requests = pd.read_csv(run / "requests.csv") if (run / "requests.csv").is_file() else pd.DataFrame()
    return csv_records(run / "points.csv"), requests


def csv_records(path: Path) -> list[dict]:
    """A benchmark CSV's rows, empty cells as None (as the benchmark wrote them)."""
    df = pd.read_csv(path)
    return df.astype(object).where(df.notna(), None).to_dict("records")


def serving_runs(folder: Path) -> list[Path]:
    """The benchmark folders under `folder`: itself and its subfolders, those holding a points.csv."""
    if not folder.is_dir():
        return []
    candidates = [folder, *sorted(p for p in folder.iterdir() if p.is_dir())]
    return [d for d in candidates if (d / "points.csv").is_file()]


def _exact_vs_full(requests: pd.DataFrame, arrival: str, c: int, config: str) -> tuple:
    """(`compare` of `config`'s exact match minus the full cache's on the same requests at (arrival,
    c), paired per round and sample, a sample's rounds one unit; the TOST at `MARGIN`; the full
    cache's exact match x100), (None, None, nan) without a pair. A request that did not finish
    scores 0, as the benchmark's points count it (`eval.bench.serving.summarize`)."""
    here = requests[(requests["arrival"] == arrival) & (requests["concurrency"] == c)]
    score = pd.to_numeric(here["exact"], errors="coerce").where(here["status"] == "finished", 0.0)
    here = here.assign(_score=score)
    mine, full = here[here["config"] == config], here[here["config"] == "full"]
    both = mine.merge(full, on=["round", "sample_id"], suffixes=("", "_full"))
    both = both[both["_score"].notna() & both["_score_full"].notna()]
    if both.empty:
        return None, None, math.nan
    unit = both["sample_id"].astype(str).to_numpy()
    x, y = both["_score"].to_numpy(float), both["_score_full"].to_numpy(float)
    same = tost(100 * (x - y), MARGIN, unit) if len(set(unit)) >= 2 else None
    return compare(x, y, unit), same, 100 * float(y.mean())


def throughput_column(points: Sequence[dict]) -> str:
    """The throughput the ratios read: tokens per reference run (`tokens_per_ref`, the machine's
    speed at each point cancelled, as the speed benchmark's reference clock does) where every
    timed point has one, else completed tokens/s."""

    def has(p: dict, key: str) -> bool:
        return p.get(key) is not None and not pd.isna(p.get(key))

    timed = [p for p in points if has(p, "tokens_per_s")]
    return "tokens_per_ref" if timed and all(has(p, "tokens_per_ref") for p in timed) else "tokens_per_s"


def serving_table(points: list[dict], requests: pd.DataFrame) -> list[Paying]:
    """Per (arrival, eviction config) of one benchmark run: where it starts to pay and what its answers
    cost there (`Paying`), Holm over the run's comparisons; throughput as `throughput_column` reads it."""
    rat = ratios(points, throughput_column(points))
    keys = sorted({(p["arrival"], p["config"]) for p in points if p["config"] != "full"})
    out = []
    for arrival, config in keys:
        spreads = {c: spread(v.values()) for (a, c, cfg), v in rat.items() if (a, cfg) == (arrival, config)}
        spreads = {c: s for c, s in sorted(spreads.items()) if s is not None}
        # the whole IQR above 1 (strictly), over enough rounds for an IQR
        paying = [c for c, s in spreads.items() if s.n >= PAY_ROUNDS and s.q1 > 1.0]
        pays = paying[0] if paying else None
        top = max(spreads) if spreads else None
        at = pays if pays is not None else top
        row = Paying(arrival, config, pays, at, top, spreads.get(at) if at is not None else None)
        if at is not None and not requests.empty:
            c, same, row.full_exact = _exact_vs_full(requests, arrival, at, config)
            if c is not None:
                row.line = Line(
                    f"{arrival} {config} at {at}", "", c.n, math.nan, math.nan, vs_full=c, same_full=same
                )
        out.append(row)
    tested = [r.line for r in out if r.line is not None]
    adjusted = holm([ln.vs_full.p_read for ln in tested]) if tested else []
    for ln, p in zip(tested, adjusted):
        ln.holm_full = float(p)
    return out


def search_limits(search: pd.DataFrame) -> dict[str, int]:
    """{config: the largest concurrency the search ran without preemption (0: none)} of a search.csv."""
    ok = search["ok"].astype(str).str.lower() == "true"
    return {
        str(cfg): int(g.loc[ok[g.index], "concurrency"].max()) if ok[g.index].any() else 0
        for cfg, g in search.groupby("config", sort=False)
    }


def _spread_text(s: Spread | None) -> str:
    if s is None:
        return ""
    return f"{s.median:.2f} [{s.q1:.2f}, {s.q3:.2f}] ({s.n})"


def _serving_run(run: Path, root: Path) -> list[str]:
    """One benchmark folder's table and reading lines."""
    points, requests = read_run(run)
    rel = run.relative_to(root).as_posix()
    models = sorted({str(p["model"]) for p in points if p.get("model")})
    pools = sorted({int(p["pool_blocks"]) for p in points if p.get("pool_blocks") is not None})
    rounds = len({p["round"] for p in points})
    files = ["points.csv", "requests.csv", "search.csv"] + sorted(
        p.name for p in run.glob("throughput_*.png")
    )
    links = ", ".join(f"[{f}]({rel}/{f})" for f in files if (run / f).is_file())
    out = [
        f"{rel}: {', '.join(models) or 'model ?'}, {'/'.join(map(str, pools)) or '?'} KV blocks, "
        f"{rounds} round{'s' if rounds != 1 else ''} ({links}):",
        "",
    ]
    table = serving_table(points, requests)
    if not table:
        return [*out, "No eviction configuration beside the full cache.", ""]
    rows = []
    for r in table:
        if r.pays is not None:
            pays = str(r.pays)
        elif r.top is None:
            pays = "no ratio"
        elif r.ratio is not None and r.ratio.n < PAY_ROUNDS:
            pays = f"not read ({r.ratio.n} round{'s' if r.ratio.n != 1 else ''})"
        else:
            pays = f"not up to {r.top}"
        c = r.line.vs_full if r.line is not None else None
        rows.append([r.arrival, r.config, pays, "" if r.at is None else r.at, _spread_text(r.ratio),
                     "" if c is None else f"{r.full_exact + c.diff:.1f} ({r.full_exact:.1f})", diff_text(c),
                     "" if c is None else n_units_text(c), p_text(r.line.holm_full) if c is not None else ""])  # fmt: skip
    unit = "reference-clock " if throughput_column(points) == "tokens_per_ref" else ""
    headers = ["arrival", "config", "pays from", "at", f"{unit}throughput ratio to full: median [IQR] (rounds)",
               "exact x100 (full)", "minus full [95% CI]", "n", "Holm p"]  # fmt: skip
    out += [md_table(headers, rows, text_columns=2), ""]
    for arrival in sorted({r.arrival for r in table}):
        mine = [r for r in table if r.arrival == arrival]
        groups: dict[int | None, list[str]] = {}
        for r in mine:
            groups.setdefault(r.pays, []).append(r.config)
        said = [
            f"{'at none run' if c is None else f'from {c}'}: {', '.join(configs)}"
            for c, configs in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
        ]
        out.append(
            f"- {arrival.capitalize()} arrivals, the concurrency from which eviction pays (the throughput "
            f"ratio's whole IQR over ≥ {PAY_ROUNDS} rounds above 1): " + "; ".join(said) + "."
        )
    tested = [r.line for r in table if r.line is not None]
    said_full = grouped(tested, "full")
    if said_full:
        out.append(
            f"- Exact match minus the full cache's on the same requests there (a request's rounds one unit; "
            f"Holm over the table's {sum(not math.isnan(ln.holm_full) for ln in tested)} comparisons): "
            + "; ".join(said_full)
            + "."
        )
    if (run / "search.csv").is_file():
        limits = search_limits(pd.read_csv(run / "search.csv"))
        order = sorted(limits, key=lambda k: (k != "full", k))
        out.append(
            "- Largest concurrency without preemption (closed loop, binary search): "
            + "; ".join(f"{k} {limits[k]}" for k in order)
            + "."
            + _capacity_text(points, requests, order)
        )
    return [*out, ""]


def _capacity_text(points: list[dict], requests: pd.DataFrame, configs: Sequence[str]) -> str:
    """What the pool holds whole per config (`pool_capacity`), to read the search beside: a scheduler
    that makes a new request wait for free blocks before its first token preempts nothing, and the
    pool's limit shows in TTFT instead."""
    if requests.empty or "prompt_tokens" not in requests.columns:
        return ""
    pools = {int(p["pool_blocks"]) for p in points if p.get("pool_blocks") is not None}
    if len(pools) != 1:
        return ""
    (pool,) = pools
    prompt = pd.to_numeric(requests["prompt_tokens"], errors="coerce").max()
    new = pd.to_numeric(requests["output_tokens"], errors="coerce").max()
    if math.isnan(prompt) or math.isnan(new):
        return ""
    prompt, new = int(prompt), int(new)
    budgets = {p["config"]: p.get("budget") for p in points}
    held = "; ".join(
        f"{c} {pool_capacity(pool, prompt, new, None if budgets.get(c) is None else int(budgets[c]), BLOCK)}"
        for c in configs
    )
    return (
        f" The pool of {pool} blocks holds whole requests of {prompt} + {new} tokens: {held}; a request "
        "that waits for free blocks before its first token is not preempted (its wait is in TTFT)."
    )


def section(root: Path) -> str:
    """The section "Where does eviction pay in a serving engine?" from results/serving/ (the CSVs of
    `scripts/bench_serving.py`, one folder per model): per eviction config and arrival process, the
    smallest concurrency from which its throughput beats the full cache's over the rounds' IQR, its
    exact match there minus the full cache's on the same requests, and the search's largest
    concurrency without preemption; '' while the folder does not exist (the page is unchanged until
    the run)."""
    folder = root / FOLDER
    if not folder.is_dir():
        return ""
    out = [
        "## Where does eviction pay in a serving engine?",
        "",
        f"```bash\n{COMMAND}\n```",
        "",
        "OpenVINO GenAI's continuous batching over a fixed KV pool serves the same needle requests under the "
        "full cache and each eviction mode at each budget, concurrency 1 up to the pool's limit, the "
        "configurations interleaved within each round. Eviction pays from the smallest concurrency at which "
        "its completed tokens/s over the full cache's of the same round has its whole interquartile range "
        "over the rounds above 1 (tokens per run of a fixed reference request timed right before each point, "
        "where the run has it: the machine's speed at that moment cancelled, as the speed benchmark's "
        "reference clock does); its exact match there minus the full cache's, on the same requests. "
        f"How the benchmark runs: [docs/benchmarking.md](../docs/benchmarking.md#serving-at-a-fixed-kv-pool-openvino-genai). Rows: [{FOLDER}/]({FOLDER}/).",
        "",
    ]
    runs = serving_runs(folder)
    for run in runs:
        out += _serving_run(run, root)
    if not runs:
        out += ["No serving rows yet.", ""]
    return "\n".join(out + parity_section(root))


def parity_section(root: Path) -> list[str]:
    """The engine-parity table (`eval.engines.parity.parity_table`): each engine config's rows in
    `PARITY` against the closest transformers config there, on the same samples; nothing while
    `PARITY` holds no rows."""
    folder = root / PARITY
    if not (folder.is_dir() and any(folder.rglob("*.jsonl"))):
        return []
    table = parity_table(ResultStore.load_dir(folder), MARGIN)
    tokens = [token_line(path) for path in sorted(folder.glob("tokens_*.csv"))]
    return [
        "### Does the engine agree with the harness?",
        "",
        f"```bash\n{PARITY_COMMAND}\n```",
        "",
        "The engine's rows (f32 KV cache and inference, the same prompt ids, stop tokens and scorer) held "
        "against the transformers rows (float32) of the same prompts with the same method settings: the share of samples scored the same and "
        "answered with the same text (for the full cache: greedy parity), the flips each way, the "
        f"difference with its paired 95% interval and the equivalence test at ±{MARGIN:g} points. "
        "The engine keeps whole blocks of 32 tokens and scores them with its own aggregation, so an "
        "eviction config is the closest harness config, not the same algorithm. "
        f"Rows: [{PARITY}/]({PARITY}/).",
        "",
        table,
        "",
        *(
            [
                "Full cache, token by token (`python scripts/engine_tokens.py experiment=engine_parity "
                "model=MODEL out=results/serving/parity/tokens_MODEL.csv`: both decode every new token, "
                "no stop):",
                "",
                *tokens,
                "",
            ]
            if tokens
            else []
        ),
    ]


def token_line(path: Path) -> str:
    """One token-parity CSV (scripts/engine_tokens.py) as a line: how many prompts' greedy tokens
    are identical, and where the others first diverge with the harness' logit margin there."""
    df = pd.read_csv(path)
    same = df["identical"].astype(str).str.lower() == "true"
    models = ", ".join(sorted(df["model"].astype(str).unique()))
    weights = "/".join(sorted(df["weights"].astype(str).unique()))
    line = (
        f"- {models} ({weights} weights; [{path.name}]({PARITY}/{path.name})): identical on {int(same.sum())} "
        f"of {len(df)} prompts ({'/'.join(map(str, sorted(df['new_tokens'].unique())))} new tokens each)"
    )
    off = df[~same]
    if off.empty:
        return line + "."
    steps = off["step"].astype(int)
    margins = pd.to_numeric(off["margin"], errors="coerce").dropna()
    where = f"the first divergence at new token {steps.min()}-{steps.max()} (median {steps.median():g})"
    if len(margins):
        where += f", the harness' logit margin there {margins.min():.3g}-{margins.max():.3g} (median {margins.median():.3g})"
    return f"{line}; otherwise {where}."


def readme_lines(root: Path, prefix: str = "") -> list[str]:
    """The top README's serving lines: per benchmark run (model), closed loop (else every arrival
    process), each eviction config's concurrency from which it pays, its throughput ratio there and its exact match minus
    the full cache's on the same requests (`serving_table`, Holm within the run); [] without runs.
    `prefix`: what the links need before the run's folder (the top README: "results/")."""
    out = []
    for run in serving_runs(root / FOLDER):
        points, requests = read_run(run)
        model = ", ".join(sorted({str(p["model"]) for p in points if p.get("model")})) or run.name
        pools = "/".join(
            map(str, sorted({int(p["pool_blocks"]) for p in points if p.get("pool_blocks") is not None}))
        )
        said = []
        table = serving_table(points, requests)
        closed = [r for r in table if r.arrival == "closed"]
        for r in closed or table:  # the README reads the closed loop (the page has every arrival)
            where = f"from concurrency {r.pays}" if r.pays is not None else f"at no concurrency up to {r.top}"
            ratio = f", throughput x{_spread_text(r.ratio)}" if r.ratio is not None else ""
            c = r.line.vs_full if r.line is not None else None
            cost = (
                f", exact match {diff_text(c)} vs the full cache's {r.full_exact:.1f} (Holm p {p_text(r.line.holm_full)})"
                if c is not None
                else ""
            )
            said.append(f"{r.config} pays {where} (read at {r.at}{ratio}{cost})")
        rel = prefix + run.relative_to(root).as_posix()
        arrival = "closed loop" if closed else ", ".join(sorted({r.arrival for r in table}))
        out.append(
            f"- {model}, a pool of {pools} KV blocks, {arrival} ([{rel}/]({rel}/)): " + "; ".join(said) + "."
        )
    return out
