"""The leaderboard: every registered method x the cells of a fixed grid (conf/experiment/leaderboard.yaml),
rendered from result rows only.

A cell is one `run.py` config per method (task, model, dtype, protocol, budget, task overrides,
results folder). Its rows are selected by config hash: the cell's config is composed with Hydra for
each method, as `run.py` composes it, and `RunSpec.from_config(cfg).method_hash` names the rows of
exactly that config; rows of any other config (another default, another dtype) never enter a cell.

Each entry is the method's mean score x100 on the samples it shares with the full cache of the same
cell, and the paired difference from the full cache with its 95% interval (`eval.stats.compare`:
the unit bootstrap resampling whole units, within the rows' datasets; the unit is the context
where several questions share one, else the sample, `eval.report.paired.units`), its p (the exact
sign-flip p below `FEW_UNITS` units) and Holm's adjustment over the column (one family per cell).
The best compressed method of a column is the one of highest mean score among those that ran every
sample of the column's full cache (ties: every one of them); the mark claims nothing beyond that mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from eval.labels import method_label
from eval.report.paired import units
from eval.spec import RunSpec
from eval.stats import compare, holm
from eval.store import ResultStore, shared_samples
from eval.tables import md_table

ROOT = Path(__file__).resolve().parents[2]
GRID = ROOT / "conf" / "experiment" / "leaderboard.yaml"
BASELINE = "full"
CELL_KEYS = ("name", "title", "task", "model", "dtype", "protocol", "budget", "overrides", "results_dir")
COLUMNS = [
    "cell", "method", "method_hash", "config_label", "n_shared", "n_units", "score", "full_score", "diff",
    "lo", "hi", "p", "p_exact", "p_holm", "best",
]  # fmt: skip


@dataclass(frozen=True)
class Cell:
    """One column of the grid: the config every method runs in it (`run_overrides(method)`)."""

    name: str
    title: str
    task: str
    model: str
    dtype: str
    protocol: str
    budget: int
    overrides: tuple[str, ...]
    results_dir: str

    @classmethod
    def from_node(cls, node: dict[str, Any]) -> Cell:
        missing = [k for k in CELL_KEYS if k not in node]
        if missing:
            raise ValueError(
                f"a leaderboard cell needs {', '.join(CELL_KEYS)}, got cell {node!r} without {missing}"
            )
        return cls(**{k: node[k] for k in CELL_KEYS if k != "overrides"}, overrides=tuple(node["overrides"]))

    def run_overrides(self, method: str) -> list[str]:
        """The `run.py` overrides of this cell's config for `method`."""
        return [
            f"task={self.task}", f"model={self.model}", f"model.dtype={self.dtype}", f"protocol={self.protocol}",
            f"budget={self.budget}", f"method={method}", f"results_dir={self.results_dir}", "compare=[]",
            *self.overrides,
        ]  # fmt: skip

    def folder(self, results_root: Path) -> Path:
        """The cell's results folder under `results_root` (results_dir names it under results/)."""
        rel = Path(self.results_dir)
        return results_root / (rel.relative_to("results") if rel.parts[:1] == ("results",) else rel)


def load_grid(path: Path = GRID) -> list[Cell]:
    """The cells of the grid file (its `leaderboard.cells`), names unique."""
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    cells = [Cell.from_node(c) for c in (node.get("leaderboard") or {}).get("cells") or []]
    names = [c.name for c in cells]
    if not cells or len(set(names)) != len(names):
        raise ValueError(f"{path} must list leaderboard.cells with unique names, got {names}")
    return cells


def methods() -> list[str]:
    """Every registered method, the full cache first, then by name."""
    from snapkv import METHODS

    return [BASELINE, *sorted(m for m in METHODS if m != BASELINE)]


def specs(cell: Cell, names: list[str], conf_dir: Path = ROOT / "conf") -> dict[str, RunSpec]:
    """{method: RunSpec} of the cell's config composed for each method, as `run.py` composes it."""
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return {n: RunSpec.from_config(compose("config", overrides=cell.run_overrides(n))) for n in names}


def config_hashes(cell: Cell, names: list[str]) -> dict[str, str]:
    """{method: method_hash} of the cell's configs: the names of their rows."""
    return {n: spec.method_hash for n, spec in specs(cell, names).items()}


def cell_rows(cell: Cell, configs: dict[str, RunSpec], results_root: Path) -> pd.DataFrame:
    """The ok, scored rows of the cell's configs from its results folder: the rows of the configs'
    model (the hash leaves the model's name out) and hashes, each named by its method."""
    folder = cell.folder(results_root)
    raw = ResultStore.load_dir(folder) if folder.is_dir() else pd.DataFrame()
    if raw.empty:
        return raw
    by_hash = {spec.method_hash: m for m, spec in configs.items()}
    models = {spec.model.key for spec in configs.values()}
    keep = raw["method_hash"].isin(by_hash) & raw["model"].isin(models) & raw["task"].eq(cell.task)
    rows = raw[keep & raw["status"].eq("ok") & raw["score"].notna()]
    return rows.assign(method=rows["method_hash"].map(by_hash))


