"""The numbers README.md and results/README.md state about the committed results, recomputed from
the committed files under results/ (the result rows through `eval.store`, the benchmark CSVs, the
kept-positions CSV and the observation summary) and looked up in the prose.

One entry per claim: a `Claim` is a sentence of the prose with `{}` fields filled from the rows
(found in the text with its line breaks read as spaces); a `Row` is a row of a markdown table (the
first table after an anchor text; its leading cells are the key). Rows are selected by model,
method and the exact parameters the claim is about, and `config` refuses a selection that matches
more than one config, so new result folders and other methods' rows in the existing folders leave
these claims alone, while a changed row or a changed number in the prose fails its entry. Reads
files only: no model runs.
"""

from __future__ import annotations

import csv
import functools
import json
import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from eval import stats
from eval.bench.kvpress import summarise as kvpress_summarise
from eval.bench.report import decode_step_ratios, default_clock, prefill_ratios, summarise_run
from eval.protocols import PROTOCOLS
from eval.report import prepare
from eval.report import protocols as protocol_report
from eval.store import ResultStore, canonical_json
from eval.tasks.ruler.report import paired_differences

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
GALLERY = "results/README.md"
README = "README.md"
SMOL = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"
NEEDLE_LENGTHS = (1000, 2000, 4000, 8000)
RULER_TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
)  # the column order of the gallery's RULER tables


# ------------------------------------------------------------------------------------------ reading
# The leaderboard block at the top of results/README.md is rendered from rows by scripts/make_figures.py
# (tests/e2e/test_leaderboard_committed.py checks it against its rebuild); the claims here are the hand-written prose.
LEADERBOARD_BLOCK = re.compile(r"<!-- leaderboard:.*?<!-- /leaderboard -->", re.S)


@functools.cache
def doc_text(doc: str) -> str:
    return LEADERBOARD_BLOCK.sub("", (ROOT / doc).read_text(encoding="utf-8"))


@functools.cache
def flat(doc: str) -> str:
    """The document with every run of whitespace (line breaks included) as one space."""
    return " ".join(doc_text(doc).split())


def table_after(doc: str, anchor: str) -> list[list[str]]:
    """Body rows (cells stripped) of the first markdown table after the one occurrence of `anchor`."""
    text = doc_text(doc)
    if text.count(anchor) != 1:
        raise ValueError(f"anchor must occur once in {doc}, found {text.count(anchor)}: {anchor!r}")
    lines = text[text.index(anchor) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start + 2 :]:  # after the header and separator lines
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return table


@functools.cache
def all_rows(folder: str) -> pd.DataFrame:
    """Every row of one results folder, de-duplicated as every report reads them."""
    return ResultStore.load_dir(RESULTS / folder)


def rows(folder: str) -> pd.DataFrame:
    """The ok rows of one results folder."""
    df = all_rows(folder)
    return df[df["status"] == "ok"]


def config(folder: str, model: str, method: str, **params) -> pd.DataFrame:
    """The rows of exactly one method config: `params` must match its `method_params` (a missing
    key reads as None); a selection matching several configs is an error, not a merge."""
    df = rows(folder)
    df = df[(df["model"] == model) & (df["method"] == method)]
    keep = [all(p.get(k) == v for k, v in params.items()) for p in df["method_params"]]
    df = df[pd.Series(keep, index=df.index, dtype=bool)]
    found = sorted({canonical_json(p) for p in df["method_params"]})
    if len(found) != 1:
        raise ValueError(f"{folder}: {model} {method} {params} matches {len(found)} configs: {found}")
    return df


def needle(df: pd.DataFrame, metric: str) -> pd.Series:
    """A needle metric (`exact` / `partial`) x100 per row."""
    return df["scores"].map(lambda s: s[metric]) * 100


def exact_cells(df: pd.DataFrame) -> set[tuple[int, int]]:
    hit = df[needle(df, "exact") == 100]
    return {(int(n), int(d)) for n, d in zip(hit["context_length"], hit["depth_percent"])}


def holds(condition: bool, what: str) -> tuple:
    """For a claim without numbers: no fields, and a failure naming what no longer holds."""
    assert condition, what
    return ()


def one(values: set):
    """The one value of a set that must hold exactly one."""
    (value,) = values
    return value


def point(text: str) -> float:
    """The point estimate of a "+1.2 [-0.3, +2.8] ..." cell."""
    return float(text.split(" [")[0])


def interval(text: str) -> tuple[float, float]:
    """The bounds of the first "[lo, hi]" in a cell."""
    lo, hi = text.split("[", 1)[1].split("]", 1)[0].split(", ")
    return float(lo), float(hi)


def same_records(df: pd.DataFrame, ids) -> pd.DataFrame:
    out = df[df["sample_id"].isin(set(ids))]
    assert len(out) == len(set(ids)), "not every record ran"
    return out


# ------------------------------------------------------------------------------------- the claims
@dataclass(frozen=True)
class Claim:
    """`text`, its `{}` fields filled with `values()`, occurs in `doc` (line breaks as spaces).
    `values` may also assert the qualitative part of the sentence."""

    doc: str
    text: str
    values: Callable[[], tuple] = tuple

    @property
    def id(self) -> str:
        return f"{self.doc}: {self.text[:70]}"

    def check(self) -> None:
        values = tuple(self.values())
        fields = sum(1 for _, name, _, _ in string.Formatter().parse(self.text) if name is not None)
        assert len(values) == fields, f"{fields} fields, {len(values)} values"
        expected = self.text.format(*values)
        assert expected in flat(self.doc), f"{self.doc} does not say: {expected!r}"


@dataclass(frozen=True)
class Row:
    """The first table after `anchor` in `doc` has the row `cells()`; its first `keys` cells name
    it (they may hold numbers too, e.g. a sample count)."""

    doc: str
    anchor: str
    name: str
    cells: Callable[[], list[str]]
    keys: int = 1

    @property
    def id(self) -> str:
        return f"{self.doc}: {self.anchor[:40]} | {self.name}"

    def check(self) -> None:
        expected = self.cells()
        key = expected[: self.keys]
        found = [r for r in table_after(self.doc, self.anchor) if r[: self.keys] == key]
        assert len(found) == 1, f"{len(found)} rows start with {key} after {self.anchor!r}"
        assert found[0] == expected


def keyed(key: tuple[str, ...], cells: Callable[[], list[str]]) -> Callable[[], list[str]]:
    """A row's cells: the fixed `key` cells, then `cells()`."""
    return lambda: list(key) + cells()


# ----------------------------------------------------------------------------------- needle tables
def needle_row(df: pd.DataFrame, lengths=NEEDLE_LENGTHS, depths: int = 5) -> list[str]:
    """Exact / partial per length ("(k of 5)" where only k depths ran, "—" where none did), the means
    over the cells that ran (`*` when the grid is incomplete) and n."""
    cells = []
    for n in lengths:
        at = df[df["context_length"] == n]
        if at.empty:
            cells.append("—")
            continue
        cell = f"{needle(at, 'exact').mean():.0f} / {needle(at, 'partial').mean():.1f}"
        cells.append(cell + (f" ({len(at)} of {depths})" if len(at) < depths else ""))
    star = "*" if len(df) < depths * len(lengths) else ""
    return cells + [
        f"{needle(df, 'exact').mean():.1f}{star}",
        f"{needle(df, 'partial').mean():.1f}{star}",
        str(len(df)),
    ]


QWEN_NEEDLE = "**Qwen2.5-Coder-0.5B-Instruct** (today's defaults"
SMOL_NEEDLE = "**SmolLM2-135M-Instruct** (the rows before the switches"
NEEDLE_CONFIGS = {
    QWEN_NEEDLE: [
        ("full", "full", {}),
        (
            "adakv b=512 w=32 k=7 alpha=0.2 base=snapkv beta=20 layout=varlen short_prompt=clip max",
            "adakv",
            {"gqa_order": "reduce_first"},
        ),
        ("h2o b=512 fused=true", "h2o", {}),
        ("pyramidkv b=512 w=32 k=7 beta=20 max", "pyramidkv", {"gqa_order": "reduce_first"}),
        ("snapkv b=512 w=32 k=7 max", "snapkv", {"gqa_order": "reduce_first"}),
        ("streamingllm b=512 s=4", "streamingllm", {}),
    ],
    SMOL_NEEDLE: [
        ("full", "full", {}),
        (
            "adakv b=512 w=32 k=7 allocation=exact alpha=0.2 base=snapkv beta=20 gqa_order=pool_first "
            "layout=varlen max",
            "adakv",
            {"gqa_order": "pool_first"},
        ),
        (
            "adakv b=512 w=32 k=7 alpha=0.2 base=snapkv beta=20 layout=varlen short_prompt=clip max",
            "adakv",
            {"gqa_order": "reduce_first"},
        ),
        ("h2o b=512", "h2o", {}),
        (
            "pyramidkv b=512 w=32 k=7 beta=20 gqa_order=pool_first short_prompt=clip max",
            "pyramidkv",
            {"gqa_order": "pool_first"},
        ),
        ("pyramidkv b=512 w=32 k=7 beta=20 max", "pyramidkv", {"gqa_order": "reduce_first"}),
        ("snapkv b=512 w=32 k=7 gqa_order=pool_first max", "snapkv", {"gqa_order": "pool_first"}),
        ("snapkv b=512 w=32 k=7 max", "snapkv", {"gqa_order": "reduce_first"}),
        ("streamingllm b=512 s=4", "streamingllm", {}),
    ],
}


def needle_methods_row(model: str, method: str, params: dict) -> list[str]:
    return needle_row(config("needle_methods", model, method, **params))


NEEDLE_ROWS = [
    Row(
        GALLERY,
        anchor,
        label,
        keyed(
            (label,),
            functools.partial(needle_methods_row, QWEN if anchor == QWEN_NEEDLE else SMOL, method, params),
        ),
    )
    for anchor, configs in NEEDLE_CONFIGS.items()
    for label, method, params in configs
]


def needle_methods(model: str, method: str, **params) -> pd.DataFrame:
    return config("needle_methods", model, method, **params)


def qwen_adakv_vs_snapkv() -> tuple:
    ada = needle_methods(QWEN, "adakv", gqa_order="reduce_first").set_index("sample_id")
    snap = needle_methods(QWEN, "snapkv", gqa_order="reduce_first").set_index("sample_id").loc[ada.index]
    assert (ada["scores"] == snap["scores"]).all()  # "and its scores in all of them"
    return int((ada["prediction"] == snap["prediction"]).sum()), len(ada)


def recent_only(model: str, method: str) -> tuple:
    """H2O and StreamingLLM are exact at depth 100 only, and StreamingLLM also at 1K depths 50-100."""
    df = needle_methods(model, method)
    expected = {(int(n), 100) for n in df.loc[df["depth_percent"] == 100, "context_length"]}
    if method == "streamingllm":
        expected |= {(1000, 50), (1000, 75)}
    assert exact_cells(df) == expected
    return ()


def smol_compressed_at_20() -> tuple:
    """Every compressed config of the SmolLM2 table but StreamingLLM: exact 20, the depth-100 cells."""
    for _, method, params in NEEDLE_CONFIGS[SMOL_NEEDLE]:
        if method not in ("full", "streamingllm"):
            assert exact_cells(needle_methods(SMOL, method, **params)) == {(n, 100) for n in NEEDLE_LENGTHS}
    return ()


def full_fails_on_smol() -> tuple:
    df = needle_methods(SMOL, "full")
    missed = {(int(n), int(d)) for n, d in zip(df["context_length"], df["depth_percent"])} - exact_cells(df)
    assert missed == {(8000, 0), (8000, 25), (8000, 50), (4000, 25)}, missed
    return ()


def smol_partial(method: str, **params) -> float:
    return needle(needle_methods(SMOL, method, **params), "partial").mean()


def gqa_orders_agree(folder: str, model: str, **params) -> tuple:
    """The two GQA orders of one SnapKV setting score the same in every cell; their means."""
    a = config(folder, model, "snapkv", gqa_order="pool_first", **params).set_index("sample_id")
    b = config(folder, model, "snapkv", gqa_order="reduce_first", **params).set_index("sample_id")
    assert (a["scores"] == b.loc[a.index, "scores"]).all()
    return needle(a, "exact").mean(), needle(a, "partial").mean()


def qwen_snapkv() -> tuple:
    df = needle_methods(QWEN, "snapkv", gqa_order="reduce_first")
    by_length = needle(df, "exact").groupby(df["context_length"]).mean()
    hits = int((needle(df, "exact") == 100).sum())
    partial = needle(df, "partial").mean()
    return hits, len(df), needle(df, "exact").mean(), partial, by_length[1000], by_length[8000]


def mean_of_length_means(df: pd.DataFrame) -> tuple:
    return tuple(needle(df, m).groupby(df["context_length"]).mean().mean() for m in ("exact", "partial"))


NEEDLE_CLAIMS = [
    Claim(
        GALLERY,
        "the full cache finds the number in all {} cells (1K-8K)",
        lambda: (int((needle(needle_methods(QWEN, "full"), "exact") == 100).sum()),),
    ),
    Claim(
        GALLERY,
        "SnapKV keeps it exactly in {} of {} ({:.0f}; partial credit {:.0f}: most digits elsewhere), "
        "falling from {:.0f} at 1K to {:.0f} at 8K",
        qwen_snapkv,
    ),
    Claim(
        GALLERY,
        "gives SnapKV's answer in {} of its {} cells (and its scores in all of them)",
        qwen_adakv_vs_snapkv,
    ),
    Claim(
        GALLERY,
        "PyramidKV is lower ({:.0f} / {:.1f})",
        lambda: tuple(needle(needle_methods(QWEN, "pyramidkv"), m).mean() for m in ("exact", "partial")),
    ),
    Claim(
        GALLERY,
        "H2O and StreamingLLM find it only where it sits among the recent tokens (depth 100, and "
        "StreamingLLM at 1K where 508 recent tokens cover depths 50-100)",
        lambda: recent_only(QWEN, "h2o") + recent_only(QWEN, "streamingllm"),
    ),
    Claim(
        GALLERY,
        "**On SmolLM2 every compressed method but StreamingLLM scores exactly 20** (the depth-100 cells",
        smol_compressed_at_20,
    ),
    Claim(
        GALLERY,
        "StreamingLLM scores {:.0f} (depth 100, and depths 50-100 at 1K, as on Qwen)",
        lambda: (
            recent_only(SMOL, "streamingllm")
            + (needle(needle_methods(SMOL, "streamingllm"), "exact").mean(),)
        ),
    ),
    Claim(
        GALLERY,
        "(SnapKV {:.0f}, Ada-KV {:.0f}, PyramidKV {:.0f} ({:.0f} with `pool_first`), StreamingLLM {:.0f}, H2O {:.0f})",
        lambda: (
            smol_partial("snapkv", gqa_order="reduce_first"),
            smol_partial("adakv", gqa_order="reduce_first"),
            smol_partial("pyramidkv", gqa_order="reduce_first"),
            smol_partial("pyramidkv", gqa_order="pool_first"),
            smol_partial("streamingllm"),
            smol_partial("h2o"),
        ),
    ),
    Claim(
        GALLERY,
        "with the full cache itself failing at 8K (depths 0-50) and at 4K depth 25",
        full_fails_on_smol,
    ),
    Claim(
        GALLERY,
        "The two GQA orders give the same SmolLM2 scores on these 20 cells (SnapKV {:.0f} / {:.1f} both)",
        lambda: gqa_orders_agree("needle_methods", SMOL),
    ),
]


# ----------------------------------------------------------------------------- where the rows came
def git_of_todays_defaults() -> tuple:
    """The rows of today's SnapKV / PyramidKV / Ada-KV defaults in the needle, LongBench and ablation
    folders: one commit, a clean tree."""
    folders = (
        "needle_methods",
        "needle_budget",
        "longbench_multinews",
        "sweep_window_budget",
        "pooling_ablation",
    )
    df = pd.concat([rows(f) for f in folders])
    df = df[df["method"].isin(["snapkv", "pyramidkv", "adakv"])]
    df = df[[p.get("gqa_order") == "reduce_first" for p in df["method_params"]]]
    assert df["git_dirty"].eq(False).all()
    later = (df["model"] == QWEN) & (df["context_length"] == 8000) & df["method"].isin(["pyramidkv", "adakv"])
    (sha,) = set(df.loc[~later, "git_sha"])
    (sha_8k,) = set(df.loc[later, "git_sha"])
    return sha[:7], sha_8k[:7]


