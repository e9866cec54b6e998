"""The committed results/README.md, every results folder's generated README.md and the result lines
of the top README.md are what scripts/make_figures.py renders from the committed rows
(`eval.report.page`), byte for byte."""

import importlib.util
from pathlib import Path

from eval.report import leaderboard as lb
from eval.report import page

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"


def _make_figures():
    spec = importlib.util.spec_from_file_location("make_figures", ROOT / "scripts" / "make_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_pages_are_their_render_from_the_committed_rows():
    mf = _make_figures()
    page.clear_cache()
    cells, table = lb.build(RESULTS)
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
