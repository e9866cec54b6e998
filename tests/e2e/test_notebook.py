"""notebooks/results.ipynb executes (nbclient, python3 kernel) on the user's runs and, when there are
none, on the committed results/ with a note; it draws inline and its bar chart keeps its labels."""

from __future__ import annotations

import base64
import io
import json
import re
from pathlib import Path

import matplotlib.image
import pytest
from test_report import SNAP, base_row, write

ROOT = Path(__file__).resolve().parents[2]


def _execute(monkeypatch, results: Path, out: Path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("SNAPKV_RESULTS", str(results))
    monkeypatch.setenv("SNAPKV_NOTEBOOK_OUT", str(out))
    nb = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors[0].get("evalue")
    text = "".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    images = [o["data"]["image/png"] for o in outputs if "image/png" in o.get("data", {})]
    return text, images


def _rows_in(folder: Path) -> int:
    """Samples under `folder`, counted without the store: rows of results files (first row has a
    sample_id), one per (task, model, method hash, sample) as the same config recurs across folders."""
    keys = set()
    for path in folder.rglob("*.jsonl"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows and "sample_id" in rows[0]:
            file_hash = path.stem.split("-")[-1].split(".")[0]
            keys |= {(r["task"], r["model"], r.get("method_hash") or file_hash, r["sample_id"]) for r in rows}
    return len(keys)


def _label_margin_ok(png: bytes) -> bool:
    """The saved bar chart's labels are inside the image: ink in its left part, none on its edges."""
    img = matplotlib.image.imread(io.BytesIO(png))[..., :3]
    ink = (img < 0.5).any(axis=2)  # dark pixels: text, ticks, axes
    h, w = ink.shape
    return bool(ink[:, : w // 4].any() and not ink[:, :2].any() and not ink[:, -2:].any())


@pytest.mark.slow
def test_notebook_reads_the_users_runs_and_draws_inline(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    # the longest label the committed results have (Ada-KV's), which the old bar chart cut
    adakv = {**SNAP, "alpha": 0.2, "base": "snapkv", "beta": 20, "layout": "varlen"}
    rows = [
        base_row(
            f"len{n}_depth{d}",
            "needle",
            "needle",
            m,
            p,
            float(m == "full"),
            context_length=n,
            depth_percent=d,
            scores={"exact": float(m == "full"), "partial": 0.5},
        )
        for m, p in (("full", {}), ("snapkv", SNAP), ("adakv", adakv))
        for n in (1000, 2000)
        for d in (10, 90)
    ]
    write(runs / "needle", rows)
    text, images = _execute(monkeypatch, runs, tmp_path / "out")
    assert "note:" not in text
    assert f"{len(rows)} rows;" in text  # the user's rows, not the committed ones
    assert len(list((tmp_path / "out").glob("needle_*_score.png"))) == 3
    assert _label_margin_ok((tmp_path / "out" / "compression.png").read_bytes())
    # three heatmaps (one per config) and the bar chart, drawn inline (no forced Agg backend)
    assert len(images) == 4
    assert _label_margin_ok(base64.b64decode(images[-1]))


@pytest.mark.slow
def test_notebook_falls_back_to_committed_results_with_a_note(tmp_path, monkeypatch):
    committed = ROOT / "results"
    assert any(committed.rglob("*.jsonl")), "results/ must hold committed rows"
    text, images = _execute(monkeypatch, tmp_path / "no_runs_yet", tmp_path / "out")
    assert re.search(r"note: no result rows in \S*no_runs_yet", text)
    assert f"{committed}: {_rows_in(committed)} rows;" in text
    assert images and (tmp_path / "out" / "compression.png").is_file()