def rows_without_dirty_flag() -> tuple:
    folders = sorted({p.relative_to(RESULTS).parts[0] for p in RESULTS.glob("*/*/*/*.jsonl")})
    return (sum(int(all_rows(f)["git_dirty"].isna().sum()) for f in folders),)


HEADER_CLAIMS = [
    Claim(
        GALLERY,
        "were added beside them (git {}, clean tree; Qwen's 8K cells of PyramidKV and Ada-KV later, at {})",
        git_of_todays_defaults,
    ),
    Claim(
        GALLERY,
        "{} rows were written before the rows recorded whether the working tree had uncommitted changes",
        rows_without_dirty_flag,
    ),
]


# ------------------------------------------------------------------------------------ needle budget
BUDGETS = (128, 256, 512, 1024)
BUDGET_ANCHOR = "credit x100 (exact match in brackets):"
BUDGET_METHODS = ("snapkv", "adakv", "pyramidkv", "h2o", "streamingllm")


def budget_point(method: str, budget: int) -> pd.DataFrame:
    return config("needle_budget", SMOL, method, budget=budget)


def budget_cell(df: pd.DataFrame) -> str:
    return f"{needle(df, 'partial').mean():.1f} ({needle(df, 'exact').mean():.0f})"


def budget_partial(method: str, budget: int) -> float:
    return needle(budget_point(method, budget), "partial").mean()


def flat_exact_but_streamingllm() -> tuple:
    for m in BUDGET_METHODS:
        for b in BUDGETS:
            if (m, b) != ("streamingllm", 1024):
                assert needle(budget_point(m, b), "exact").mean() == 20, (m, b)
    df = budget_point("streamingllm", 1024)
    assert exact_cells(df) == {(2000, 75), (2000, 100)}
    return (needle(df, "exact").mean(),)


def budget_gains() -> tuple:
    gain = {m: budget_partial(m, 1024) - budget_partial(m, 128) for m in BUDGET_METHODS}
    assert max(gain, key=gain.get) == "snapkv" and min(gain, key=gain.get) == "h2o", gain
    assert budget_partial("adakv", 128) > budget_partial("snapkv", 128)
    assert budget_partial("adakv", 1024) == budget_partial("snapkv", 1024)
    assert budget_partial("pyramidkv", 128) == budget_partial("pyramidkv", 256)
    others = ("snapkv", "adakv", "pyramidkv", "streamingllm")
    lowest = [b for b in BUDGETS if all(budget_partial("h2o", b) < budget_partial(m, b) for m in others)]
    assert lowest == [1024], lowest
    below = {budget_partial(m, 128) for m in ("snapkv", "pyramidkv", "streamingllm")}
    assert len(below) == 1 and budget_partial("h2o", 128) > min(below)
    return (
        budget_partial("snapkv", 128),
        budget_partial("snapkv", 1024),
        budget_partial("adakv", 128),
        budget_partial("adakv", 1024),
        budget_partial("pyramidkv", 128),
        budget_partial("pyramidkv", 512),
        budget_partial("pyramidkv", 1024),
        budget_partial("h2o", 128),
        budget_partial("h2o", 1024),
        min(below),
    )


def budget_row(method: str) -> list[str]:
    return [budget_cell(budget_point(method, b)) for b in BUDGETS]


BUDGET_ROWS = [
    Row(
        GALLERY,
        BUDGET_ANCHOR,
        "full",
        keyed(
            ("full (no budget)",), lambda: [budget_cell(config("needle_budget", SMOL, "full")), "", "", ""]
        ),
    )
] + [Row(GALLERY, BUDGET_ANCHOR, m, keyed((m,), functools.partial(budget_row, m))) for m in BUDGET_METHODS]
BUDGET_CLAIMS = [
    Claim(
        GALLERY,
        "SmolLM2, 2K-token prompts, depths 0/25/50/75/100 ({} prompts per point)",
        lambda: (len(budget_point("snapkv", 512)),),
    ),
    Claim(
        GALLERY,
        "except StreamingLLM at 1024 ({:.0f}: depths 75 and 100, where its 1020 recent tokens cover the needle)",
        flat_exact_but_streamingllm,
    ),
    Claim(
        GALLERY,
        "SnapKV gains most with budget ({:.1f} -> {:.1f}); Ada-KV starts higher and ends level with it "
        "({:.1f} -> {:.1f}); PyramidKV stays at {:.1f} up to 256 and rises from 512 ({:.1f}, {:.1f}); H2O gains "
        "least ({:.1f} -> {:.1f}) and is the lowest only at 1024 (at 128 it is above SnapKV, PyramidKV and "
        "StreamingLLM, all {:.1f})",
        budget_gains,
    ),
]


# ---------------------------------------------------------------------------------------- LongBench
LB = "longbench_multinews"
LB_ANCHOR = "SnapKV, each pair on the same records:"
LB_SAME5 = "(SmolLM2-135M, every config on the same records):"
LB_CONFIGS = {
    "full": ("full", {}),
    "snapkv (today's defaults)": ("snapkv", {"gqa_order": "reduce_first"}),
    "snapkv (`gqa_order=pool_first`)": ("snapkv", {"gqa_order": "pool_first"}),
    "pyramidkv (`pool_first`, `short_prompt=clip`)": ("pyramidkv", {"gqa_order": "pool_first"}),
    "adakv (`pool_first`, `allocation=exact`, varlen)": ("adakv", {"gqa_order": "pool_first"}),
}
LB_MODELS = {"Qwen2.5-Coder-0.5B": QWEN, "SmolLM2-135M": SMOL}


def lb(model: str, label: str) -> pd.DataFrame:
    method, params = LB_CONFIGS[label]
    return config(LB, model, method, **params)


def first_five() -> list[str]:
    """The records pyramidkv and adakv ran (the same 5 for both)."""
    ids = set(lb(SMOL, "pyramidkv (`pool_first`, `short_prompt=clip`)")["sample_id"])
    assert ids == set(lb(SMOL, "adakv (`pool_first`, `allocation=exact`, varlen)")["sample_id"])
    assert ids == set(lb(SMOL, "full")["sample_id"].iloc[: len(ids)])  # the first records, in file order
    return sorted(ids)


def lb_cells(df: pd.DataFrame) -> list[str]:
    return [
        f"{df['input_tokens'].mean():.0f}",
        f"{df['kv_tokens'].mean():.0f}",
        f"{df['kv_bytes'].mean() / 2**20:.1f}",
    ]


def lb_row(model_name: str, label: str) -> list[str]:
    df = lb(LB_MODELS[model_name], label)
    return [str(len(df)), f"{100 * df['score'].mean():.2f}"] + lb_cells(df)


def lb_same5_row(label: str) -> list[str]:
    df = same_records(lb(SMOL, label), first_five())
    full = same_records(lb(SMOL, "full"), first_five())
    minus = "" if label == "full" else f"{100 * (df['score'].mean() - full['score'].mean()):+.2f}"
    return [str(len(df)), f"{100 * df['score'].mean():.2f}", minus] + lb_cells(df)


def rouge(model: str, label: str, ids=None) -> float:
    df = lb(model, label)
    return 100 * (df if ids is None else same_records(df, ids))["score"].mean()


def table1_reading() -> tuple:
    """Read across (every config over the samples it ran) against the same 5 records."""
    pyr, ada = (
        "pyramidkv (`pool_first`, `short_prompt=clip`)",
        "adakv (`pool_first`, `allocation=exact`, varlen)",
    )
    full = rouge(SMOL, "full")
    five = rouge(SMOL, "full", first_five())
    assert len(lb(SMOL, "full")) == len(lb(SMOL, "snapkv (`gqa_order=pool_first`)"))
    return (
        len(lb(SMOL, "full")),
        len(first_five()),
        full - rouge(SMOL, pyr),
        full - rouge(SMOL, ada),
        len(first_five()),
        five - rouge(SMOL, pyr, first_five()),
        five - rouge(SMOL, ada, first_five()),
    )


def lb_ten() -> list[str]:
    return sorted(lb(QWEN, "full")["sample_id"])


def kept_share(df: pd.DataFrame) -> float:
    return 100 * df["kv_tokens"].sum() / df["input_tokens"].sum()


def tokenizer_reading() -> tuple:
    ten = lb_ten()
    qwen, smol = lb(QWEN, "full"), same_records(lb(SMOL, "full"), ten)
    rest = lb(SMOL, "full")[~lb(SMOL, "full")["sample_id"].isin(ten)]
    assert rest["input_tokens"].mean() > smol["input_tokens"].mean()  # "whose second 10 are longer"
    return (
        len(ten),
        100 * (1 - qwen["input_tokens"].sum() / smol["input_tokens"].sum()),
        qwen["input_tokens"].mean(),
        smol["input_tokens"].mean(),
        kept_share(lb(QWEN, "snapkv (today's defaults)")),
        kept_share(same_records(lb(SMOL, "snapkv (`gqa_order=pool_first`)"), ten)),
        kept_share(lb(SMOL, "snapkv (`gqa_order=pool_first`)")),
        len(lb(SMOL, "full")),
    )


def snapkv_losses() -> tuple:
    snap = "snapkv (`gqa_order=pool_first`)"
    ten, five = lb_ten(), first_five()
    return (
        rouge(SMOL, "full") - rouge(SMOL, snap),
        len(lb(SMOL, "full")),
        rouge(QWEN, "full") - rouge(QWEN, "snapkv (today's defaults)"),
        len(ten),
        len(ten),
        rouge(SMOL, "full", ten) - rouge(SMOL, snap, ten),
        len(five),
        rouge(SMOL, snap, five) - rouge(SMOL, "full", five),
    )


LB_ROWS = [
    Row(
        GALLERY,
        LB_ANCHOR,
        f"{name} {label}",
        keyed((name, label), functools.partial(lb_row, name, label)),
        keys=2,
    )
    for name, label in [
        ("Qwen2.5-Coder-0.5B", "full"),
        ("Qwen2.5-Coder-0.5B", "snapkv (today's defaults)"),
        ("SmolLM2-135M", "full"),
        ("SmolLM2-135M", "snapkv (`gqa_order=pool_first`)"),
    ]
] + [
    Row(GALLERY, LB_SAME5, label, keyed((label,), functools.partial(lb_same5_row, label)))
    for label in (
        "full",
        "snapkv (`gqa_order=pool_first`)",
        "pyramidkv (`pool_first`, `short_prompt=clip`)",
        "adakv (`pool_first`, `allocation=exact`, varlen)",
    )
]
LB_CLAIMS = [
    Claim(
        GALLERY,
        "pyramidkv and adakv ran on SmolLM2's first {} records only",
        lambda: (len(first_five()),),
    ),
    Claim(
        GALLERY,
        "(its header lists them: {} for full and snapkv, {} for pyramidkv and adakv on SmolLM2), so do not "
        "read it across: there pyramidkv seems to lose {:.1f} rouge-L and adakv {:.1f} against the full cache, "
        "where on the same {} records they lose {:.1f} and {:.1f}.",
        table1_reading,
    ),
    Claim(
        GALLERY,
        "On the same {} records Qwen's tokenizer makes the prompts {:.0f}% shorter than SmolLM2's ({:.0f} "
        "against {:.0f} tokens on average), so budget 1024 keeps {:.0f}% of Qwen's cache against {:.0f}% of "
        "SmolLM2's there ({:.0f}% over SmolLM2's {} records, whose second 10 are longer)",
        tokenizer_reading,
    ),
    Claim(
        GALLERY,
        "SnapKV at 1024 loses {:.2f} rouge-L points against the full cache on SmolLM2's {} records and "
        "{:.2f} on Qwen's {} (on those same {} records SmolLM2 loses {:.2f}; on the first {}, SnapKV scores "
        "{:.2f} above the full cache)",
        snapkv_losses,
    ),
]


# ----------------------------------------------------------------------------------- SnapKV ablations
SWEEP, POOL = "sweep_window_budget", "pooling_ablation"
ABLATION_BUDGETS = (128, 256, 512)


def snap(folder: str, model: str = SMOL, **params) -> pd.DataFrame:
    return config(folder, model, "snapkv", **params)


def smol_settings() -> dict[tuple, pd.DataFrame]:
    """Every SmolLM2 setting of both grids: (folder, gqa_order, window or pooling, budget) -> rows."""
    out = {}
    for order in ("pool_first", "reduce_first"):
        for b in ABLATION_BUDGETS:
            for w in (8, 16, 32):
                out[(SWEEP, order, w, b)] = snap(SWEEP, gqa_order=order, window=w, budget=b)
            for pooling in ("max", "avg", "none"):
                out[(POOL, order, pooling, b)] = snap(POOL, gqa_order=order, pooling=pooling, budget=b)
    return out


def exact_in_ablations() -> tuple:
    full = config(SWEEP, SMOL, "full")
    assert len(full) == 6
    exact = {k: needle(df, "exact").mean() for k, df in smol_settings().items()}
    assert all(v == 0 for k, v in exact.items() if k[0] == POOL)
    reached = {(k[2], k[3]) for k, v in exact.items() if k[0] == SWEEP and v > 0}
    assert reached == {(8, 256), (8, 512), (16, 512)}, reached
    assert all(exact[k] == exact[(SWEEP, "pool_first") + k[2:]] for k in exact if k[0] == SWEEP)
    (value,) = {v for v in exact.values() if v > 0}
    windows = 9  # windows 8/16/32 x budgets 128/256/512
    return (
        needle(full, "exact").mean(),
        needle(full, "partial").mean(),
        windows - len(reached),
        windows,
        len(reached),
        value,
    )


def partial(df: pd.DataFrame) -> float:
    return needle(df, "partial").mean()


def windows_at_512() -> tuple:
    values = [
        partial(snap(SWEEP, gqa_order=o, window=w, budget=512))
        for w in (8, 16, 32)
        for o in ("pool_first", "reduce_first")
    ]
    assert values[0::2] == values[1::2]  # both orders
    return values[0::2]


def pooling_reading() -> tuple:
    def p(order: str, pooling: str, b: int) -> float:
        return partial(snap(POOL, gqa_order=order, pooling=pooling, budget=b))

    for pooling in ("avg", "none"):
        for b in ABLATION_BUDGETS:
            assert p("pool_first", pooling, b) == p("reduce_first", pooling, b)
    assert p("reduce_first", "none", 128) > max(p(o, "max", 128) for o in ("pool_first", "reduce_first"))
    assert p("pool_first", "none", 512) == p("pool_first", "max", 512) == p("reduce_first", "max", 512)
    return (
        p("pool_first", "max", 128),
        p("reduce_first", "max", 128),
        p("pool_first", "avg", 128),
        p("pool_first", "max", 256),
        p("reduce_first", "max", 256),
        p("pool_first", "avg", 256),
        p("pool_first", "none", 128),
        p("pool_first", "none", 512),
    )


def gqa_orders_in_ablations() -> tuple:
    """Settings where the two orders differ: window 32 with max-pooling only (the same runs in both
    grids); the largest difference in digits of one prompt, and the budget-128 pair."""
    settings = smol_settings()
    differ = set()
    for (folder, order, setting, b), df in settings.items():
        if order == "pool_first" and partial(df) != partial(settings[(folder, "reduce_first", setting, b)]):
            differ.add((folder, setting))
    assert differ == {(SWEEP, 32), (POOL, "max")}, differ
    gaps = [
        abs(
            partial(settings[(SWEEP, "pool_first", 32, b)])
            - partial(settings[(SWEEP, "reduce_first", 32, b)])
        )
        for b in ABLATION_BUDGETS
    ]
    digits = max(gaps) * 6 * 7 / 100  # 6 prompts, 7 digits each
    assert max(gaps) == gaps[0]
    return (
        round(digits),
        partial(settings[(SWEEP, "pool_first", 32, 128)]),
        partial(settings[(SWEEP, "reduce_first", 32, 128)]),
    )


def qwen_pooling() -> tuple:
    df = rows(POOL).query("model == @QWEN and method == 'snapkv'")
    poolings = {p["pooling"] for p in df["method_params"]}
    assert poolings == {"max", "avg"}, poolings
    mx = {b: snap(POOL, QWEN, pooling="max", budget=b) for b in ABLATION_BUDGETS}
    avg = {b: snap(POOL, QWEN, pooling="avg", budget=b) for b in ABLATION_BUDGETS}
    for b in (128, 256):
        assert needle(mx[b], "exact").mean() == needle(avg[b], "exact").mean() == 0
    return (
        len(df),
        3 * 3 * 6,  # pooling max/avg/none x 3 budgets x the 6 prompts of the grid
        len(avg[512]),
        needle(mx[512], "exact").mean(),
        int((needle(mx[512], "exact") == 100).sum()),
        len(mx[512]),
        needle(avg[512], "exact").mean(),
        len(avg[512]),
    )


