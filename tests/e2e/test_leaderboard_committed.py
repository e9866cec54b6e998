"""The committed leaderboard (results/README.md's top block and results/leaderboard.csv) is what
scripts/make_figures.py renders from the committed rows of conf/experiment/leaderboard.yaml's cells."""

import importlib.util
import io
from pathlib import Path

import pandas as pd

from eval.report import leaderboard as lb

ROOT = Path(__file__).resolve().parents[2]


def _make_figures():
    spec = importlib.util.spec_from_file_location("make_figures", ROOT / "scripts" / "make_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_leaderboard_is_its_rebuild_from_the_committed_rows():
    mf = _make_figures()
    cells, table = lb.build(ROOT / "results")
    readme = (ROOT / "results" / "README.md").read_text(encoding="utf-8")
    assert readme.count(mf.LB_BEGIN) == 1 and readme.count(mf.LB_END) == 1
    committed_block = readme.split(mf.LB_BEGIN, 1)[1].split(mf.LB_END, 1)[0]
    assert committed_block == "\n" + lb.block(cells, table) + "\n"
    # The block is the page's first section.
    assert readme.index(mf.LB_BEGIN) < readme.index("\n## ")
    rebuilt = io.StringIO()
    table.to_csv(rebuilt, index=False, float_format="%.6g")
    assert (ROOT / "results" / "leaderboard.csv").read_text(encoding="utf-8") == rebuilt.getvalue()
    committed = pd.read_csv(ROOT / "results" / "leaderboard.csv")
    assert set(committed["cell"]) <= {c.name for c in cells}
