"""Generator seeds (`task.seeds`) of the needle and kv_retrieval tasks, and the split of a mean
score's variance into its seed and sampling components (`eval.stats.seed_variance`) with the
report's table of it. RULER's seeds are tested in tests/test_ruler.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from test_multi_question_tasks import tok  # noqa: F401  (fixture: a tiny offline tokenizer)

from eval.report.build import build_markdown, prepare
from eval.spec import RunSpec
from eval.stats import seed_variance
from eval.store import ROW_FIELDS
from eval.tables import seed_tables
from eval.tasks.kv_retrieval.task import KVRetrievalTask
from eval.tasks.needle.task import NeedleTask
from eval.tasks.ruler.task import RulerTask
from eval.tasks.seeds import generator_seeds

ROOT = Path(__file__).resolve().parents[1]


def _content(s):
    return (s.context, s.question, s.answers, s.context_id, s.question_index)


# ------------------------------------------------------------------------------------------ config
def test_generator_seeds_default_dedup_and_bad_values():
    assert generator_seeds("needle", 42, None) == [42]
    assert generator_seeds("needle", 42, [7, 42, 7]) == [7, 42]
    assert generator_seeds("needle", 42, 7) == [7]
    for bad, match in (([], "non-empty"), (["a"], "'a'"), ([True], "True"), ("12", "'12'")):
        with pytest.raises(ValueError, match=match):
            generator_seeds("needle", 42, bad)
    with pytest.raises(ValueError, match="needle seeds must be integers, got 1.5"):
        NeedleTask(haystack="noise", seeds=[1.5])
    with pytest.raises(ValueError, match="kv_retrieval seeds must be a non-empty list"):
        KVRetrievalTask(seeds=[])
    with pytest.raises(ValueError, match="RULER seeds must be integers"):
        RulerTask(seeds=[None])


def _spec(*overrides: str) -> RunSpec:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["model.name=/tmp/tiny", *overrides])
    return RunSpec.from_config(cfg)


def test_seeds_choose_samples_and_keep_the_default_results_file():
    """`seeds` is a selection key: adding seeds resumes into the file of `seed`; the default configs
    keep the file names they had before `seeds` existed."""
    before = {"needle": "d69f199c", "kv_retrieval": "468df1a4"}  # default configs, snapkv defaults
    for task, digest in before.items():
        default = _spec(f"task={task}")
        assert default.method_hash == digest
        grown = _spec(f"task={task}", "task.seeds=[42,7,8]")
        assert grown.result_path == default.result_path
        assert grown.task.generator_seeds == [42, 7, 8]
        assert _spec(f"task={task}", "task.seed=7").method_hash != digest  # the seed itself still counts
    ruler = _spec("task=ruler")
    assert _spec("task=ruler", "task.seeds=[1,2]").result_path == ruler.result_path


# ------------------------------------------------------------------------------------------ needle
def test_needle_seeds_one_context_per_cell_and_seed(tok):  # noqa: F811
    kw = dict(haystack="noise", lengths=[300], depths=[10, 50])
    default = list(NeedleTask(**kw).samples(tok))
    assert [s.sample_id for s in default] == ["len300_depth10", "len300_depth50"]
    same = list(NeedleTask(**kw, seeds=[42]).samples(tok))
    assert [(s.sample_id, _content(s), s.extra) for s in same] == [
        (s.sample_id, _content(s), s.extra) for s in default
    ]
    both = list(NeedleTask(**kw, seeds=[42, 7]).samples(tok))
    assert [s.sample_id for s in both] == [
        "len300_depth10",
        "len300_depth10-seed7",
        "len300_depth50",
        "len300_depth50-seed7",
    ]
    assert [s.extra["task_seed"] for s in both] == [42, 7, 42, 7]
    assert [_content(s) for s in both[::2]] == [_content(s) for s in default]  # seed 42's as before
    alone7 = list(NeedleTask(**kw, seed=7).samples(tok))
    assert [_content(s) for s in both[1::2]] == [_content(s) for s in alone7]
    for a, b in zip(both[::2], both[1::2]):
        assert a.answers != b.answers and a.context != b.context  # another magic number


def test_multi_needle_seeds_draw_other_keys(tok):  # noqa: F811
    samples = list(
        NeedleTask(haystack="noise", lengths=[400], depths=[50], needles=2, seeds=[42, 9]).samples(tok)
    )
    assert [s.sample_id for s in samples] == [
        "len400_depth50/q0",
        "len400_depth50/q1",
        "len400_depth50-seed9/q0",
        "len400_depth50-seed9/q1",
    ]
    assert [s.context_id for s in samples] == ["len400_depth50"] * 2 + ["len400_depth50-seed9"] * 2
    assert samples[0].context != samples[2].context
    assert {s.extra["needle_key"] for s in samples[:2]} != {s.extra["needle_key"] for s in samples[2:]}


# ------------------------------------------------------------------------------------ kv_retrieval
def test_kv_retrieval_seeds(tok):  # noqa: F811
    kw = dict(lengths=[512], samples=1, questions=2)
    default = list(KVRetrievalTask(**kw).samples(tok))
    task = KVRetrievalTask(**kw, seeds=[42, 5])
    assert task.num_samples() == 4
    both = list(task.samples(tok))
    assert [s.sample_id for s in both] == [
        "kv-512-0/q0",
        "kv-512-0/q1",
        "kv-512-0-seed5/q0",
        "kv-512-0-seed5/q1",
    ]
    assert [(s.sample_id, _content(s)) for s in both[:2]] == [(s.sample_id, _content(s)) for s in default]
    assert [s.extra["task_seed"] for s in both] == [42, 42, 5, 5]
    assert both[0].context != both[2].context and not set(both[0].answers) & set(both[2].answers)


# --------------------------------------------------------------------------------- variance split
def test_seed_variance_against_a_hand_computation():
    # seed a: 0 0 0 1 (mean 1/4, s² 1/4, n 4); seed b: 1 1 1 0 1 1 (mean 5/6, s² 1/6, n 6)
    scores = [0, 0, 0, 1] + [1, 1, 1, 0, 1, 1]
    seeds = ["a"] * 4 + ["b"] * 6
    split = seed_variance(scores, seeds)
    # s²/n: 1/16 and 1/36; var of the means (ddof 1): 2 (7/24)² = 49/288; mean s²/n: 13/288
    # sigma² = 49/288 - 13/288 = 1/8; between = sigma²/2 = 1/16; within = (1/16 + 1/36)/4 = 13/576
    assert (split.seeds, split.n) == (2, 10)
    assert split.mean == pytest.approx(13 / 24)
    assert split.between == pytest.approx(1 / 16)
    assert split.within == pytest.approx(13 / 576)
    assert split.between + split.within == pytest.approx((49 / 288) / 2)  # = Var(mean of the means)
    assert split.seed_sd == pytest.approx(0.25)
    lo, hi = split.interval()
    assert (hi - lo) / 2 == pytest.approx(1.96 * math.sqrt(1 / 16 + 13 / 576))


def test_seed_variance_truncates_and_needs_two_seeds_of_two():
    # equal seed means: no seed component, only sampling
    split = seed_variance([0, 1, 0, 1], [1, 1, 2, 2])
    assert split.between == 0.0 and split.within == pytest.approx((0.5 / 2 + 0.5 / 2) / 4)
    assert seed_variance([0, 1, 1], [1, 1, 1]) is None  # one seed
    assert seed_variance([0, 1, 1], [1, 1, 2]) is None  # seed 2 has one score
    assert seed_variance([0, 1, None, 1, 0], [1, 1, 2, 2, 2]).n == 4  # missing scores left out


# ------------------------------------------------------------------------------------------ report
def _rows(scores_by_seed: dict, method="full", params=None, with_seed=True):
    rows = []
    for seed, scores in scores_by_seed.items():
        for i, score in enumerate(scores):
            rows.append(
                {
                    **dict.fromkeys(ROW_FIELDS),
                    "sample_id": f"len300_depth{i}-seed{seed}",
                    "task": "needle",
                    "dataset": "needle",
                    "model": "m",
                    "method": method,
                    "method_params": params or {},
                    "query_aware": True,
                    "status": "ok",
                    "score": score,
                    "scores": {},
                    "method_hash": method,
                    "seed": 42,
                    "task_seed": seed if with_seed else None,
                    "context_length": 300,
                    "depth_percent": i,
                }  # fmt: skip
            )
    return rows


def test_report_states_the_seed_component_apart():
    rows = _rows({42: [0, 0, 0, 1], 7: [1, 1, 1, 0, 1, 1]})
    rows += _rows({42: [1, 1]}, "snapkv", {"budget": 64})  # one seed: nothing to split
    df = prepare(pd.DataFrame(rows))
    (table,) = seed_tables(df)
    assert "needle — m: generator seeds" in table and "seed sd" in table
    half = 100 * 1.96 * math.sqrt(1 / 16 + 13 / 576)
    mean = 100 * 13 / 24
    assert f"| full | 2 | 10 | {mean:.2f} | [{mean - half:.2f}, {mean + half:.2f}] | 25.00 | 15.02 |" in table
    assert "snapkv" not in table
    assert table in build_markdown(df, Path("r"))
    # rows written before `task_seed`: their seed is the row's `seed`, so one seed: no table
    assert seed_tables(prepare(pd.DataFrame(_rows({42: [0, 1, 1]}, with_seed=False)))) == []