def qwen_pooling_same_prompts() -> tuple:
    avg = snap(POOL, QWEN, pooling="avg", budget=512)
    mx = snap(POOL, QWEN, pooling="max", budget=512)
    same = same_records(mx, avg["sample_id"])
    never = mx[~mx["sample_id"].isin(set(avg["sample_id"]))]
    assert needle(same, "exact").mean() == 100 and (needle(never, "exact") < 100).sum() == 1
    assert config("needle_methods", QWEN, "full")["scores"].map(lambda s: s["exact"]).eq(1).all()
    assert not (rows(POOL).query("model == @QWEN")["method"] == "full").any()
    return len(same), len(never), len(config("needle_methods", QWEN, "full"))


ABLATION_CLAIMS = [
    Claim(
        GALLERY,
        "SmolLM2 (first two rows; the full cache is {:.0f} exact and {:.0f} partial on these 6 prompts). "
        "Exact match is 0 below the full cache at every pooling setting and at {} of the {} window settings; "
        "the other {} (window 8 at budgets 256 and 512, window 16 at 512) reach {:.1f}, one prompt of 6",
        exact_in_ablations,
    ),
    Claim(GALLERY, "(partial credit x100 at budget 512: {:.1f} and {:.1f} vs {:.1f})", windows_at_512),
    Claim(
        GALLERY,
        "Max-pooling is above avg-pooling at small budgets (budget 128: {:.1f} / {:.1f} vs {:.1f}; 256: {:.1f} / "
        "{:.1f} vs {:.1f}, `pool_first` / `reduce_first`), no pooling is above both at 128 ({:.1f}) and ties "
        "max at 512 ({:.1f})",
        pooling_reading,
    ),
    Claim(
        GALLERY,
        "The two GQA orders give the same scores except at window 32 with max-pooling, where they differ by "
        "at most {} digits of one prompt (budget 128: {:.1f} vs {:.1f})",
        gqa_orders_in_ablations,
    ),
    Claim(
        GALLERY,
        "partial: {} of the {} prompts ran — max and avg at budgets 128, 256 and 512 (avg 512: {} of 6 "
        "prompts), pooling none not run) exact match does move with the budget: 0 at 128 and 256, {:.1f} "
        "(max, {} of {}) and {:.0f} (avg, {} prompts) at 512.",
        qwen_pooling,
    ),
    Claim(
        GALLERY,
        "On the {} prompts avg ran at 512, max is 100 as well: the gap between them is the {} prompts avg "
        "never ran (max misses one of them). This grid has no full-cache row for Qwen (its full cache finds "
        "the number in all {} cells of the needle_methods grid above).",
        qwen_pooling_same_prompts,
    ),
    Claim(
        GALLERY,
        "Partial credit {:.1f} / {:.1f} (max / avg) at 128, {:.1f} / {:.1f} at 256.",
        lambda: tuple(
            partial(snap(POOL, QWEN, pooling=pooling, budget=b))
            for b in (128, 256)
            for pooling in ("max", "avg")
        ),
    ),
]


# ------------------------------------------------------------------------------------------- digits
DIGITS_ANCHOR = "same cells). Every SnapKV row here ran with `gqa_order=pool_first`"
DIGITS_CONFIGS = {
    "k=7 (paper)": (7, None),
    "k=15": (15, None),
    "k=31": (31, None),
    "k=7 span=8 (ours)": (7, 8),
    "k=15 span=8 (ours)": (15, 8),
    "k=31 span=8 (ours)": (31, 8),
}


def digits(label: str) -> pd.DataFrame:
    kernel, span = DIGITS_CONFIGS[label]
    return config("digits", SMOL, "snapkv", kernel_size=kernel, span=span, gqa_order="pool_first")


def digits_full() -> pd.DataFrame:
    full = needle_methods(SMOL, "full")
    return full[full["context_length"] <= 4000]


def digits_row(df: pd.DataFrame) -> list[str]:
    lengths = (1000, 2000, 4000)
    assert set(df["sample_id"]) == set(digits_full()["sample_id"])
    cells = needle_row(df, lengths)[: len(lengths)]
    shallow = df[df["depth_percent"] < 100]
    return cells + [
        f"{needle(df, 'exact').mean():.1f}",
        f"{needle(df, 'partial').mean():.1f}",
        f"{needle(shallow, 'partial').mean():.1f}",
    ]


def every_digits_row_pool_first() -> tuple:
    for label in DIGITS_CONFIGS:  # `digits` selects gqa_order=pool_first
        assert len(digits(label)) == 15
    return ()


def kernel7_prefixes() -> tuple:
    df = digits("k=7 (paper)")
    assert exact_cells(df) == {(n, 100) for n in (1000, 2000, 4000)}
    shallow = df[df["depth_percent"] < 100]
    kept = (shallow["scores"].map(lambda s: s["partial"]) * 7).round().astype(int)
    return kept.min(), kept.max()


def span8_equals_full() -> tuple:
    span = digits("k=7 span=8 (ours)").set_index("sample_id")
    full = digits_full().set_index("sample_id").loc[span.index]
    assert (span["scores"] == full["scores"]).all()
    return (len(span),)


def span8_worse_at_2k() -> tuple:
    def at_2k(label: str) -> pd.DataFrame:
        df = digits(label)
        return df[df["context_length"] == 2000]

    assert partial(at_2k("k=31 span=8 (ours)")) < partial(at_2k("k=31"))
    return ()


def digits_config_row(label: str) -> list[str]:
    return digits_row(digits(label))


DIGITS_TODAY_ANCHOR = "**The same ablation on today's defaults, with ChunkKV**"
DIGITS_TODAY = {  # label -> (method, params), gqa_order=reduce_first (today's default)
    **{
        label: ("snapkv", {"kernel_size": k, "span": span, "gqa_order": "reduce_first"})
        for label, (k, span) in DIGITS_CONFIGS.items()
    },
    "chunkkv, chunk 10 (paper)": ("chunkkv", {"chunk_length": 10}),
    "chunkkv, chunk 20 (kvpress)": ("chunkkv", {"chunk_length": 20}),
}


def digits_today_row(label: str) -> list[str]:
    method, params = DIGITS_TODAY[label]
    return digits_row(config("digits", SMOL, method, **params))


def chunkkv_beside_span() -> tuple:
    exact = {label: digits_today_row(label)[3] for label in DIGITS_TODAY}
    return (
        exact["chunkkv, chunk 10 (paper)"],
        exact["chunkkv, chunk 20 (kvpress)"],
        exact["k=7 (paper)"],
        exact["k=7 span=8 (ours)"],
        exact["k=31"],
    )


def today_as_pool_first() -> tuple:
    differ = [label for label in DIGITS_CONFIGS if digits_today_row(label) != digits_config_row(label)]
    return holds(differ == ["k=31 span=8 (ours)"], f"rows that differ between the orders: {differ}")


DIGITS_TODAY_CLAIMS = [
    Claim(
        GALLERY,
        "ChunkKV keeps whole 10- or 20-token chunks and so the whole number where a chunk covers it: {} / {} "
        "exact, above the paper's kernel 7 ({}) and below `span=8` ({}) and kernel 31 ({})",
        chunkkv_beside_span,
    ),
    Claim(
        GALLERY,
        "On today's defaults every row but k=31 span=8 scores as it did with `pool_first`",
        today_as_pool_first,
    ),
]


DIGITS_ROWS = (
    [Row(GALLERY, DIGITS_ANCHOR, "full cache", keyed(("full cache",), lambda: digits_row(digits_full())))]
    + [
        Row(GALLERY, DIGITS_ANCHOR, label, keyed((label,), functools.partial(digits_config_row, label)))
        for label in DIGITS_CONFIGS
    ]
    + [
        Row(GALLERY, DIGITS_TODAY_ANCHOR, label, keyed((label,), functools.partial(digits_today_row, label)))
        for label in DIGITS_TODAY
    ]
)


@functools.cache
def kept_positions() -> tuple[pd.DataFrame, dict]:
    folder = RESULTS / "digits"
    meta = json.loads((folder / "kept_positions.json").read_text(encoding="utf-8"))
    return pd.read_csv(folder / "kept_positions.csv"), meta


def kept_share_of_digits(config_name: str, digits_: range) -> list[float]:
    """Share x100 of the KV heads that kept each digit (0-based), mean over layers."""
    df, _ = kept_positions()
    at = df[(df["config"] == config_name) & df["digit"].isin(list(digits_))]
    return list(at.groupby("digit")["fraction"].mean().mul(100))


def kept_range(config_name: str, digits_: range = range(7)) -> str:
    shares = kept_share_of_digits(config_name, digits_)
    return f"{min(shares):.0f}-{max(shares):.0f}%"


def kept_figure_prompt() -> tuple:
    _, meta = kept_positions()
    length, depth = meta["sample_id"].removeprefix("len").split("_depth")
    assert int(length) == meta["prompt_tokens"]
    digit_positions = meta["digit_positions"]
    windows = {c["window"] for c in meta["configs"].values()}
    (window,) = windows
    return (
        meta["prompt_tokens"],
        int(depth),
        meta["number"],
        digit_positions[0],
        digit_positions[-1],
        meta["budget"],
        window,
    )


DIGITS_CLAIMS = [
    Claim(
        GALLERY,
        "The first figure is one real prompt ({:,} tokens, depth {}, number {} at positions {}-{}, budget {}, "
        "window {})",
        kept_figure_prompt,
    ),
    Claim(
        GALLERY,
        "and on the first digit ({:.0f}% of the KV heads keep it, mean over layers) and fade along the number "
        "(digits 5-7: {})",
        lambda: (
            kept_share_of_digits("votes (no pooling)", range(1))[0],
            kept_range("votes (no pooling)", range(4, 7)),
        ),
    ),
    Claim(
        GALLERY, "(digits 2-4 kept by {} of the heads)", lambda: (kept_range("paper: k=7 max", range(1, 4)),)
    ),
    Claim(
        GALLERY,
        "keep every digit in {}, {} and {} of the heads (means over layers)",
        lambda: tuple(kept_range(c) for c in ("k=15", "k=31", "ours: k=7 span=8")),
    ),
    Claim(GALLERY, "Every SnapKV row here ran with `gqa_order=pool_first`", every_digits_row_pool_first),
    Claim(
        GALLERY,
        "At the paper's kernel 7 SnapKV is exact only at depth 100 (the needle inside the window) and answers "
        "a prefix of {}-{} of the 7 digits elsewhere",
        kernel7_prefixes,
    ),
    Claim(GALLERY, "(k=7 span=8 scores as the full cache in all {} cells)", span8_equals_full),
    Claim(GALLERY, "(k=31 span=8 is already worse at 2K)", span8_worse_at_2k),
]


# -------------------------------------------------------------------------------------------- RULER
RULER_METHODS = {
    "full": ("full", {}),
    "snapkv": ("snapkv", {"gqa_order": "reduce_first", "budget": 1024}),
    "streamingllm": ("streamingllm", {"budget": 1024}),
    "h2o": ("h2o", {"budget": 1024}),
}
SMOL_RULER = "Score x100 per task (rows per method in brackets)"
QWEN_RULER = "Score x100 per task at 4K, in"


@functools.cache
def ruler(model: str, length: int) -> pd.DataFrame:
    """The four RULER configs of one model at one length, `config_label` = the method name."""
    parts = []
    for label, (method, params) in RULER_METHODS.items():
        df = config("ruler", model, method, **params)
        parts.append(df[df["ruler_length"].astype(int) == length].assign(config_label=label, ok=True))
    return pd.concat(parts)


def label_task_means(df: pd.DataFrame, label: str, tasks=RULER_TASKS) -> pd.Series:
    """Score x100 per RULER task of one config of `df`, in `tasks` order."""
    part = df.query("config_label == @label")
    return part.groupby("ruler_task")["score"].mean().mul(100).reindex(list(tasks))


def task_means(model: str, length: int, method: str) -> pd.Series:
    return label_task_means(ruler(model, length), method)


def suite(model: str, length: int, method: str) -> float:
    return task_means(model, length, method).mean()


def ruler_row(model: str, method: str) -> list[str]:
    """`method (rows)`, the task means at 4K and the suite average."""
    means = task_means(model, 4096, method)
    assert means.notna().all()
    n = len(ruler(model, 4096).query("config_label == @method"))
    return [f"{method} ({n})"] + [f"{x:.0f}" for x in means] + [f"**{means.mean():.1f}**"]


def paired(model: str, length: int, a: str, b: str) -> tuple[float, str]:
    """Suite average of `a` minus `b` on their shared samples and its 95% interval, by the report's
    own stratified bootstrap."""
    return paired_in(ruler(model, length), a, b)


def paired_in(df: pd.DataFrame, a: str, b: str) -> tuple[float, str]:
    """The report's paired suite-average difference `a` - `b` over the RULER rows `df`, and its interval."""
    ((*_, point, interval, _),) = paired_differences(df, [(a, b)])
    return point, interval


@functools.cache
def ruler_report_p(model: str, a: str, b: str, length: int) -> tuple[str, str]:
    """The p and Holm's p of `a` minus `b` at `length` in the RULER report's paired table of `model`
    (every config of results/ruler: the report's family), as the report prints them."""
    from eval.tables import column_order
    from eval.tasks.ruler.report import ruler_tables

    df = prepare(all_rows("ruler"))
    md = "\n".join(ruler_tables(df[df["model"] == model], column_order))
    (line,) = [ln for ln in md.splitlines() if ln.startswith(f"| {a} | {b} | {length} |")]
    *_, p, p_holm = (c.strip() for c in line.strip().strip("|").split("|"))
    return p, p_holm


def h2o_vs_streamingllm_qwen() -> tuple[str, str]:
    """Qwen at 4K: H2O minus StreamingLLM has a raw p below 0.05 that Holm's adjustment lifts above."""
    p, p_holm = ruler_report_p(QWEN, "h2o b=1024 fused=true", "streamingllm b=1024 s=4", 4096)
    assert float(p) < 0.05 <= float(p_holm), (p, p_holm)
    return p, p_holm


def paired_text(model: str, length: int, a: str, b: str, digits_: int = 1) -> str:
    point, interval = paired(model, length, a, b)
    return f"{point:+.{digits_}f} {interval}"


def per_task(model: str, length: int) -> int:
    counts = ruler(model, length).groupby(["config_label", "ruler_task"]).size()
    assert counts.nunique() == 1 and len(counts) == len(RULER_METHODS) * len(RULER_TASKS)
    return int(counts.iloc[0])


def shared_samples(model: str) -> int:
    """Every method ran the same samples at 4K: their number."""
    ids = ruler(model, 4096).groupby("config_label")["sample_id"].agg(frozenset)
    assert ids.nunique() == 1, "the methods ran different samples"
    return len(ids.iloc[0])


def fp32_reading() -> tuple:
    fp32 = config("ruler_fp32", SMOL, "full").set_index("sample_id")
    bf16 = ruler(SMOL, 4096).query("config_label == 'full'").set_index("sample_id").loc[fp32.index]
    assert (fp32["score"] == bf16["score"]).all() and len(fp32) == 30
    assert set(fp32["ruler_task"]) == set(RULER_TASKS[:6]) and fp32.groupby("ruler_task").size().eq(5).all()
    return (
        len(fp32),
        int((fp32["score"] == bf16["score"]).sum()),
        100 * fp32["score"].mean(),
        int((fp32["prediction"] == bf16["prediction"]).sum()),
        len(fp32),
    )


def prefill_medians() -> tuple:
    bf16 = ruler(SMOL, 4096).query("config_label == 'full'")
    fp32 = config("ruler_fp32", SMOL, "full")
    assert fp32["torch_threads"].isna().all() and fp32["other_cores"].isna().all()
    return (
        bf16["prefill_s"].median(),
        len(bf16),
        fp32["prefill_s"].median(),
        len(fp32),
        one(set(bf16["torch_threads"])),
        bf16["other_cores"].median(),
    )


def qwen_snapkv_keeps() -> tuple:
    kept = ("niah_single_1", "niah_single_2", "niah_multikey_1")
    snapkv = task_means(QWEN, 4096, "snapkv")
    assert all(snapkv[t] == 100 for t in kept)
    for method in ("streamingllm", "h2o"):  # "lose nearly all of them"
        assert all(task_means(QWEN, 4096, method)[t] <= 25 for t in kept), method
    return ()


