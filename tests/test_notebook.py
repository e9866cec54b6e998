"""notebooks/results.ipynb executes against the committed results/ (nbclient, python3 kernel)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_results_notebook_executes_on_committed_results(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    assert any((ROOT / "results").rglob("*.jsonl")), "results/ must hold committed rows"
    monkeypatch.setenv("SNAPKV_RESULTS", str(ROOT / "results"))
    monkeypatch.setenv("SNAPKV_NOTEBOOK_OUT", str(tmp_path))
    nb = nbformat.read(ROOT / "notebooks" / "results.ipynb", as_version=4)
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
    ).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(str(o.get("text", "")) + str(o.get("data", {}).get("text/plain", "")) for o in outputs)
    assert "rows;" in text and "snapkv" in text
    assert list(tmp_path.glob("needle_*_score.png")) and (tmp_path / "compression.png").is_file()
    assert os.environ["SNAPKV_RESULTS"].endswith("results")
