"""The committed results pages are what scripts/make_figures.py renders from the committed rows:
results/README.md (its leaderboard block first), results/leaderboard.csv, every results folder's
generated README.md and the result lines of the top README.md (`eval.report.page`,
`eval.report.leaderboard`), byte for byte."""

import importlib.util
import io
from pathlib import Path

import pandas as pd
import pytest

from eval.report import leaderboard as lb
from eval.report import page

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"


@pytest.fixture(scope="module")
def rebuilt():
    """(make_figures module, leaderboard cells, leaderboard table) rebuilt from the committed rows once."""
    spec = importlib.util.spec_from_file_location("make_figures", ROOT / "scripts" / "make_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cells, table = lb.build(RESULTS)
    return module, cells, table


def test_committed_leaderboard_is_its_rebuild_from_the_committed_rows(rebuilt):
    mf, cells, table = rebuilt
    readme = (RESULTS / "README.md").read_text(encoding="utf-8")
    assert readme.count(mf.LB_BEGIN) == 1 and readme.count(mf.LB_END) == 1
    committed_block = readme.split(mf.LB_BEGIN, 1)[1].split(mf.LB_END, 1)[0]
    assert committed_block == "\n" + lb.block(cells, table) + "\n"
    # The block is the page's first section.
    assert readme.index(mf.LB_BEGIN) < readme.index("\n## ")
    csv = io.StringIO()
    table.to_csv(csv, index=False, float_format="%.6g")
    assert (RESULTS / "leaderboard.csv").read_text(encoding="utf-8") == csv.getvalue()
    committed = pd.read_csv(RESULTS / "leaderboard.csv")
    assert set(committed["cell"]) <= {c.name for c in cells}


def test_committed_pages_are_their_render_from_the_committed_rows(rebuilt):
    mf, cells, table = rebuilt
    page.clear_cache()
    rendered = page.page(RESULTS, lb.block(cells, table) + "\n", mf.LB_BEGIN, mf.LB_END)
    assert (RESULTS / "README.md").read_text(encoding="utf-8") == rendered
    generated = []
    for sub in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        text = page.folder_readme(sub)
        if text is not None:
            assert (sub / "README.md").read_text(encoding="utf-8") == text, f"{sub.name}/README.md"
            generated.append(sub.name)
    assert {"needle_methods", "ruler", "protocols"} <= set(generated)
    top = (ROOT / "README.md").read_text(encoding="utf-8")
    assert top.count(page.README_BEGIN) == 1 and top.count(page.README_END) == 1
    block = top.split(page.README_BEGIN, 1)[1].split(page.README_END, 1)[0]
    assert block == "\n" + page.readme_block(RESULTS)
    page.clear_cache()