def qwen_snapkv_losses() -> tuple:
    snapkv = ruler(QWEN, 4096).query("config_label == 'snapkv'")
    means = task_means(QWEN, 4096, "snapkv")
    assert 40 <= means["niah_multikey_2"] <= 60 and means["niah_multikey_3"] == 0  # about half; all
    return snapkv.loc[snapkv["ruler_task"] == "niah_single_3", "score"].sum(), per_task(QWEN, 4096)


RULER_ROWS = [
    Row(GALLERY, anchor, m, functools.partial(ruler_row, model, m))
    for anchor, model in ((SMOL_RULER, SMOL), (QWEN_RULER, QWEN))
    for m in RULER_METHODS
]
RULER_CLAIMS = [
    Claim(
        GALLERY,
        "RULER's {} tasks that need no external data ({} needle variants, variable tracking, common and "
        "frequent words extraction;",
        lambda: (
            len(set(ruler(SMOL, 4096)["ruler_task"])),
            sum(t.startswith("niah_") for t in set(ruler(SMOL, 4096)["ruler_task"])),
        ),
    ),
    Claim(
        GALLERY,
        "Every method ran the same {} samples, so the differences are paired",
        lambda: (shared_samples(SMOL),),
    ),
    Claim(
        GALLERY,
        "the same {} generated samples for every method). Score x100 per task at 4K",
        lambda: (shared_samples(QWEN),),
    ),
    Claim(
        GALLERY,
        "Paired differences ({} shared samples, 95% stratified-bootstrap interval)",
        lambda: (paired_differences(ruler(QWEN, 4096), [("snapkv", "full")])[0][3],),
    ),
    Claim(
        GALLERY,
        "(4K: SmolLM2 and Qwen2.5-Coder, {} samples per task, every method; Qwen 8K: {} per task)",
        lambda: (
            holds(per_task(QWEN, 4096) == per_task(SMOL, 4096), "the same samples per task at 4K")
            + (per_task(SMOL, 4096), per_task(QWEN, 8192))
        ),
    ),
    Claim(
        GALLERY,
        "{} rows, {} samples of each of the {} tasks for each of the four methods",
        lambda: (len(ruler(SMOL, 4096)), per_task(SMOL, 4096), len(RULER_TASKS)),
    ),
    Claim(
        GALLERY,
        "the rows' median 4K prefill of SmolLM2's full cache is {:.1f} s in bf16 (the {} rows here) against "
        "{:.1f} s in fp32 (the {} rows of [ruler_fp32/](ruler_fp32/report.md)), wall time while other jobs "
        "shared the machine (the bf16 rows record {} torch thread and a median {:.1f} other cores busy; the "
        "fp32 rows predate that record)",
        prefill_medians,
    ),
    Claim(
        GALLERY,
        "on the {} samples that also ran in fp32 ([ruler_fp32/](ruler_fp32/report.md), the first 6 tasks x 5 "
        "samples, an earlier fp32 run) all {} scores are equal ({:.1f} both) and {} of {} answers are identical "
        "strings",
        fp32_reading,
    ),
    Claim(
        GALLERY,
        "against the full cache snapkv {}, streamingllm {}, h2o {}; snapkv - streamingllm {}, streamingllm - h2o {}.",
        lambda: tuple(
            paired_text(SMOL, 4096, a, b)
            for a, b in [
                ("snapkv", "full"),
                ("streamingllm", "full"),
                ("h2o", "full"),
                ("snapkv", "streamingllm"),
                ("streamingllm", "h2o"),
            ]
        ),
    ),
    Claim(
        GALLERY,
        "SnapKV keeps niah_single_1 (noise haystack, one number) at {:.0f} where StreamingLLM and H2O fall to "
        "{:.0f} and {:.0f}",
        lambda: tuple(task_means(SMOL, 4096, m)["niah_single_1"] for m in ("snapkv", "streamingllm", "h2o")),
    ),
    Claim(
        GALLERY,
        "(niah_single_2: full {:.0f}, snapkv {:.0f})",
        lambda: tuple(task_means(SMOL, 4096, m)["niah_single_2"] for m in ("full", "snapkv")),
    ),
    Claim(
        GALLERY,
        "The ordering snapkv > streamingllm > h2o, both paired gaps above zero",
        lambda: holds(
            all(
                interval(paired(SMOL, 4096, a, b)[1])[0] > 0
                for a, b in [("snapkv", "streamingllm"), ("streamingllm", "h2o")]
            ),
            "both lower interval ends above zero",
        ),
    ),
    Claim(
        GALLERY,
        "(880 rows at 4K;",
        lambda: holds(len(ruler(QWEN, 4096)) == 880, f"{len(ruler(QWEN, 4096))} rows"),
    ),
    Claim(
        GALLERY,
        "snapkv - full {} [{}], streamingllm - full {}, h2o - full {}; snapkv - streamingllm {}; h2o - "
        "streamingllm {} (the interval only just excludes zero, p = {}, and Holm's adjustment over the report's "
        "table lifts it to {}: no difference detected; H2O a little below StreamingLLM on average",
        lambda: (
            paired_text(QWEN, 4096, "snapkv", "full").split(" [")[0],
            paired(QWEN, 4096, "snapkv", "full")[1].strip("[]"),
            paired_text(QWEN, 4096, "streamingllm", "full"),
            paired_text(QWEN, 4096, "h2o", "full"),
            paired_text(QWEN, 4096, "snapkv", "streamingllm"),
            paired_text(QWEN, 4096, "h2o", "streamingllm"),
            *h2o_vs_streamingllm_qwen(),
        ),
    ),
    Claim(
        GALLERY,
        "SnapKV keeps niah_single_1, niah_single_2 and niah_multikey_1 at 100, where StreamingLLM and H2O",
        qwen_snapkv_keeps,
    ),
    Claim(
        GALLERY,
        "it loses niah_single_3 (UUID values, {:.0f} of {}), about half of niah_multikey_2 and all of "
        "niah_multikey_3 (UUID keys)",
        qwen_snapkv_losses,
    ),
    Claim(
        GALLERY,
        "(88 rows, the same command with",
        lambda: holds(len(ruler(QWEN, 8192)) == 88, f"{len(ruler(QWEN, 8192))} rows"),
    ),
    Claim(
        GALLERY,
        "Suite average x100: full {:.1f}, snapkv {:.1f}, streamingllm {:.1f}, h2o {:.1f} (4K: {:.1f}, {:.1f}, "
        "{:.1f}, {:.1f})",
        lambda: tuple(
            suite(QWEN, n, m) for n in (8192, 4096) for m in ("full", "snapkv", "streamingllm", "h2o")
        ),
    ),
    Claim(
        GALLERY,
        "its paired differences at 8K ({} shared samples, {} per task) withhold the interval "
        '("n<5 per task": a bootstrap resampling {} samples within each task is degenerate; snapkv - full '
        "{:.2f} {})",
        lambda: (
            len(ruler(QWEN, 8192).query("config_label == 'full'")),
            per_task(QWEN, 8192),
            per_task(QWEN, 8192),
            *paired(QWEN, 8192, "snapkv", "full"),
        ),
    ),
    Claim(
        GALLERY,
        'marks the "avg" column with ‡ where it averages a {}-sample 4K reading and a {}-sample 8K reading '
        "with equal weight (full {:.2f}, snapkv {:.2f}, streamingllm {:.2f}, h2o {:.2f})",
        lambda: (
            len(RULER_TASKS) * per_task(QWEN, 4096),
            len(RULER_TASKS) * per_task(QWEN, 8192),
            *(
                (suite(QWEN, 4096, m) + suite(QWEN, 8192, m)) / 2
                for m in ("full", "snapkv", "streamingllm", "h2o")
            ),
        ),
    ),
]


# ------------------------------------------------------------------------------- speed and memory
BENCH_RATIOS = (
    "tpot snapkv(L)/full(S)",
    "tpot full(L)/snapkv(L)",
    "prefill snapkv/full(L)",
    "prefill h2o/full(L)",
)


@functools.cache
def bench_runs(folder: str, clock: str | None = None, all_rounds: bool = False) -> tuple:
    """`scripts/bench_agreement.py`'s summaries of run1-3 of one benchmark folder."""
    out = []
    for i in (1, 2, 3):
        with (RESULTS / "bench" / folder / f"run{i}.csv").open(newline="") as f:
            rows_ = list(csv.DictReader(f))
        out.append(summarise_run(f"run{i}", rows_, clock or default_clock(rows_), all_rounds))
    return tuple(out)


def medians(ratio: str, folder: str = "validation8k_ref", **kw) -> list[float]:
    return [run.spreads[ratio].median for run in bench_runs(folder, **kw)]


def spread_pct(ratio: str, folder: str = "validation8k_ref", **kw) -> float:
    m = medians(ratio, folder, **kw)
    return 100 * (max(m) / min(m) - 1)


def bench_reading() -> tuple:
    ref = bench_runs("validation8k_ref")
    assert all(run.spreads[r].q3 <= 1.05 for run in ref for r in BENCH_RATIOS[:1])  # meets <= 1.05
    assert all(run.spreads[BENCH_RATIOS[1]].q1 >= 2.0 for run in ref)  # meets >= 2.0
    assert all(spread_pct(r) < 10 for r in BENCH_RATIOS)  # agree within 10% on every ratio
    assert all(run.spreads[BENCH_RATIOS[3]].q1 > 1.15 for run in ref)  # misses 1.15
    under = sum(run.spreads[BENCH_RATIOS[2]].q3 <= 1.02 for run in ref)
    values = []
    for ratio, digits_ in zip(BENCH_RATIOS, (3, 2, 3, 2)):
        values.append(" / ".join(f"{m:.{digits_}f}" for m in medians(ratio)))
    return (
        values[0],
        spread_pct(BENCH_RATIOS[0]),
        values[1],
        values[2],
        spread_pct(BENCH_RATIOS[2]),
        under,
        len(ref),
        values[3],
        spread_pct(BENCH_RATIOS[3]),
    )


def raw_cpu_spreads() -> tuple:
    now = [spread_pct(r, "validation8k_ref", clock="cpu", all_rounds=True) for r in BENCH_RATIOS]
    before = [spread_pct(r, "validation8k", clock="cpu") for r in BENCH_RATIOS]
    return tuple(f"{x:.0f}%" for x in now) + tuple(f"{x:.0f}%" for x in before)


BENCH_CLAIMS = [
    Claim(
        GALLERY,
        "Three {}-round runs at 8K with the reference clock",
        lambda: (one({run.rounds for run in bench_runs("validation8k_ref")}),),
    ),
    Claim(
        GALLERY,
        "TPOT snapkv(8K, b=512)/full(512) {} ({:.1f}%, meets <= 1.05), TPOT full(8K)/snapkv(8K) {} (meets >= "
        "2.0), prefill snapkv/full(8K) {} ({:.1f}%; IQR under 1.02 in {} of {} runs; the compression is 0.9% of "
        "the prefill by the per-step count in docs/benchmarking.md), H2O's prefill {} ({:.1f}%; misses 1.15,",
        bench_reading,
    ),
    Claim(
        GALLERY,
        "The same rounds in raw CPU time spread {} / {} / {} / {}; three earlier raw-CPU runs "
        "([validation8k/](bench/validation8k/)) {} / {} / {} / {}:",
        raw_cpu_spreads,
    ),
]


# ------------------------------------------------------------------------------------- observation
@functools.cache
def observation() -> dict:
    return json.loads((RESULTS / "observation" / "summary.json").read_text(encoding="utf-8"))


OBSERVATION_CLAIMS = [
    Claim(
        GALLERY,
        "Headline: {:.2f} hit rate (chance {:.2f}; position-only baseline {:.2f}), {:.3f} vs {:.3f} for the "
        "question at the end vs the start",
        lambda: (
            observation()["hit_rate_by_selection"]["top5%"],
            observation()["chance"],
            observation()["hit_rate_by_selection"]["sink4+recent (baseline)"],
            observation()["hit_rate_by_placement"]["end"],
            observation()["hit_rate_by_placement"]["start"],
        ),
    ),
]


# --------------------------------------------------------------------------------------- README.md
def readme_default_grid() -> tuple:
    full = config(SWEEP, SMOL, "full")
    grid = {(int(n), int(d)) for n, d in zip(full["context_length"], full["depth_percent"])}
    assert grid == {(n, d) for n in (1000, 2000) for d in (10, 50, 90)}
    pool_first = snap(SWEEP, gqa_order="pool_first", window=32, budget=512)
    default = snap(SWEEP, gqa_order="reduce_first", window=32, budget=512)
    assert (pool_first.set_index("sample_id")["scores"] == default.set_index("sample_id")["scores"]).all()
    return ()


def readme_streamingllm() -> tuple:
    df = needle_methods(SMOL, "streamingllm")
    df = df[df["context_length"] <= 2000]
    assert exact_cells(df) == {(1000, 50), (1000, 75), (1000, 100), (2000, 100)}
    return len(df), needle(df, "exact").mean(), needle(df, "partial").mean()


def readme_cache_cut() -> tuple:
    df = needle_methods(SMOL, "snapkv", gqa_order="reduce_first")
    df = df[df["context_length"] == 8000]
    ratios = set(df["kv_bytes_full"] / df["kv_bytes"])
    (ratio,) = ratios
    return (ratio,)


README_GRID = "What it shows, from the committed rows of the same 6 prompts"


def readme_full_row() -> list[str]:
    full = config(SWEEP, SMOL, "full")
    return [f"{needle(full, m).mean():.0f}" for m in ("exact", "partial")]


def readme_snapkv_row() -> list[str]:
    readme_default_grid()
    df = snap(SWEEP, gqa_order="reduce_first", window=32, budget=512)
    return [f"{needle(df, m).mean():.0f}" for m in ("exact", "partial")]


README_ROWS = [
    Row(
        README,
        README_GRID,
        "full cache",
        keyed(
            ("full cache",), lambda: readme_full_row() + ["the 135M model finds the number at every depth"]
        ),
    ),
    Row(
        README,
        README_GRID,
        "snapkv",
        keyed(
            ("snapkv (window 32, kernel 7, max-pool)",),
            lambda: readme_snapkv_row() + ["keeps the number's first digits, loses its tail"],
        ),
    ),
]
README_CLAIMS = [
    Claim(README, "cuts an 8K-token prompt's KV cache {:.0f}x (exact bytes", readme_cache_cut),
    Claim(
        README,
        "(depths 0/25/50/75/100, {} prompts) it scores {:.0f} / {:.0f}: exact where the needle is among the "
        "recent tokens, 0 elsewhere",
        readme_streamingllm,
    ),
]


# --------------------------------------------------------------- the catalogue on Qwen's needle grid
CATALOGUE_NEEDLE = "**The 2026 catalogue on Qwen's grid**"
CATALOGUE_LENGTHS = (1000, 2000, 4000, 8000)
CATALOGUE_METHODS = {  # label -> (method, params): today's defaults
    "full": ("full", {}),
    "snapkv": ("snapkv", {"gqa_order": "reduce_first"}),
    "expected_attention": ("expected_attention", {}),
    "adakv_expected_attention": ("adakv_expected_attention", {}),
    "tova": ("tova", {}),
    "knorm": ("knorm", {}),
    "chunkkv": ("chunkkv", {}),
    "criticalkv": ("criticalkv", {}),
    "kvzip": ("kvzip", {}),
}


def catalogue_row(method: str, params: dict) -> list[str]:
    df = config("needle_methods", QWEN, method, **params)
    return needle_row(df[df["context_length"] <= max(CATALOGUE_LENGTHS)], lengths=CATALOGUE_LENGTHS)


def catalogue_rows() -> list[Row]:
    """One row per method of the catalogue table that has committed rows."""
    ran = set(rows("needle_methods").query("model == @QWEN")["method"])
    return [
        Row(GALLERY, CATALOGUE_NEEDLE, label, keyed((label,), functools.partial(catalogue_row, m, p)))
        for label, (m, p) in CATALOGUE_METHODS.items()
        if m in ran
    ]


CATALOGUE_VS_SNAPKV = ("chunkkv", "kvzip", "tova", "adakv_expected_attention", "criticalkv", "expected_attention",
                       "knorm")  # fmt: skip


