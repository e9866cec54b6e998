"""The results page's renderer (eval/report/page.py) on synthetic rows: its phrases follow the data
("below zero" with a Holm p, "no difference detected (p = …, n = …)", "same within ±m" only by a
TOST), its labels are short, and a folder's README names duplicated samples and uncommitted trees."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_report import MODEL, SNAP, base_row, write

from eval.report import page
from eval.store import ResultStore, result_path

N = 30  # samples: enough units for the bootstrap and the TOST


def needle_rows(method: str, params: dict, scores: list[float], **kw) -> list[dict]:
    return [
        base_row(f"len1000_depth{i}", "needle", "needle", method, params, s, context_length=1000,
                 depth_percent=i, scores={"exact": s, "partial": s}, **kw)
        for i, s in enumerate(scores)
    ]  # fmt: skip


@pytest.fixture(autouse=True)
def _fresh():
    page.clear_cache()
    yield
    page.clear_cache()


def render(root: Path, config: list[float]) -> tuple[page.Table, str]:
    write(root / "f", needle_rows("full", {}, [1.0] * N) + needle_rows("snapkv", SNAP, config))
    t = page.table(page.Part("f", MODEL).rows(root))
    return t, "\n".join(page.reading(t))


def test_a_loss_on_every_sample_reads_below_zero_with_holm_p_and_n(tmp_path):
    t, text = render(tmp_path, [0.0] * N)
    (line,) = t.lines
    assert line.label == "snapkv 128" and line.vs_full.diff == -100.0
    assert "below zero: snapkv 128 -100.0 (p < 0.001, n = 30)" in text
    assert "no difference detected" not in text and "same within" not in text


def test_a_few_flips_read_no_difference_detected(tmp_path):
    scores = [0.0] * 5 + [1.0] * (N - 5)  # 5 of 30 broken: exact McNemar p = 0.062
    t, text = render(tmp_path, scores)
    assert "no difference detected: snapkv 128 -16.7 (p = 0.062, n = 30)" in text
    assert "below zero" not in text and "same within" not in text
    assert "| snapkv 128 | 30 | 83.3 | 83.3 | -16.7 [" in page.markdown(t)


def test_same_answers_read_same_only_through_the_tost(tmp_path):
    _, text = render(tmp_path, [1.0] * N)
    assert f"same within ±{page.MARGIN:g} by a TOST: snapkv 128 +0.0 (TOST p = <0.001, n = 30)" in text
    assert "Best compressed config by mean: snapkv 128 (100.0; the full cache 100.0, n = 30)" in text


def test_short_labels_add_only_the_parameters_that_tell_configs_apart(tmp_path):
    rows = needle_rows("full", {}, [1.0] * N)
    rows += needle_rows("snapkv", SNAP, [0.0] * N)
    rows += needle_rows("snapkv", {**SNAP, "kernel_size": 15}, [1.0] * N)
    write(tmp_path / "f", rows)
    labels = {ln.label for ln in page.table(page.Part("f", MODEL).rows(tmp_path)).lines}
    assert labels == {"snapkv 128 kernel_size=7", "snapkv 128 kernel_size=15"}


def test_folder_readme_names_duplicates_and_uncommitted_trees(tmp_path):
    d = tmp_path / "f"
    rows = needle_rows("snapkv", SNAP, [1.0] * 3, git_dirty=True)
    h = rows[0]["method_hash"]
    for shard, part in ((0, rows[:2]), (1, rows[1:])):
        store = ResultStore(result_path(d, "needle", MODEL, "snapkv", h, shard, 2))
        for r in part:
            store.append(r)
    with pytest.warns(UserWarning, match="1 samples"):
        text = page.folder_readme(d)
    assert "1 samples are stored in more than one file" in text and "len1000_depth1" in text
    assert "working tree uncommitted 3" in text
    page.clear_cache()
    write(tmp_path / "g", needle_rows("full", {}, [1.0] * 3, git_dirty=False))
    text = page.folder_readme(tmp_path / "g")
    assert "Duplicated samples: none" in text and "not all from one CPU kind" not in text
    assert page.folder_readme(tmp_path / "empty") is None


def test_a_results_folder_without_rows_renders_every_section_empty(tmp_path):
    (tmp_path / "results").mkdir()
    text = page.page(tmp_path / "results", "## Leaderboard\n", "<!-- a -->", "<!-- /a -->")
    assert "No result rows yet" in text and text.count("No rows yet.") == len(page.SECTIONS)


def test_partial_credit_stands_in_for_the_score_where_a_section_says_so(tmp_path):
    rows = needle_rows("full", {}, [1.0] * N) + needle_rows("snapkv", SNAP, [0.0] * N)
    for r in rows[N:]:
        r["scores"] = {"exact": 0.0, "partial": 0.5}
    write(tmp_path / "f", rows)
    t = page.table(page.Part("f", MODEL, metric="partial").rows(tmp_path))
    assert t.lines[0].score == 50.0 and t.lines[0].vs_full.diff == -50.0
    assert "| config | n | partial credit x100 | minus full [95% CI] |" in page.markdown(t, "partial")