def cell_table(cell: Cell, rows: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    """`COLUMNS` records of one cell: each method with rows beside the full cache's, on shared samples."""
    records = []
    base = rows[rows["method"] == BASELINE] if not rows.empty else rows
    for name in names:
        mine = rows[rows["method"] == name] if not rows.empty else rows
        if mine.empty or base.empty:
            continue
        a, b, _ = shared_samples(mine, base)
        if a.empty:
            continue
        datasets = b["dataset"].astype(str)
        strata = datasets.to_numpy() if datasets.nunique() > 1 else None
        c = compare(a["score"].to_numpy(float), b["score"].to_numpy(float), units(b).to_numpy(), strata)
        records.append(
            [cell.name, name, str(a["method_hash"].iloc[0]), method_label(name, a["method_params"].iloc[0]), c.n, c.n_units,
             100 * a["score"].mean(), 100 * b["score"].mean(), c.diff, c.lo, c.hi, c.p, c.p_exact, math.nan,
             False]
        )  # fmt: skip
    out = pd.DataFrame(records, columns=COLUMNS)
    compressed = out["method"] != BASELINE
    if compressed.any():
        read = out.loc[compressed, "p_exact"].where(
            out.loc[compressed, "p_exact"].notna(), out.loc[compressed, "p"]
        )
        out.loc[compressed, "p_holm"] = holm(read.to_numpy(float))
        # Only methods that ran every sample the full cache ran compete: a partial run's mean is over
        # other samples.
        ran = out.loc[~compressed, "n_shared"].max() if (~compressed).any() else out["n_shared"].max()
        whole = compressed & (out["n_shared"] == ran)
        if whole.any():
            top = out.loc[whole, "score"].max()
            out.loc[whole & (out["score"] == top), "best"] = True
    return out


def build(
    results_root: Path, path: Path = GRID, names: list[str] | None = None
) -> tuple[list[Cell], pd.DataFrame]:
    """Every cell's `COLUMNS` records from the rows under `results_root`."""
    cells, names = load_grid(path), names or methods()
    frames = [cell_table(c, cell_rows(c, specs(c, names), results_root), names) for c in cells]
    return cells, pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)


def _entry(r: pd.Series, header_n: int) -> str:
    n = "" if int(r["n_shared"]) == header_n else f" (n={int(r['n_shared'])})"
    if r["method"] == BASELINE:
        return f"{r['score']:.1f}{n}"
    ci = "" if math.isnan(r["lo"]) else f" [{r['lo']:+.1f}, {r['hi']:+.1f}]"
    score = f"**{r['score']:.1f}**" if r["best"] else f"{r['score']:.1f}"
    return f"{score} {r['diff']:+.1f}{ci}{n}"


def markdown(cells: list[Cell], table: pd.DataFrame, names: list[str] | None = None) -> str:
    """The leaderboard as a Markdown table (methods x cells) with its legend; links relative to results/."""
    names = names or methods()
    headers, ns = ["method"], {}
    for c in cells:
        full = table[(table["cell"] == c.name) & (table["method"] == BASELINE)]
        ns[c.name] = int(full["n_shared"].iloc[0]) if len(full) else 0
        units_note = ""
        if len(full) and int(full["n_units"].iloc[0]) != ns[c.name]:
            units_note = f" ({int(full['n_units'].iloc[0])} contexts)"
        link = f"{Path(c.results_dir).name}/report.md"
        headers.append(
            f"[{c.title}]({link}) n={ns[c.name]}{units_note}" if len(full) else f"[{c.title}]({link})"
        )
    rows = []
    for name in names:
        line = [name]
        for c in cells:
            hit = table[(table["cell"] == c.name) & (table["method"] == name)]
            line.append(_entry(hit.iloc[0], ns[c.name]) if len(hit) else "—")
        rows.append(line)
    return md_table(headers, rows)


def block(cells: list[Cell], table: pd.DataFrame, names: list[str] | None = None) -> str:
    """The leaderboard block of results/README.md: a heading, the table and how to read it."""
    return (
        "## Leaderboard\n\n"
        "Every registered method (rows) on the grid of `conf/experiment/leaderboard.yaml` (columns; a\n"
        "header links to the cell's report, which names every config in full), Qwen2.5-Coder-0.5B in float32.\n"
        "An entry is the score x100 on the samples shared with the full cache of the same cell, then the\n"
        "difference from the full cache with its 95% interval (unit bootstrap over the header's n, a\n"
        "context's questions resampled together); (n=...) where fewer samples are shared. Bold: the\n"
        "highest mean of the compressed methods that ran every sample of the column (ties all bold),\n"
        "nothing more. p, exact p\n"
        "and Holm's p per column: `leaderboard.csv`. — : not run yet (`python scripts/leaderboard.py run`;\n"
        "the grid file states what each cell costs to run and which committed rows it reuses).\n\n"
        + markdown(cells, table, names)
    )