@functools.cache
def catalogue_vs_snapkv() -> dict:
    """Each catalogue method minus SnapKV (exact score x100) on Qwen's needle cells both ran, as the
    needle report's paired table computes it (eval/report/paired.py): `method diff [lo, hi] (n, p,
    Holm)`, Holm's adjustment over the table's rows (the report's family)."""
    from eval.report.paired import paired_rows

    df = prepare(rows("needle_methods"))
    part = df[df["model"] == QWEN]
    paired = paired_rows(part)

    def label(method: str, **params) -> str:
        (h,) = set(config("needle_methods", QWEN, method, **params)["method_hash"])
        (name,) = set(part.loc[part["method_hash"] == h, "config_label"])
        return name

    paired = paired[paired["baseline"] == label("snapkv", gqa_order="reduce_first")]
    out = {}
    for m in CATALOGUE_VS_SNAPKV:
        r = paired[paired["config"] == label(m)].iloc[0]
        p = "p<0.001" if r["p"] < 0.001 else f"p={r['p']:.3f}"
        out[m] = (
            f"{r['diff']:+.1f} [{r['lo']:+.1f}, {r['hi']:+.1f}] (n={int(r['n_shared'])}, {p}, Holm {r['p_holm']:.3f})"
        )
    out["comparisons"] = len(paired_rows(part))
    return out


# ------------------------------------------------------------------------ shared-context protocols
SMOL_MODEL, QWEN_MODEL = "smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"
# (results folder, model) -> the README table of its protocol rows
PROTOCOL_ANCHORS = {
    ("protocols", SMOL_MODEL): "**Compression loss per protocol** (SmolLM2",
    ("protocols", QWEN_MODEL): "**Compression loss per protocol, Qwen2.5-Coder**",
    ("protocols_fp32", QWEN_MODEL): "**Compression loss per protocol, Qwen2.5-Coder, float32**",
}


@functools.cache
def protocol_frame(model: str = SMOL_MODEL, folder: str = "protocols") -> pd.DataFrame:
    frame = protocol_report.frame(prepare(all_rows(folder)))
    return frame[frame["model"] == model]


@functools.cache
def protocol_ok(model: str = SMOL_MODEL, folder: str = "protocols") -> pd.DataFrame:
    """The rows of `protocol_frame` that ran and were scored."""
    part = protocol_frame(model, folder)
    return part[part["ok"] & part["score"].notna()]


PROTOCOL_METHODS = (
    "full", "snapkv", "pyramidkv", "adakv", "h2o", "streamingllm", "chunkkv", "criticalkv", "tova", "knorm",
    "expected_attention", "adakv_expected_attention", "kvzip",
)  # fmt: skip
SHIFTS = ("context_only", "first_question", "multi_turn")


def protocol_part(
    method: str, model: str = SMOL_MODEL, folder: str = "protocols"
) -> tuple[pd.DataFrame, str]:
    """The ok rows of `method` and of the full cache with `model`, on the questions both answered
    under every protocol (so every cell of a README row rests on the same questions), and the
    method's `method_key`."""
    ok = protocol_ok(model, folder)
    (key,) = sorted(set(ok.loc[ok["method"] == method, "method_key"]))
    (full,) = sorted(set(ok.loc[ok["method"] == "full", "method_key"]))
    both = ok[ok["method_key"].isin({key, full})]
    per = both.groupby(["method_key", "protocol"])["sample_id"].agg(set)
    assert len(per) == len(PROTOCOLS) * len({key, full}), per.index.tolist()
    return both[both["sample_id"].isin(set.intersection(*per))], key


def protocol_row(method: str, model: str = SMOL_MODEL, folder: str = "protocols") -> list[str]:
    return list(_protocol_row(method, model, folder))


@functools.cache
def _protocol_row(method: str, model: str, folder: str) -> tuple[str, ...]:
    """method | questions | score x100 under each protocol | minus the full cache under query_aware
    [95% CI] | the shift of that loss to context_only, first_question and multi_turn [95% CI], as the
    report computes them (eval/report/protocols.py), on the questions of `protocol_part`."""
    part, key = protocol_part(method, model, folder)
    mine = part[part["method_key"] == key]
    scores = mine.groupby("protocol")["score"].mean().mul(100).reindex(PROTOCOLS)
    cells = [method, str(mine["sample_id"].nunique()), *(f"{x:.1f}" for x in scores)]
    if method == "full":
        return (*cells, *["—"] * (1 + len(SHIFTS)))
    loss = protocol_report.compression_penalty(part).set_index("protocol")
    qa = loss.loc["query_aware"]
    cells.append(f"{qa['loss']:+.1f} [{qa['low']:+.1f}, {qa['high']:+.1f}]")
    for p in SHIFTS:
        r = loss.loc[p]
        cells.append(f"{r['shift']:+.1f} [{r['shift_low']:+.1f}, {r['shift_high']:+.1f}]")
    return tuple(cells)


def protocol_methods(model: str, folder: str = "protocols") -> list[str]:
    """PROTOCOL_METHODS with committed rows under every protocol for `model` in `folder`, when the
    full cache has them too (a README row needs both)."""
    if not (RESULTS / folder).is_dir():
        return []
    ran = rows(folder).query("model == @model").groupby("method")["protocol"].nunique()
    if ran.get("full", 0) != len(PROTOCOLS):
        return []
    return [m for m in PROTOCOL_METHODS if ran.get(m, 0) == len(PROTOCOLS)]


def protocol_rows() -> list[Row]:
    """One README row per method with rows under every protocol, per results folder and model."""
    return [
        Row(GALLERY, anchor, f"{folder} {model} {m}", functools.partial(protocol_row, m, model, folder))
        for (folder, model), anchor in PROTOCOL_ANCHORS.items()
        for m in protocol_methods(model, folder)
    ]


def protocol_coverage(model: str = SMOL_MODEL, folder: str = "protocols") -> str:
    """Contexts (questions) each method's rows cover, methods grouped by count: "full and snapkv 20
    contexts (80 questions) under each protocol; h2o 8-12 (the counts differ between protocols) ..."."""
    df = rows(folder).query("model == @model")
    (k,) = set(df["questions_in_context"].astype(int))  # questions per context
    per = df.groupby(["method", "protocol"])["context_id"].nunique().unstack("protocol")
    per = per.reindex(columns=list(PROTOCOLS)).fillna(0).astype(int)
    questions = df.groupby("method").size()
    groups: dict[tuple[int, int], list[str]] = {}
    for method in (m for m in PROTOCOL_METHODS if m in per.index):
        groups.setdefault((per.loc[method].min(), per.loc[method].max()), []).append(method)
    parts = []
    for i, ((lo, hi), methods) in enumerate(sorted(groups.items(), key=lambda kv: -kv[0][1])):
        names = methods[0] if len(methods) == 1 else ", ".join(methods[:-1]) + " and " + methods[-1]
        if lo != hi:
            parts.append(f"{names} {lo}-{hi} (the counts differ between protocols: a run cut mid-way)")
            continue
        assert all(questions[m] == k * hi * len(PROTOCOLS) for m in methods)
        parts.append(
            f"{names} {hi} contexts ({k * hi} questions) under each protocol"
            if i == 0
            else f"{names} {hi} ({k * hi})"
        )
    return "; ".join(parts)


def protocol_dtype(model: str, folder: str = "protocols") -> str:
    """The one dtype every protocol row of `model` in `folder` ran in."""
    (dtype,) = set(rows(folder).query("model == @model")["dtype"])
    return dtype


PROTOCOL_COLUMNS = ("method", "questions", *PROTOCOLS, "loss", *(f"shift_{p}" for p in SHIFTS))


def pcell(method: str, column: str, model: str = SMOL_MODEL, folder: str = "protocols") -> str:
    """One cell of `protocol_row` by its PROTOCOL_COLUMNS name."""
    return protocol_row(method, model, folder)[PROTOCOL_COLUMNS.index(column)]


def full_by_protocol() -> tuple:
    score = {p: pcell("full", p) for p in PROTOCOLS}
    assert score["query_aware"] == score["context_only"] == score["multi_request"]
    return score["query_aware"], score["first_question"], score["multi_turn"]


def shift_tost(method: str, margin: float, model: str = SMOL_MODEL, protocol: str = "context_only"):
    """The TOST (`stats.tost`, over contexts) of `method`'s shift from query_aware to `protocol`, on
    the questions of `protocol_part`, as the report forms the shift."""
    part, key = protocol_part(method, model)

    def scores(k: str, p: str) -> pd.Series:
        return part[(part["method_key"] == k) & (part["protocol"] == p)].set_index("sample_id")["score"]

    (full,) = set(part["method_key"]) - {key}
    d = (scores(key, protocol) - scores(full, protocol)) - (
        scores(key, "query_aware") - scores(full, "query_aware")
    )
    mine = part[(part["method_key"] == key) & (part["protocol"] == protocol)].set_index("sample_id")
    return stats.tost(100 * d.to_numpy(), margin, mine.loc[d.index, "context_id"].to_numpy())


def snapkv_thesis() -> tuple:
    """SnapKV's loss with the question in the window, and its shift when the context is compressed
    alone (an interval around zero, and within +-10 points by a TOST over contexts: the "nothing
    measurable"); PyramidKV's shift (not below zero)."""
    shift = pcell("snapkv", "shift_context_only")
    lo, hi = interval(shift)
    assert lo <= 0 <= hi, shift
    same = shift_tost("snapkv", 10)
    assert same.equivalent, same
    pyramid = pcell("pyramidkv", "shift_context_only")
    assert interval(pyramid)[0] >= 0, pyramid
    p = "< 0.001" if same.p < 0.001 else f"= {same.p:.3f}"
    return pcell("snapkv", "loss"), shift, f"{same.margin:g}", same.n_units, p, pyramid


def ada_ea_thesis() -> tuple:
    """Ada-KV Expected Attention: lower without the question in the window (a shift below zero, its
    interval from below zero); ChunkKV: the most negative shift of the SmolLM2 methods, the only
    interval below zero."""
    m = "adakv_expected_attention"
    shift = pcell(m, "shift_context_only")
    assert point(shift) < 0 and interval(shift)[0] < 0, shift
    shifts = {x: pcell(x, "shift_context_only") for x in protocol_methods(SMOL_MODEL) if x != "full"}
    below = [x for x, c in shifts.items() if interval(c)[1] < 0]
    assert below == ["chunkkv"] and min(shifts, key=lambda x: point(shifts[x])) == "chunkkv", shifts
    return (
        pcell(m, "query_aware"), pcell(m, "context_only"), shift, pcell(m, "questions"),
        shifts["chunkkv"], pcell("chunkkv", "questions"),
    )  # fmt: skip


def protocol_floor() -> tuple:
    """The full cache's own drop under first_question and multi_turn, beside the shifts of the
    methods: positive for most of them."""
    qa, fq, mt = (float(x) for x in full_by_protocol())
    methods = [m for m in protocol_methods(SMOL_MODEL) if m != "full"]
    positive = [m for m in methods if point(pcell(m, "shift_first_question")) > 0]
    assert len(positive) > len(methods) / 2, positive
    return f"{qa - fq:.1f}", f"{qa - mt:.1f}"


def kvzip_protocols() -> tuple:
    """KVzip loses least to the full cache under query_aware (ties allowed), and no more without the
    question in the window (an interval around zero)."""
    losses = {m: point(pcell(m, "loss")) for m in [m for m in protocol_methods(SMOL_MODEL) if m != "full"]}
    assert losses["kvzip"] == max(losses.values()), losses
    shift = pcell("kvzip", "shift_context_only")
    assert interval(shift)[0] <= 0 <= interval(shift)[1]
    return pcell("kvzip", "loss"), shift


def paired_cell(a: pd.DataFrame, b: pd.DataFrame) -> tuple[pd.Series, str]:
    """Score x100 of rows `a` minus rows `b` (both indexed by sample_id) on the questions both hold,
    and "+d [lo, hi]" with the report's bootstrap over whole contexts."""
    both = a.index.intersection(b.index)
    d = (a.loc[both, "score"] - b.loc[both, "score"]) * 100
    c = stats.compare_differences(d.to_numpy(), a.loc[both, "context_id"].to_numpy())
    return d, f"{c.diff:+.1f} [{c.lo:+.1f}, {c.hi:+.1f}]"


def protocol_paired(
    a: str, b: str, protocol: str = "query_aware", model: str = SMOL_MODEL, folder: str = "protocols"
) -> tuple[pd.Series, str]:
    """Method `a` minus method `b` under `protocol`, paired by question: `paired_cell`'s differences
    and cell."""
    ok = protocol_ok(model, folder)
    ok = ok[ok["protocol"] == protocol].set_index("sample_id")
    return paired_cell(ok[ok["method"] == a], ok[ok["method"] == b])


def protocol_versus(
    a: str, b: str, protocol: str = "query_aware", model: str = SMOL_MODEL, folder: str = "protocols"
) -> str:
    """The cell of `protocol_paired`."""
    return protocol_paired(a, b, protocol, model, folder)[1]


def smol_recency() -> tuple:
    """SmolLM2: StreamingLLM (recency alone) not below SnapKV with the question in the window."""
    diff = protocol_versus("streamingllm", "snapkv")
    assert interval(diff)[0] >= 0 < point(diff), diff
    return pcell("streamingllm", "query_aware"), pcell("snapkv", "query_aware"), diff


def qwen_thesis() -> tuple:
    """Qwen: the full cache's query_aware score; SnapKV, Ada-KV and PyramidKV with the question in
    the window, without it, the shift (below zero for each: the interval, and the exact sign-flip p
    over the contexts below 0.05) and their questions."""
    cells: list[str] = [pcell("full", "query_aware", QWEN_MODEL)]
    for m in ("snapkv", "adakv", "pyramidkv"):
        shift = pcell(m, "shift_context_only", QWEN_MODEL)
        assert interval(shift)[1] < 0, (m, shift)
        # 16 contexts: the statement rests on the exact sign-flip p over them, not on the interval.
        part, _ = protocol_part(m, QWEN_MODEL)
        loss = protocol_report.compression_penalty(part).set_index("protocol").loc["context_only"]
        assert loss["contexts_shift"] < stats.FEW_UNITS and loss["shift_p"] < 0.05, (m, loss["shift_p"])
        cells += [pcell(m, c, QWEN_MODEL) for c in ("query_aware", "context_only")]
        cells += [shift, pcell(m, "questions", QWEN_MODEL)]
    return tuple(cells)


def qwen_context_only_recency() -> tuple:
    """Qwen: SnapKV compressing the context alone against StreamingLLM (an interval around zero)."""
    diff = protocol_versus("snapkv", "streamingllm", "context_only", QWEN_MODEL)
    lo, hi = interval(diff)
    assert lo <= 0 <= hi, diff
    return (diff,)


def reuse_later(method: str, model: str, folder: str = "protocols") -> tuple:
    """Under first_question: the first question's score (equal to query_aware's, the same
    compression), then the later questions' score against query_aware's on the same questions
    (`paired_cell`), and their count."""
    ok = protocol_ok(model, folder)
    ok = ok[ok["method"] == method].set_index("sample_id")
    fq, qa = (ok[ok["protocol"] == p] for p in ("first_question", "query_aware"))
    fq, qa = fq.loc[fq.index.intersection(qa.index)], qa.loc[qa.index.intersection(fq.index)]
    first, later = fq[fq["question_index"] == 0], fq[fq["question_index"] != 0]
    assert first["score"].mean() == qa.loc[first.index, "score"].mean()
    d, cell = paired_cell(later, qa)
    assert d.mean() < 0, d.mean()  # the later questions lose on average
    return (
        f"{first['score'].mean() * 100:.1f}",
        f"{later['score'].mean() * 100:.1f}",
        f"{qa.loc[later.index, 'score'].mean() * 100:.1f}",
        cell,
        str(len(d)),
    )


FP32 = "protocols_fp32"  # Qwen's protocol rows in float32, every config of the catalogue
CATALOGUE_NAMES = {"kvzip": "KVzip", "chunkkv": "ChunkKV", "criticalkv": "CriticalKV", "tova": "TOVA",
                   "knorm": "KNorm", "expected_attention": "Expected Attention",
                   "adakv_expected_attention": "Ada-KV Expected Attention"}  # fmt: skip


def qwen_dtypes_agree() -> tuple:
    """Qwen: the answers both the bfloat16 (results/protocols) and float32 (results/protocols_fp32)
    rows hold (same method, protocol and question), the methods both hold, how many predictions are
    equal character for character, the methods equal on every answer, and the largest gap between
    a method's mean score x100 in one dtype and in the other."""
    key = ["method", "protocol", "sample_id"]
    bf16, fp32 = (rows(f).query("model == @QWEN_MODEL") for f in ("protocols", FP32))
    both = bf16[[*key, "prediction", "score"]].merge(fp32[[*key, "prediction", "score"]], on=key)
    both["same"] = both["prediction_x"] == both["prediction_y"]
    methods = [m for m in PROTOCOL_METHODS if m in set(both["method"])]
    equal = both.groupby("method")["same"].all()
    means = both.groupby("method")[["score_x", "score_y"]].mean().mul(100)
    gap = (means["score_x"] - means["score_y"]).abs().max()
    return (
        str(len(both)),
        ", ".join(methods),
        str(int(both["same"].sum())),
        ", ".join(m for m in methods if equal[m]) or "none",
        f"{gap:.1f}",
    )


@functools.cache
def fp32_vs_snapkv(protocol: str) -> dict[str, str]:
    """Qwen float32: each catalogue method minus SnapKV under `protocol`, paired by question
    (`paired_cell`), by method; "n" the questions every pair shares (the same for all)."""
    got, shared = {}, set()
    for m in CATALOGUE_NAMES:
        d, got[m] = protocol_paired(m, "snapkv", protocol, QWEN_MODEL, FP32)
        shared.add(len(d))
    (got["n"],) = (str(n) for n in shared)
    return got


def fp32_cells(protocol: str) -> tuple:
    got = fp32_vs_snapkv(protocol)
    return (got["n"], *(got[m] for m in CATALOGUE_NAMES))


def fp32_sides(protocol: str) -> tuple:
    """The contexts, and the catalogue methods ahead of SnapKV, behind it, and with no difference
    detected, by the exact sign-flip p over contexts (`stats.compare_differences`' p_exact), each
    with its p."""
    ok = protocol_ok(QWEN_MODEL, FP32)
    ok = ok[ok["protocol"] == protocol].set_index("sample_id")
    sides: dict[str, list[str]] = {"above": [], "below": [], "none": []}
    contexts = set()
    for m, name in CATALOGUE_NAMES.items():
        a, b = ok[ok["method"] == m], ok[ok["method"] == "snapkv"]
        both = a.index.intersection(b.index)
        d = (a.loc[both, "score"] - b.loc[both, "score"]) * 100
        c = stats.compare_differences(d.to_numpy(), a.loc[both, "context_id"].to_numpy())
        contexts.add(c.n_units)
        assert c.n_units < stats.FEW_UNITS and c.p_read == c.p_exact
        side = "none" if c.p_exact >= 0.05 else "above" if c.diff > 0 else "below"
        sides[side].append(f"{name} (p = {c.p_exact:.3f})")
    (n,) = contexts
    return (n, *(", ".join(v) or "none" for v in sides.values()))


def fp32_claims(protocol: str) -> list[Claim]:
    """The README's two sentences on the catalogue against SnapKV under `protocol`: the paired cells,
    then which side of zero each interval lies."""
    return [
        Claim(
            GALLERY,
            f"Each catalogue method minus SnapKV under `{protocol}` ({{}} questions, paired): KVzip {{}}, "
            "ChunkKV {}, CriticalKV {}, TOVA {}, KNorm {}, Expected Attention {}, Ada-KV Expected Attention {}.",
            functools.partial(fp32_cells, protocol),
        ),
        Claim(
            GALLERY,
            f"Under `{protocol}`, by the exact sign-flip test over the {{}} contexts (p < 0.05; a context's "
            "questions fall together, so the context is the unit), ahead of SnapKV: {}; behind it: {}; no "
            "difference detected: {}.",
            functools.partial(fp32_sides, protocol),
        ),
    ]


WINDOW_METHODS = ("snapkv", "pyramidkv", "adakv", "chunkkv", "criticalkv")


def fp32_window_context_only() -> tuple:
    """Qwen float32 under `context_only`: the methods ranking by the observation window's attention
    answer exactly the same questions; how many, and that they are every question of some contexts
    and none of the rest: the contexts answered, and the contexts."""
    ok = protocol_ok(QWEN_MODEL, FP32)
    ok = ok[(ok["protocol"] == "context_only") & ok["method"].isin(WINDOW_METHODS)]
    right = {m: frozenset(g.loc[g["score"] > 0, "sample_id"]) for m, g in ok.groupby("method")}
    assert set(right) == set(WINDOW_METHODS) and len(set(right.values())) == 1, right
    (hit,) = set(right.values())
    per = ok[ok["method"] == "snapkv"].assign(hit=lambda d: d["sample_id"].isin(hit))
    per = per.groupby("context_id")["hit"].agg(["all", "any"])
    assert (per["all"] == per["any"]).all()  # a context's questions come back together or not at all
    return str(len(hit)), str(int(per["all"].sum())), str(len(per))


PROTOCOL_CLAIMS = [
    Claim(GALLERY, "What ran on SmolLM2: {}.", lambda: (protocol_coverage(SMOL_MODEL),)),
    Claim(
        GALLERY,
        "Qwen2.5-Coder-0.5B at 2K, in {}: {};",
        lambda: (protocol_dtype(QWEN_MODEL), protocol_coverage(QWEN_MODEL)),
    ),
    Claim(
        GALLERY,
        "the full cache answers {} under `query_aware`, `context_only` and `multi_request` (the same forwards, "
        "identical answers), {} under `first_question` (a later question after an empty assistant turn confuses "
        "the 135M model) and {} under `multi_turn`",
        full_by_protocol,
    ),
    Claim(
        GALLERY,
        "With the question in the window (`query_aware`) SnapKV loses {} to the full cache; compressing the "
        "context alone (`context_only`, `multi_request`) moves that loss by {} (within ±{} points by a TOST over "
        "the {} contexts, p {}): on SmolLM2 and this task the question in the window buys SnapKV nothing "
        "measurable, and PyramidKV does no better with it (shift {}).",
        snapkv_thesis,
    ),
    Claim(
        GALLERY,
        "whose Gaussian fit of the queries includes the question's, scores {} with the question in the window "
        "and {} without (shift {}, {} questions: lower without it on average, the interval reaching zero); "
        "ChunkKV, which keeps SnapKV's scores summed over whole chunks, loses most without it (shift {}, {} "
        "questions), the one method here whose interval excludes zero.",
        ada_ea_thesis,
    ),
    Claim(
        GALLERY,
        "KVzip, which scores the context with no question in view, loses least ({}) and keeps it without the "
        "question (shift {}).",
        kvzip_protocols,
    ),
    Claim(
        GALLERY, "the full cache itself drops there ({} and {} below its `query_aware` score)", protocol_floor
    ),
    Claim(
        GALLERY,
        "StreamingLLM, which keeps only the attention sinks and the latest tokens, scores {} against SnapKV's {} "
        "under `query_aware` ({}, paired)",
        smol_recency,
    ),
    Claim(
        GALLERY,
        "On Qwen2.5-Coder, whose full cache answers {} under `query_aware` and nearly as much under every "
        "protocol, SnapKV's thesis holds and reusing its cache breaks: SnapKV scores {} with the question in "
        "the window and {} when the context is compressed alone (shift {}, {} questions), Ada-KV {} and {} ({}, "
        "{}), PyramidKV {} and {} ({}, {}).",
        qwen_thesis,
    ),
    Claim(
        GALLERY,
        "Compressed without the question, SnapKV is no better than StreamingLLM's recency ({} under "
        "`context_only`, paired).",
        qwen_context_only_recency,
    ),
    Claim(
        GALLERY,
        "Kept for the later questions (`first_question`), SnapKV's cache answers the first as under "
        "`query_aware` ({}), the later three {} against {} with their own compression ({}, {} questions)",
        lambda: reuse_later("snapkv", QWEN_MODEL),
    ),
    Claim(
        GALLERY,
        "Qwen2.5-Coder-0.5B at 2K, in {} ([protocols_fp32/](protocols_fp32/report.md)): {}.",
        lambda: (protocol_dtype(QWEN_MODEL, FP32), protocol_coverage(QWEN_MODEL, FP32)),
    ),
    Claim(
        GALLERY,
        "Of the {} answers these rows share with the bfloat16 ones above (the same question, protocol and "
        "method: {}), {} are identical character for character (every answer of {}), and no method's mean "
        "score moves by more than {} points between the two",
        qwen_dtypes_agree,
    ),
    *(fp32_claims("query_aware") + fp32_claims("context_only")),
    Claim(
        GALLERY,
        "Compressed without the question, the five methods that rank by the observation window's attention "
        "(SnapKV, PyramidKV, Ada-KV, ChunkKV, CriticalKV) answer the same {} questions: every question of {} "
        "contexts of {}, and none of the others.",
        fp32_window_context_only,
    ),
]


CATALOGUE_HITS = ("chunkkv", "kvzip", "tova", "adakv_expected_attention", "criticalkv", "snapkv",
                  "expected_attention", "knorm")  # fmt: skip


def catalogue_cells() -> tuple:
    """Cells where each method finds the whole number (exact), out of the cells it ran, on 1K-8K."""

    def cells(method: str) -> str:
        params = {"gqa_order": "reduce_first"} if method == "snapkv" else {}
        df = config("needle_methods", QWEN, method, **params)
        return f"{int((needle(df, 'exact') == 100).sum())} of {len(df)}"

    return tuple(cells(m) for m in CATALOGUE_HITS)


def catalogue_reading() -> tuple:
    """Which differences against SnapKV are positive and negative on average, which have a raw p
    below 0.05, and that none has a Holm-adjusted p below 0.05: the smallest adjusted p and n."""
    got = catalogue_vs_snapkv()

    def p_of(m: str, which: str) -> float:
        return float(got[m].split(f"{which}")[1].split(")")[0].split(",")[0].lstrip("=< "))

    ahead = [m for m in CATALOGUE_VS_SNAPKV if point(got[m]) > 0]
    assert ahead == ["chunkkv", "kvzip", "tova", "adakv_expected_attention", "criticalkv"]
    raw = [m for m in CATALOGUE_VS_SNAPKV if p_of(m, "p") < 0.05]
    assert raw == ["chunkkv", "tova", "expected_attention", "knorm"], raw
    holm = {m: p_of(m, "Holm") for m in CATALOGUE_VS_SNAPKV}
    assert min(holm.values()) >= 0.05, holm
    hits = dict(zip(CATALOGUE_HITS, (int(c.split(" of ")[0]) for c in catalogue_cells())))
    assert hits["adakv_expected_attention"] > hits["expected_attention"] and hits["knorm"] == 0
    return f"{min(holm.values()):.3f}", 20


def kvzip_at_8k() -> tuple:
    """KVzip's 8K answers: none holds a digit of the number, and none mentions the magic number."""
    df = config("needle_methods", QWEN, "kvzip")
    at = df[df["context_length"] == 8000]
    assert len(at) == 5 and (needle(at, "partial") == 0).all()
    assert not at["prediction"].str.contains("magic number").any()
    return (len(at),)


def context_only_at_8k() -> tuple:
    """Qwen's 8K needle prompts with the context compressed alone: KVzip's answers all name the magic
    number; the cells where KVzip, SnapKV and the full cache find the whole number, of 5."""
    got = {}
    for method, params in (("kvzip", {}), ("snapkv", {"gqa_order": "reduce_first"}), ("full", {})):
        df = config("needle_context_only", QWEN, method, **params)
        assert (
            len(df) == 5 and set(df["context_length"]) == {8000} and set(df["protocol"]) == {"context_only"}
        )
        got[method] = df
    assert got["kvzip"]["prediction"].str.contains("magic number").all()
    return tuple(int((needle(got[m], "exact") == 100).sum()) for m in ("kvzip", "snapkv", "full"))


def context_only_kvzip_vs_snapkv() -> tuple:
    """KVzip minus SnapKV under `context_only` at 8K, as the needle report's paired table has it."""
    from eval.report.paired import paired_rows

    paired = paired_rows(prepare(rows("needle_context_only")))
    (r,) = paired[
        paired["config"].str.startswith("kvzip") & paired["baseline"].str.startswith("snapkv")
    ].itertuples()
    return f"{r.diff:+.1f}", f"{r.lo:+.1f}", f"{r.hi:+.1f}", int(r.n_shared), f"{r.p:.3f}"


CATALOGUE_CLAIMS = [
    Claim(
        GALLERY,
        "Cells where the whole number comes back, of those that ran: ChunkKV {}, KVzip {}, TOVA {}, Ada-KV "
        "Expected Attention {}, CriticalKV {}, SnapKV {}, Expected Attention {}, KNorm {}.",
        catalogue_cells,
    ),
    Claim(
        GALLERY,
        "Minus SnapKV on the cells both ran (exact x100, 95% bootstrap interval over the cells, exact McNemar p, "
        "p Holm over the report's {} comparisons of this model): ChunkKV {}, KVzip {}, TOVA {}, "
        "Ada-KV Expected Attention {}, CriticalKV {}, Expected Attention {}, KNorm {}.",
        lambda: (
            catalogue_vs_snapkv()["comparisons"],
            *(catalogue_vs_snapkv()[m] for m in CATALOGUE_VS_SNAPKV),
        ),
    ),
    Claim(
        GALLERY,
        "On average ChunkKV and TOVA keep the number where SnapKV loses it, and Expected Attention and KNorm lose it "
        "where SnapKV keeps it; KVzip, Ada-KV Expected Attention and CriticalKV (SnapKV's scores re-ranked by each "
        "value's projected norm) score above SnapKV on average. None separates from SnapKV once Holm's adjustment "
        "covers the table: no difference detected (Holm p = {} at best, n = {}). Expected Attention "
        "(query-agnostic by design: no window votes) finds the number in more cells with Ada-KV's head budgets "
        "than without, and KNorm (attention-free) in none",
        catalogue_reading,
    ),
    Claim(GALLERY, "KVzip's {} answers at 8K are off-topic text", kvzip_at_8k),
    Claim(
        GALLERY,
        "KVzip finds the whole number at {} of the 5 depths and every one of its answers names the magic number; "
        "SnapKV at {} of 5, the full cache at {} of 5 (",
        context_only_at_8k,
    ),
    Claim(
        GALLERY,
        "(KVzip minus SnapKV {} [{}, {}], n={}, exact McNemar p = {}: five prompts cannot separate the two)",
        context_only_kvzip_vs_snapkv,
    ),
]


# ------------------------------------------------------------------ the catalogue on Qwen's RULER
RULER_CATALOGUE = "**The catalogue on Qwen's RULER at 4K**"
RULER_NIAH = RULER_TASKS[:8]
RULER_CATALOGUE_METHODS = {  # label -> (method, params): today's defaults at budget 1024
    **RULER_METHODS,
    "chunkkv": ("chunkkv", {"budget": 1024}),
    "tova": ("tova", {"budget": 1024}),
    "criticalkv": ("criticalkv", {"budget": 1024}),
    "knorm": ("knorm", {"budget": 1024}),
    "expected_attention": ("expected_attention", {"budget": 1024}),
    "adakv_expected_attention": ("adakv_expected_attention", {"budget": 1024}),
    "kvzip": ("kvzip", {"budget": 1024}),
}


RULER_CATALOGUE_SAMPLES = frozenset(f"{task}-4096-{i}" for task in RULER_NIAH for i in range(10))


def ruler_catalogue_ran() -> list[str]:
    """The catalogue configs with committed 4K rows for every one of the shared needle-task samples."""
    df = rows("ruler").query("model == @QWEN")
    return [
        label
        for label, (method, _) in RULER_CATALOGUE_METHODS.items()
        if RULER_CATALOGUE_SAMPLES <= set(df.loc[df["method"] == method, "sample_id"])
    ]


@functools.cache
def ruler_catalogue() -> pd.DataFrame:
    """Qwen's 4K RULER rows of every catalogue config that ran them all, on the first 10 samples of
    the 8 needle tasks (`config_label` = the method name)."""
    parts = []
    for label in ruler_catalogue_ran():
        method, params = RULER_CATALOGUE_METHODS[label]
        df = config("ruler", QWEN, method, **params)
        parts.append(df[df["sample_id"].isin(RULER_CATALOGUE_SAMPLES)].assign(config_label=label, ok=True))
    return pd.concat(parts)


def ruler_catalogue_means(label: str) -> pd.Series:
    return label_task_means(ruler_catalogue(), label, RULER_NIAH)


def ruler_table_vs(df: pd.DataFrame, label: str, baseline: str = "snapkv") -> str:
    """ "+1.2 [lo, hi]": the paired suite-average difference `label` - `baseline` over the RULER rows `df`."""
    point, bounds = paired_in(df, label, baseline)
    return f"{point:+.1f} {bounds}"


def ruler_table_row(df: pd.DataFrame, label: str, tasks) -> list[str]:
    """label | the `tasks`' means | suite average | minus SnapKV [95% CI] | minus the full cache."""
    means = label_task_means(df, label, tasks)
    assert means.notna().all()
    vs = ["—" if label == b else ruler_table_vs(df, label, b) for b in ("snapkv", "full")]
    return [label] + [f"{x:.0f}" for x in means] + [f"**{means.mean():.1f}**"] + vs


def ruler_catalogue_vs(label: str, baseline: str = "snapkv") -> str:
    return ruler_table_vs(ruler_catalogue(), label, baseline)


def ruler_catalogue_row(label: str) -> list[str]:
    """label | the 8 needle tasks' means | suite average | minus SnapKV [95% CI] | minus the full cache."""
    return ruler_table_row(ruler_catalogue(), label, RULER_NIAH)


def ruler_catalogue_rows() -> list[Row]:
    ran = ruler_catalogue_ran()
    if not set(ran) - set(RULER_METHODS):
        return []
    return [
        Row(GALLERY, RULER_CATALOGUE, label, functools.partial(ruler_catalogue_row, label)) for label in ran
    ]


def ruler_catalogue_shape() -> tuple:
    """Every config on the same samples: 10 per task, the first 10 indices of the committed 20."""
    df = ruler_catalogue()
    per = df.groupby(["config_label", "ruler_task"]).size()
    assert per.nunique() == 1 and len(per) == len(RULER_NIAH) * df["config_label"].nunique()
    assert set(df["ruler_index"].astype(int)) == set(range(int(per.iloc[0])))
    return int(per.iloc[0]), df["sample_id"].nunique()


def ruler_chunkkv_reading() -> tuple:
    chunk, snap, full = (ruler_catalogue_means(m) for m in ("chunkkv", "snapkv", "full"))
    assert (chunk[["niah_single_3", "niah_multikey_3"]] == 0).all()
    assert (snap[["niah_single_3", "niah_multikey_3"]] == 0).all()
    return (
        ruler_catalogue_vs("chunkkv"),
        chunk["niah_multikey_2"],
        snap["niah_multikey_2"],
        full["niah_single_3"],
        full["niah_multikey_3"],
    )


def ruler_tova_reading() -> tuple:
    tova = ruler_catalogue_means("tova")
    return (
        tova.mean(),
        ruler_catalogue_vs("tova"),
        tova["niah_single_1"],
        tova["niah_multikey_2"],
        tova["niah_multivalue"],
    )


def ruler_unvoted_reading() -> tuple:
    """KNorm and Expected Attention below StreamingLLM; KNorm's score all from niah_single_1."""
    knorm, ea, sllm = (ruler_catalogue_means(m) for m in ("knorm", "expected_attention", "streamingllm"))
    assert max(knorm.mean(), ea.mean()) < sllm.mean()
    assert (knorm.drop("niah_single_1") == 0).all()
    return (
        knorm.mean(),
        ruler_catalogue_vs("knorm"),
        knorm["niah_single_1"],
        ea.mean(),
        ruler_catalogue_vs("expected_attention"),
    )


def ruler_adakv_ea_reading() -> tuple:
    ada, ea = ruler_catalogue_means("adakv_expected_attention"), ruler_catalogue_means("expected_attention")
    diff, bounds = paired_in(ruler_catalogue(), "adakv_expected_attention", "snapkv")
    lo, hi = interval(bounds)
    assert diff > 0 and lo < 0 < hi
    return ada.mean(), f"{diff:+.1f}", bounds, ada.mean() - ea.mean()


def ruler_kvzip_reading() -> tuple:
    """KVzip: the best compressed config, the only one keeping the UUID tasks."""
    means = {label: ruler_catalogue_means(label) for label in ruler_catalogue_ran()}
    kvzip, full = means.pop("kvzip"), means.pop("full")
    assert all(kvzip.mean() > m.mean() for m in means.values())
    assert all(m["niah_multikey_3"] == 0 for m in means.values()) and kvzip["niah_multikey_3"] > 0
    assert means["snapkv"]["niah_single_3"] == means["chunkkv"]["niah_single_3"] == 0
    return (
        kvzip.mean(),
        ruler_catalogue_vs("kvzip"),
        ruler_catalogue_vs("kvzip", "full"),
        kvzip["niah_single_3"],
        full["niah_single_3"],
        kvzip["niah_multikey_3"],
        full["niah_multikey_3"],
    )


def ruler_criticalkv_reading() -> tuple:
    crit, snap = ruler_catalogue_means("criticalkv"), ruler_catalogue_means("snapkv")
    gains = (crit - snap)[lambda d: d != 0]
    assert set(gains.index) == {"niah_multikey_2", "niah_multivalue", "niah_multiquery"} and gains.nlargest(
        2
    ).index.tolist() == ["niah_multikey_2", "niah_multivalue"]
    return crit.mean(), ruler_catalogue_vs("criticalkv"), crit["niah_multikey_2"], crit["niah_multivalue"]


RULER_CATALOGUE_CLAIMS = [
    Claim(
        GALLERY,
        "the first 10 samples of each: the same",
        lambda: holds(ruler_catalogue_shape()[0] == 10, "10"),
    ),
    Claim(
        GALLERY,
        "ChunkKV is above it, with the interval above zero ({}): it keeps niah_multikey_2 at {:.0f} where SnapKV "
        "keeps {:.0f}, and like SnapKV it loses every UUID task (niah_single_3 and niah_multikey_3 at 0, where the "
        "full cache scores {:.0f} and {:.0f}).",
        ruler_chunkkv_reading,
    ),
    Claim(
        GALLERY,
        "is above it too, {:.1f} ({}), from niah_multikey_2 ({:.0f}) and niah_multivalue ({:.0f}).",
        ruler_criticalkv_reading,
    ),
    Claim(
        GALLERY,
        "falls to {:.1f} here ({}): it keeps niah_single_1 at {:.0f} but few of the tasks with several needles or "
        "values (niah_multikey_2 {:.0f}, niah_multivalue {:.0f})",
        ruler_tova_reading,
    ),
    Claim(
        GALLERY,
        "are below even StreamingLLM: KNorm {:.1f} ({} against SnapKV), all of it from niah_single_1 ({:.0f}, 0 on "
        "every other task; its noise haystack repeats one sentence, so the needle's keys may be the ones whose norms "
        "differ: a candidate reason, not measured), Expected Attention {:.1f} ({}), as on the needle grid",
        ruler_unvoted_reading,
    ),
    Claim(
        GALLERY,
        "Ada-KV's head budgets reach {:.1f} ({} {} against SnapKV: above it on average, the interval including "
        "zero): how a method's budget is spread over heads moves it by {:.1f} points here",
        ruler_adakv_ea_reading,
    ),
    Claim(
        GALLERY,
        "is the best compressed config here: {:.1f} ({} against SnapKV, {} against the full cache). It is the only "
        "one to keep the UUID values: niah_single_3 at {:.0f} (the full cache {:.0f}, SnapKV and ChunkKV 0) and "
        "niah_multikey_3 at {:.0f} (the full cache {:.0f}, every other compressed config 0).",
        ruler_kvzip_reading,
    ),
]


# ------------------------------------------- RULER's vt, cwe and fwe for the catalogue (Qwen, fp32)
RULER_V2 = "**RULER's vt, cwe and fwe for the catalogue**"
RULER_V2_FOLDER = "ruler_v2"
RULER_V2_TASKS = RULER_TASKS[8:]
RULER_V2_METHODS = {label: spec for label, spec in RULER_CATALOGUE_METHODS.items() if label != "h2o"}


@functools.cache
def ruler_v2_all() -> pd.DataFrame:
    """Every committed row of results/ruler_v2, one frame per catalogue config (`config_label`)."""
    parts = [
        config(RULER_V2_FOLDER, QWEN, method, **params).assign(config_label=label, ok=True)
        for label, (method, params) in RULER_V2_METHODS.items()
    ]
    return pd.concat(parts)


def ruler_v2_per_task() -> int:
    """The samples per task every config ran: indices 0..k-1 of each of the three tasks."""
    df = ruler_v2_all()
    ran = df.groupby(["config_label", "ruler_task"])["ruler_index"].agg(lambda s: set(s.astype(int)))
    assert len(ran) == len(RULER_V2_METHODS) * len(RULER_V2_TASKS), "a config lacks a task"
    k = 0
    while all(k in indices for indices in ran):
        k += 1
    return k


@functools.cache
def ruler_v2() -> pd.DataFrame:
    """The rows on the samples every config ran (so every comparison is paired)."""
    df = ruler_v2_all()
    return df[df["ruler_index"].astype(int) < ruler_v2_per_task()]


def ruler_v2_shape() -> tuple:
    """Samples per task; every row fp32, 4K, today's generator; configs that ran."""
    df = ruler_v2()
    assert set(df["dtype"]) == {"float32"} and set(df["ruler_length"].astype(int)) == {4096}
    assert set(df["ruler_task"]) == set(RULER_V2_TASKS)
    per = df.groupby(["config_label", "ruler_task"]).size()
    assert per.nunique() == 1
    return int(per.iloc[0]), df["sample_id"].nunique(), len(RULER_V2_METHODS)


def ruler_v2_means(label: str) -> pd.Series:
    return label_task_means(ruler_v2(), label, RULER_V2_TASKS)


def ruler_v2_vs(label: str, baseline: str = "snapkv") -> str:
    return ruler_table_vs(ruler_v2(), label, baseline)


def ruler_v2_row(label: str) -> list[str]:
    """label | vt, cwe, fwe | suite average | minus SnapKV [95% CI] | minus the full cache."""
    return ruler_table_row(ruler_v2(), label, RULER_V2_TASKS)


RULER_V2_ROWS = [
    Row(GALLERY, RULER_V2, label, functools.partial(ruler_v2_row, label)) for label in RULER_V2_METHODS
]


def ruler_v2_covers_zero(label: str, baselines=("snapkv", "full")) -> bool:
    lo, hi = zip(*(interval(ruler_v2_vs(label, b)) for b in baselines if b != label))
    return all(a <= 0 <= b for a, b in zip(lo, hi))


def ruler_v2_voted() -> tuple:
    """The selections scored by the prompt's own attention within noise of SnapKV and the full cache."""
    peers = ("chunkkv", "criticalkv", "tova", "kvzip")
    assert all(ruler_v2_covers_zero(label) for label in ("snapkv", *peers))
    snap = ruler_v2_means("snapkv").mean()
    spread = max(abs(ruler_v2_means(label).mean() - snap) for label in peers)
    return snap, ruler_v2_means("full").mean(), ruler_v2_vs("snapkv", "full"), spread


def ruler_v2_unvoted() -> tuple:
    """StreamingLLM and the question-blind scores below SnapKV and the full cache, intervals below zero."""
    labels = ("streamingllm", "knorm", "expected_attention", "adakv_expected_attention")
    assert all(interval(ruler_v2_vs(label, b))[1] < 0 for label in labels for b in ("snapkv", "full"))
    return tuple(x for label in labels for x in (ruler_v2_means(label).mean(), ruler_v2_vs(label)))


def ruler_v2_vt() -> tuple:
    ea, full = ruler_v2_means("expected_attention"), ruler_v2_means("full")
    return ea["vt"], ruler_v2_per_task(), full["vt"]


def ruler_v2_kvzip() -> tuple:
    """KVzip's average against SnapKV's, and fwe as its largest per-task gap to the full cache."""
    kvzip, full, snap = (ruler_v2_means(label) for label in ("kvzip", "full", "snapkv"))
    assert (full - kvzip).idxmax() == "fwe"
    return kvzip.mean(), ruler_v2_vs("kvzip"), kvzip["fwe"], full["fwe"], snap["fwe"]


RULER_V2_CLAIMS = [
    Claim(
        GALLERY,
        "{} samples of each, the same {} generated prompts for all {} configs",
        ruler_v2_shape,
    ),
    Claim(
        GALLERY,
        "SnapKV {:.1f} against the full cache's {:.1f} ({}), and ChunkKV, CriticalKV, TOVA and KVzip within {:.1f} "
        "points of SnapKV's average, every one of their intervals against SnapKV and against the full cache "
        "including zero",
        ruler_v2_voted,
    ),
    Claim(
        GALLERY,
        "SnapKV here ({:.1f}, {}); its largest gap to the full cache is on fwe ({:.0f} against {:.0f}; SnapKV {:.0f})",
        ruler_v2_kvzip,
    ),
    Claim(
        GALLERY,
        "StreamingLLM {:.1f} ({}), KNorm {:.1f} ({}), Expected Attention {:.1f} ({}) and Expected Attention with "
        "Ada-KV's head budgets {:.1f} ({}), each against SnapKV",
        ruler_v2_unvoted,
    ),
    Claim(GALLERY, "Expected Attention scores {:.0f} on vt ({} samples; the full cache {:.0f})", ruler_v2_vt),
]


CATALOGUE_COST_ORDER = (
    "snapkv", "knorm", "tova", "chunkkv", "criticalkv", "expected_attention", "adakv_expected_attention", "kvzip",
)  # fmt: skip


def catalogue_cost() -> tuple:
    """Prefill (reference units) over the full cache's per round, median [Q1, Q3] over the three
    rounds of the catalogue run; its first round's Expected Attention ratio."""
    with (RESULTS / "bench" / "catalogue" / "cpu_smollm2_8k.csv").open(newline="") as f:
        rows_ = list(csv.DictReader(f))
    assert (
        sorted({(r["round"], r["method"]) for r in rows_})
        == sorted({(str(k), m) for k in range(3) for m in ("full", *CATALOGUE_COST_ORDER)})
        and len(rows_) == 27
    )  # three complete rounds, each flagged noisy, as the prose says
    assert {r["noisy"] for r in rows_} == {"True"}
    got = prefill_ratios(rows_, "ref")
    within = [m for m in CATALOGUE_COST_ORDER if got[m].median <= 1.05]
    assert within == ["snapkv", "knorm", "tova", "chunkkv"]
    first = {r["method"]: float(r["prefill_ref"]) for r in rows_ if r["round"] == "0"}
    return (
        *(f"{got[m].median:.3f} [{got[m].q1:.3f}, {got[m].q3:.3f}]" for m in CATALOGUE_COST_ORDER),
        f"{first['expected_attention'] / first['full']:.3f}",
        f"{got['kvzip'].median:.1f}x",
    )


BLOCKED_COST_ORDER = ("criticalkv", "expected_attention", "adakv_expected_attention")


def catalogue_cost_blocked() -> tuple:
    """The same ratios for the three methods whose scoring runs in cache-sized blocks (commit
    519849e), beside the full cache, three rounds."""
    with (RESULTS / "bench" / "catalogue" / "cpu_smollm2_8k_blocks.csv").open(newline="") as f:
        rows_ = list(csv.DictReader(f))
    assert (
        sorted({(r["round"], r["method"]) for r in rows_})
        == sorted({(str(k), m) for k in range(3) for m in ("full", *BLOCKED_COST_ORDER)})
        and len(rows_) == 12
    )
    assert {r["noisy"] for r in rows_} == {"True"}
    got = prefill_ratios(rows_, "ref")
    assert all(got[m].median <= 1.05 for m in BLOCKED_COST_ORDER)
    return tuple(f"{got[m].median:.3f} [{got[m].q1:.3f}, {got[m].q3:.3f}]" for m in BLOCKED_COST_ORDER)


CATALOGUE_COST_CLAIMS = [
    Claim(
        GALLERY,
        "snapkv {}, knorm {}, tova {}, chunkkv {}, criticalkv {}, expected_attention {}, "
        "adakv_expected_attention {}, kvzip {}. SnapKV, KNorm, TOVA and ChunkKV are within 1.05 at the median.",
        lambda: catalogue_cost()[:8],
    ),
    Claim(GALLERY, "its first round alone read {}, so the rounds disagree", lambda: catalogue_cost()[8:9]),
    Claim(GALLERY, "makes its prefill {} of plain prefill", lambda: catalogue_cost()[9:]),
    Claim(
        GALLERY,
        "`cpu_smollm2_8k_blocks.csv`, 3 rounds, also beside other jobs): criticalkv {}, expected_attention {}, "
        "adakv_expected_attention {}: all three within 1.05 (a ratio below 1 is these rounds' noise).",
        catalogue_cost_blocked,
    ),
]


DECODE_EVICTION_ORDER = ("streamingllm", "h2o", "tova", "snapkv")


def decode_eviction(name: str, quiet: bool) -> str:
    """`method median [Q1, Q3]` of each decode-step ratio in bench/decode_eviction/<name>.csv."""
    with (RESULTS / "bench" / "decode_eviction" / f"{name}.csv").open(newline="") as f:
        rows_ = list(csv.DictReader(f))
    noisy = {r["noisy"] for r in rows_}
    assert noisy == ({"False"} if quiet else {"True"})  # the prose says which rounds were quiet
    got = decode_step_ratios(rows_, "ref")
    return ", ".join(
        f"{m} {got[m].median:.3f} [{got[m].q1:.3f}, {got[m].q3:.3f}]" for m in DECODE_EVICTION_ORDER
    )


def decode_eviction_verdict() -> tuple:
    def ratios(name: str) -> dict:
        with (RESULTS / "bench" / "decode_eviction" / f"{name}.csv").open(newline="") as f:
            return decode_step_ratios(list(csv.DictReader(f)), "ref")

    now, before = ratios("cpu_smollm2_2k_slot"), ratios("cpu_smollm2_2k_copying")
    assert (
        now["streamingllm"].q3 <= 1.05 and now["h2o"].q3 <= 1.10 and now["tova"].q3 <= 1.10
    )  # upper quartile
    moved = abs(now["snapkv"].median / ratios("cpu_smollm2_2k")["snapkv"].median - 1)
    assert 0.015 <= moved < 0.025  # "moved by 2%"
    return (before["h2o"].median, before["tova"].median, now["h2o"].median, now["tova"].median)


def schedule_amortised() -> tuple:
    """The mean-step ratios of the decode schedules' run (one compression inside its 128 fed tokens)."""
    with (RESULTS / "bench" / "decode_eviction" / "cpu_smollm2_2k_schedule.csv").open(newline="") as f:
        rows_ = list(csv.DictReader(f))
    assert {int(r["input_tokens"]) for r in rows_ if r["method"] != "full"} == {2048}
    got = decode_step_ratios(rows_, "ref", mean=True)
    assert all(got[m].q3 <= 1.10 for m in ("snapkv_d", "rkv"))  # within the 1.10 target
    return tuple(f"{got[m].median:.3f} [{got[m].q1:.3f}, {got[m].q3:.3f}]" for m in ("snapkv_d", "rkv"))


DECODE_EVICTION_CLAIMS = [
    Claim(
        GALLERY,
        "`cpu_smollm2_2k_slot.csv`, 3 rounds beside two single-threaded experiment runs): {}. With per-head victims",
        lambda: (decode_eviction("cpu_smollm2_2k_slot", False),),
    ),
    Claim(
        GALLERY,
        "`cpu_smollm2_2k.csv`, 3 rounds beside two single-threaded experiment runs): {}. The same benchmark",
        lambda: (decode_eviction("cpu_smollm2_2k", False),),
    ),
    Claim(
        GALLERY,
        "7ca038c, `cpu_smollm2_2k_copying.csv`; 3 rounds beside another job): {}.",
        lambda: (decode_eviction("cpu_smollm2_2k_copying", False),),
    ),
    Claim(
        GALLERY,
        "StreamingLLM meets its 1.05, H2O and TOVA their 1.10 at the upper quartile (snapkv, which does not "
        "evict while decoding, moved by 2% between the two runs: the runs' noise).",
        lambda: decode_eviction_verdict()[:0],
    ),
    Claim(
        GALLERY,
        "Today's path took them from {:.3f} and {:.3f} to {:.3f} and {:.3f}.",
        decode_eviction_verdict,
    ),
    Claim(GALLERY, "the experiment runs): snapkv_d {}, rkv {}.", lambda: schedule_amortised()),
]


def kvpress_ratios(name: str) -> dict:
    """ours / kvpress per pair of bench/kvpress/<name>.csv, as the README prints them."""
    with (RESULTS / "bench" / "kvpress" / f"{name}.csv").open(newline="") as f:
        rows_ = [{**r, "ratio": float(r["ratio"])} for r in csv.DictReader(f)]
    return {pair: f"{s.median:.3f} [{s.q1:.3f}, {s.q3:.3f}]" for pair, s in kvpress_summarise(rows_).items()}


def kvpress_claim() -> tuple:
    now = kvpress_ratios("smollm2_4096_b512_rolling")
    index_victims = kvpress_ratios("smollm2_4096_b512_buffered")
    runs = [kvpress_ratios(n) for n in ("smollm2_4096_b512", "smollm2_4096_b512_snapkv_as_kvpress")]
    rounds = {len(list(csv.DictReader((RESULTS / "bench" / "kvpress" / f"{n}.csv").open()))) // 3
              for n in ("smollm2_4096_b512", "smollm2_4096_b512_snapkv_as_kvpress")}  # fmt: skip
    assert rounds == {20}
    return (now["snapkv"], now["full"], now["streamingllm"], index_victims["streamingllm"],
            *(r["snapkv"] for r in runs), *(r["full"] for r in runs), *(r["streamingllm"] for r in runs))  # fmt: skip


KVPRESS_CLAIMS = [
    Claim(
        GALLERY,
        "SnapKV (512 kept) {}, the full cache (4,096) {}, StreamingLLM {} (ours rolls, one eviction per token; "
        "kvpress compresses once). With StreamingLLM's victims as index tensors (commit 8d2ce0f, "
        "`smollm2_4096_b512_buffered.csv`): StreamingLLM {}. Before, with a `torch.cat` of the layer and its positions every step and "
        "StreamingLLM's sort-and-gather eviction (two 20-round runs): SnapKV {} and {}; the full cache {} and {}; "
        "StreamingLLM {} and {}.",
        kvpress_claim,
    ),
]


LG_ORDER = ("h2o", "streamingllm", "tova", "snapkv", "snapkv_d", "rkv")


@functools.cache
def long_generation() -> dict:
    """Per (method, budget) of results/long_generation, as its report computes them
    (eval/tasks/reasoning/report.py, eval/paired.py): pass@1 with its interval, problems, samples,
    output length over the full cache's, format share, and the difference from the full cache on
    the shared samples (all datasets) with its interval."""
    from eval.report.paired import ALL, paired_rows
    from eval.tasks.reasoning import report as rreport

    df = prepare(rows("long_generation"))
    prepared = rreport.prepare_rows(df)
    full = prepared[prepared["method"] == "full"]
    paired = paired_rows(df)
    paired = paired[(paired["dataset"] == ALL) & (paired["baseline"] == full["config_label"].iloc[0])]
    out = {}
    for (method, budget), g in prepared.groupby(["method", "budget"], dropna=False):
        value, lo, hi, problems = rreport.pass_at_1(g)
        pair = paired[paired["config"] == g["config_label"].iloc[0]]
        out[method, None if pd.isna(budget) else int(budget)] = {
            "pass": f"{value * 100:.1f} [{lo * 100:.1f}, {hi * 100:.1f}]",
            "problems": problems,
            "samples": len(g),
            "ratio": f"{rreport.length_ratio(g, full):.3f}",
            "format": f"{g['format'].mean() * 100:.0f}",
            "diff": None
            if pair.empty
            else "{:+.1f} [{:+.1f}, {:+.1f}]".format(*pair[["diff", "lo", "hi"]].iloc[0]),
            "n_shared": None if pair.empty else int(pair["n_shared"].iloc[0]),
            "p_exact": None if pair.empty else float(pair["p_exact"].iloc[0]),
            "compressed": f"{rreport.was_compressed(g).mean() * 100:.0f}",
            "rows": g,
        }
    return out


def long_generation_128() -> tuple:
    cells = long_generation()
    at = [cells["full", None]] + [cells[m, 128] for m in LG_ORDER]
    assert {c["problems"] for c in at} == {16} and {c["samples"] for c in at} == {32}
    assert {c["n_shared"] for c in at[1:]} == {32}
    return (16, 32, *(c["pass"] for c in at), 32, *(c["diff"] for c in at[1:]),
            *(c["ratio"] for c in at[1:]), *(c["format"] for c in at))  # fmt: skip


def long_generation_snapkv() -> tuple:
    """Prefill-only SnapKV at 128: the prompts it compressed, and its other samples' tokens equal
    the full cache's (same seeds)."""
    cells = long_generation()
    snap, full = cells["snapkv", 128]["rows"], cells["full", None]["rows"].set_index("pair_key")
    compressed = snap[snap["compressed"].astype(bool)]
    rest = snap[~snap["compressed"].astype(bool)]
    assert (rest["prediction"].to_numpy() == full.loc[rest["pair_key"], "prediction"].to_numpy()).all()
    longest = int(cells["full", None]["rows"]["input_tokens"].max())
    assert compressed["input_tokens"].min() > 128 and longest <= 256
    return compressed["prompt_key"].nunique(), len(rest), longest


LG_256 = ("h2o", "streamingllm", "tova", "snapkv_d", "rkv")


def long_generation_256() -> tuple:
    """Budget 256, every decode-time configuration on the same problems and seeds as 128 (prefill-only
    SnapKV does not run there: every prompt fits)."""
    cells = long_generation()
    assert ("snapkv", 256) not in cells
    at = [cells[m, 256] for m in LG_256]
    assert {c["problems"] for c in at} == {16} and {c["samples"] for c in at} == {32}
    assert {c["n_shared"] for c in at} == {32}
    return (16, 32, *(c["pass"] for c in at), 32, *(c["diff"] for c in at), *(c["ratio"] for c in at),
            *(c["format"] for c in at), *(c["compressed"] for c in at))  # fmt: skip


def long_generation_shape() -> tuple:
    """The qualitative reading of budget 128, asserted: right answers per config, intervals, lengths."""
    cells = long_generation()
    right = {m: int((c["rows"]["score"] >= 0.5).sum()) for (m, b), c in cells.items() if b in (None, 128)}
    evicting = ("h2o", "streamingllm", "tova", "snapkv_d", "rkv")
    assert all(right[m] < right["full"] for m in evicting)
    assert sorted(evicting, key=right.get)[:2] == ["tova", "h2o"] and right["tova"] == 0
    assert all(right[m] == right["full"] - 1 for m in ("streamingllm", "snapkv_d", "rkv"))
    fmt = {m: float(cells[m, 128]["format"]) for m in LG_ORDER}
    assert min(fmt, key=fmt.get) == "tova"
    exact = {m: cells[m, 128]["p_exact"] for m in LG_ORDER}
    assert min(exact.values()) >= 0.05 and all(exact[m] == 1 for m in LG_ORDER if m not in ("tova", "h2o"))
    assert all(interval(cells[m, 128]["diff"])[1] < 0 for m in ("tova", "h2o"))  # the narrow percentile ones
    ratio = {m: float(cells[m, 128]["ratio"]) for m in LG_ORDER}
    assert max(ratio, key=ratio.get) == "tova" and min(ratio, key=ratio.get) == "snapkv_d"
    return f"{exact['tova']:.3f}", f"{exact['h2o']:.3f}", right["full"], cells["full", None]["samples"]


def long_generation_256_shape() -> tuple:
    """At 256 every decode-time configuration is right on exactly the full cache's samples; which
    configurations lengthen the output; how many samples the 128-step schedule never compressed."""
    cells = long_generation()

    def right(m, b):
        g = cells[m, b]["rows"]
        return set(g.loc[g["score"] >= 0.5, "pair_key"])

    full = right("full", None)
    assert all(right(m, 256) == full for m in LG_256)
    ratio = {m: float(cells[m, 256]["ratio"]) for m in LG_256}
    longer = [m for m in LG_256 if ratio[m] > 1]
    assert longer == ["streamingllm", "tova"]
    comp = {m: int(cells[m, 256]["compressed"]) for m in LG_256}
    assert comp["snapkv_d"] == comp["rkv"] < min(comp[m] for m in ("h2o", "streamingllm", "tova"))
    return len(full), ratio["streamingllm"], ratio["tova"]


def long_generation_rescored() -> tuple:
    df = rows("long_generation")
    return (int(df.loc[df["method"] == "full", "rescored"].notna().sum()),)


LONG_GENERATION_CLAIMS = [
    Claim(
        GALLERY,
        "Budget 128, every configuration on the first {} problems ({} samples each, the same seeds): pass@1 x100 "
        "[95% interval over problems] full {}, H2O {}, StreamingLLM {}, TOVA {}, SnapKV (prefill-only) {}, "
        "SnapKV-D {}, R-KV {}. Minus the full cache on the {} shared samples (x100, 95% bootstrap interval over the "
        "problems, within datasets): H2O {}, "
        "StreamingLLM {}, TOVA {}, SnapKV {}, SnapKV-D {}, R-KV {}. Output length over the full cache's on the "
        "same samples: H2O {}, StreamingLLM {}, TOVA {}, SnapKV {}, SnapKV-D {}, R-KV {}. Answers with a final-answer "
        "line: full {}%, H2O {}%, StreamingLLM {}%, TOVA {}%, SnapKV {}%, SnapKV-D {}%, R-KV {}%.",
        long_generation_128,
    ),
    Claim(
        GALLERY,
        "Prefill-only SnapKV compresses only the {} problems whose prompt is longer than 128 tokens; its other {} "
        "samples are token for token the full cache's. The longest prompt has {} tokens",
        long_generation_snapkv,
    ),
    Claim(
        GALLERY,
        "Budget 256, every decode-time configuration on the same {} problems ({} samples each): pass@1 x100 H2O {}, "
        "StreamingLLM {}, TOVA {}, SnapKV-D {}, R-KV {}. Minus the full cache on the {} shared samples: H2O {}, "
        "StreamingLLM {}, TOVA {}, SnapKV-D {}, R-KV {}. Output length over the full cache's: H2O {}, StreamingLLM {}, "
        "TOVA {}, SnapKV-D {}, R-KV {}. Answers with a final-answer line: H2O {}%, StreamingLLM {}%, TOVA {}%, "
        "SnapKV-D {}%, R-KV {}%. Samples whose cache lost entries at all: H2O {}%, StreamingLLM {}%, TOVA {}%, "
        "SnapKV-D {}%, R-KV {}%",
        long_generation_256,
    ),
    Claim(GALLERY, "task.samples=4`): {} full-cache answers that state the value", long_generation_rescored),
    Claim(
        GALLERY,
        "At 256 entries every method that evicts while decoding is right on exactly the full cache's {} samples "
        "(no discordant pair), and StreamingLLM's answers run {}x and TOVA's {}x the full cache's length",
        long_generation_256_shape,
    ),
    Claim(
        GALLERY,
        "at 128 entries every method that evicts while decoding answers fewer samples right than the full cache, "
        "H2O and TOVA most (TOVA none, and it most often ends without a final-answer line), StreamingLLM, SnapKV-D "
        "and R-KV one sample fewer; no difference is detected over the 16 problems (exact sign-flip p: TOVA {}, H2O "
        "{}, the others 1.000; the percentile intervals of TOVA and H2O end below zero, too narrow with 4 and 3 "
        "discordant problems), because the full cache itself is right on only {} of the {} samples",
        lambda: long_generation_shape(),
    ),
    Claim(GALLERY, "TOVA's answers run longest, SnapKV-D's shortest.", lambda: long_generation_shape()[:0]),
]

CATALOGUE_ROWS = catalogue_rows()
RULER_CATALOGUE_ROWS = ruler_catalogue_rows()
PROTOCOL_ROWS = protocol_rows()


# ------------------------------------------------------------------------------------------- tests
CHECKS = (
    HEADER_CLAIMS
    + NEEDLE_ROWS
    + NEEDLE_CLAIMS
    + BUDGET_ROWS
    + BUDGET_CLAIMS
    + LB_ROWS
    + LB_CLAIMS
    + ABLATION_CLAIMS
    + DIGITS_ROWS
    + DIGITS_CLAIMS
    + DIGITS_TODAY_CLAIMS
    + RULER_ROWS
    + RULER_CLAIMS
    + BENCH_CLAIMS
    + OBSERVATION_CLAIMS
    + README_ROWS
    + README_CLAIMS
    + CATALOGUE_ROWS
    + RULER_CATALOGUE_ROWS
    + RULER_CATALOGUE_CLAIMS
    + RULER_V2_ROWS
    + RULER_V2_CLAIMS
    + PROTOCOL_ROWS
    + PROTOCOL_CLAIMS
    + CATALOGUE_CLAIMS
    + CATALOGUE_COST_CLAIMS
    + DECODE_EVICTION_CLAIMS
    + KVPRESS_CLAIMS
    + LONG_GENERATION_CLAIMS
)


@pytest.mark.parametrize("check", CHECKS, ids=[c.id for c in CHECKS])
def test_prose_states_what_the_committed_rows_say(check):
    check.check()
