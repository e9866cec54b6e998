"""Tasks that ask several questions about one context: the needle with ``needles=K``, kv_retrieval,
RULER's niah_multiquery with ``separate_questions``. Determinism from the seed, lengths in the
tokenizer, distinct keys, answers once in the shared context, the K=1 / default-off paths and
config hashes unchanged, bad values, the report table.

Offline: a byte-level BPE tokenizer trained in code with a ChatML-like template; text haystacks are
written to tmp_path (nothing is fetched).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pandas as pd
import pytest
from conftest import CHATML, byte_level_bpe, save_tiny_llama
from hydra import compose, initialize_config_dir

from eval.spec import RunSpec
from eval.tasks import build_task
from eval.tasks import haystack as hs
from eval.tasks.kv_retrieval.report import KVRetrievalReport
from eval.tasks.kv_retrieval.task import (
    INSTRUCTION,
    KVRetrievalTask,
    partial_match,
    prompt_tokens,
    render_context,
    string_match,
)
from eval.tasks.multi_question import question_tables
from eval.tasks.needle import multi
from eval.tasks.needle.task import NEEDLES, NeedleTask
from eval.tasks.ruler.config import FAMILIES
from eval.tasks.ruler.task import RulerTask
from eval.tasks.ruler.task import prompt_tokens as ruler_prompt_tokens
from snapkv.prompts import prompt_token_ids

ROOT = Path(__file__).resolve().parents[1]
PROSE = " ".join(
    f"Essay line {w} talks about {x} and ideas. It is short. People like {x} when it rains."
    for w in ("one", "two", "three", "four", "five", "six")
    for x in ("gardens", "startups", "rivers", "books", "cities")
)
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


@pytest.fixture(scope="module")
def tok():
    corpus = [hs.NOISE_TEXT] * 10 + [PROSE, INSTRUCTION, multi.INSTRUCTION, multi.NEEDLE, multi.QUESTION]
    corpus += [s.instruction + s.needle + s.question for s in NEEDLES.values()]
    corpus += [f.template + f.answer_prefix for f in FAMILIES.values()]
    corpus += ["0123456789abcdef-" * 20]
    return byte_level_bpe(corpus, 1000, ["<s>", "<|im_start|>", "<|im_end|>"], chat_template=CHATML)


@pytest.fixture(scope="module")
def essays(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("essays")
    (d / "a.txt").write_text(PROSE, encoding="utf-8")
    return f"dir:{d}"


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def hash_without(spec: RunSpec, key: str) -> str:
    """The config hash of `spec` as it was before the task config had `key`."""
    old = RunSpec(**{**spec.__dict__, "task_config": {k: v for k, v in spec.task_config.items() if k != key}})
    return old.method_hash


def check_shared_context(samples: list, k: int) -> None:
    """K samples of one context: same context_id and text, question_index 0..K-1, distinct ids."""
    assert len(samples) == k
    assert len({s.context_id for s in samples}) == 1 and samples[0].context_id is not None
    assert len({s.context for s in samples}) == 1
    assert [s.question_index for s in samples] == list(range(k))
    assert len({s.sample_id for s in samples}) == k
    assert all(s.sample_id == f"{s.context_id}/q{s.question_index}" for s in samples)


def by_context(samples: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in samples:
        out.setdefault(s.context_id, []).append(s)
    return out


# ------------------------------------------------------------------------------------------- needle
def test_needle_k1_is_the_needle_task_unchanged(tok):
    kw = dict(haystack="noise", lengths=[300, 500], depths=[10, 50])
    old = list(NeedleTask(**kw).samples(tok))
    one = list(NeedleTask(**kw, needles=1).samples(tok))
    assert [(s.sample_id, s.context, s.question, s.answers, s.extra) for s in one] == [
        (s.sample_id, s.context, s.question, s.answers, s.extra) for s in old
    ]
    assert [s.sample_id for s in one] == [
        "len300_depth10",
        "len300_depth50",
        "len500_depth10",
        "len500_depth50",
    ]
    assert all(s.context_id is None and s.question_index == 0 for s in one)
    assert set(one[0].extra) == {
        "context_length", "depth_percent", "needle", "actual_tokens", "actual_depth_percent", "haystack",
        "task_seed",
    }  # fmt: skip
    assert NeedleTask(**kw).version is None and not NeedleTask(**kw).multi_question()


def test_needle_config_hash_unchanged_at_one_needle():
    spec = RunSpec.from_config(compose_cfg([]))
    assert spec.task_config["needles"] == 1  # the key is in conf/task/needle.yaml ...
    assert spec.method_hash == hash_without(spec, "needles")  # ... and not in the hash
    three = RunSpec.from_config(compose_cfg(["task.needles=3"]))
    assert three.method_hash != spec.method_hash and three.task.multi_question()


def test_needle_k_needles_one_question_each(tok):
    task = NeedleTask(haystack="noise", lengths=[400, 700], depths=[0, 50, 100], needles=3)
    samples = list(task.samples(tok))
    assert len(samples) == 2 * 3 * 3
    groups = by_context(samples)
    assert list(groups) == [f"len{n}_depth{d}" for n in (400, 700) for d in (0, 50, 100)]
    for group in groups.values():
        check_shared_context(group, 3)
        keys = [s.extra["needle_key"] for s in group]
        numbers = [s.answers[0] for s in group]
        assert len(set(keys)) == 3 and len(set(numbers)) == 3
        assert all(re.fullmatch(r"\d{7}", n) for n in numbers)
        context = group[0].context
        assert context.startswith(multi.INSTRUCTION)
        for s in group:
            assert context.count(s.extra["needle"]) == 1 and context.count(s.answers[0]) == 1
            assert (
                s.extra["needle"]
                == f"One of the special magic numbers for {s.extra['needle_key']} is: {s.answers[0]}."
            )
            assert (
                s.question
                == f"\n\nWhat is the special magic number for {s.extra['needle_key']} mentioned in the provided text?"
            )
            assert s.answers[0] not in s.question
            assert s.extra["actual_tokens"] == len(prompt_token_ids(tok, s.prompt, True))
            assert s.extra["context_id"] == s.context_id and s.extra["question_index"] == s.question_index
        length, depth = group[0].extra["context_length"], group[0].extra["depth_percent"]
        assert abs(group[0].extra["actual_tokens"] - length) <= 2  # sized with question 0
        # needle k at depth + 100k/K (wrapped), question 0 at the cell's depth
        assert [s.extra["needle_depth_percent"] for s in group] == pytest.approx(
            multi.needle_depths(depth, 3)
        )
        for s in group:
            assert abs(s.extra["actual_depth_percent"] - s.extra["needle_depth_percent"]) <= 12
    assert task.score(samples[0], f"It is {samples[0].answers[0]}.") == 1.0
    assert task.score_all(samples[0], samples[0].answers[0][:3]) == {"exact": 0.0, "partial": 3 / 7}


def test_needle_k_needles_deterministic_from_the_seed(tok):
    kw = dict(haystack="noise", lengths=[400], depths=[50], needles=4)
    a = [(s.sample_id, s.prompt, s.answers) for s in NeedleTask(**kw).samples(tok)]
    b = [(s.sample_id, s.prompt, s.answers) for s in NeedleTask(**kw).samples(tok)]
    c = [(s.sample_id, s.prompt, s.answers) for s in NeedleTask(**kw, seed=7).samples(tok)]
    assert a == b and [x[0] for x in c] == [x[0] for x in a] and [x[2] for x in c] != [x[2] for x in a]
    assert NeedleTask(**kw).version.startswith("multi")


def test_needle_k_needles_without_chat_template(tok):
    task = NeedleTask(haystack="noise", lengths=[400], depths=[50], needles=2, chat_template=False)
    for s in task.samples(tok):
        key = s.extra["needle_key"]
        assert s.chat_template is False
        assert s.question.endswith(f" The special magic number for {key} mentioned in the provided text is")


def test_needle_insertion_on_boundaries_and_same_point():
    class Hay:  # every character a token; sentence ends after each '.'
        text = "Aa. Bb. Cc. Dd."
        ends = list(range(1, len(text) + 1))

        def char_at(self, n):
            return self.ends[n - 1] if n else 0

        def insertion_token(self, n, depth):
            return n if depth >= 100 else {0: 0, 50: 8}[int(depth)]

    needles = [multi.Needle("a", "1", 50.0), multi.Needle("b", "2", 0.0), multi.Needle("c", "3", 50.0)]
    text, points = multi.insert_needles(Hay(), 15, needles)
    a, b, c = (n.sentence for n in needles)
    assert points == [8, 0, 8]
    assert text == f"{b} Aa. Bb. {a} {c} Cc. Dd."


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"needles": 0}, "needles=0"),
        ({"needles": -2}, "needles=-2"),
        ({"needles": True}, "needles=True"),
        ({"needles": "3"}, "needles='3'"),
        ({"needles": 2, "needle": "sf"}, "needle='sf'"),
        ({"needles": 2, "number": 1234567}, "number=1234567"),
    ],
)
def test_needle_bad_values(kw, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        NeedleTask(haystack="noise", **kw)


def test_needle_length_too_small_names_it(tok):
    with pytest.raises(ValueError, match=r"context length 60 is too small.*needles=4"):
        NeedleTask(haystack="noise", lengths=[60], needles=4).samples(tok)


# ------------------------------------------------------------------------------------- kv_retrieval
def _json(sample) -> dict:
    assert sample.context.startswith(INSTRUCTION)
    return json.loads(sample.context[len(INSTRUCTION) :])


def test_kv_retrieval_samples(tok):
    task = KVRetrievalTask(lengths=[800, 1500], samples=2, questions=4)
    samples = list(task.samples(tok))
    assert task.num_samples() == len(samples) == 2 * 2 * 4 and task.multi_question()
    groups = by_context(samples)
    assert list(groups) == ["kv-800-0", "kv-800-1", "kv-1500-0", "kv-1500-1"]
    for group in groups.values():
        check_shared_context(group, 4)
        obj = _json(group[0])
        keys = [UUID.search(s.question).group(0) for s in group]
        assert len(set(keys)) == 4
        length = group[0].extra["context_length"]
        assert group[0].extra["num_pairs"] == len(obj)
        # every key and value distinct, each asked value once in the prompt and only in the context
        assert len(set(obj) | set(obj.values())) == 2 * len(obj)
        for s, key in zip(group, keys):
            assert s.question == f'\n\nKey: "{key}"\nThe value associated with the specified key is:'
            assert obj[key] == s.answers[0] and s.prompt.count(s.answers[0]) == 1
            assert UUID.fullmatch(s.answers[0]) and s.max_new_tokens == 64
            assert s.extra["actual_tokens"] == prompt_tokens(tok, s.context, s.question, True) <= length
        # the largest object that fits: one more filler pair overflows for some question
        n = len(obj) - 4
        content = task.content(length, group[0].extra["kv_index"])
        assert render_context(content.entries(n)) == group[0].context
        bigger = render_context(content.entries(n + 1))
        assert max(prompt_tokens(tok, bigger, s.question, True) for s in group) > length
        # one asked key per band of the object, asked in a drawn order
        places = sorted(list(obj).index(k) for k in keys)
        bands = [i * len(obj) // 4 for i in range(5)]
        assert all(bands[i] <= places[i] < bands[i + 1] for i in range(4))
        depths = [s.extra["key_depth_percent"] for s in group]
        assert sorted(depths) == pytest.approx([100 * p / (len(obj) - 1) for p in places], abs=0.01)


def test_kv_retrieval_deterministic_and_grows_with_the_length(tok):
    a = [(s.sample_id, s.prompt, s.answers) for s in KVRetrievalTask(lengths=[900], samples=2).samples(tok)]
    b = [(s.sample_id, s.prompt, s.answers) for s in KVRetrievalTask(lengths=[900], samples=2).samples(tok)]
    c = [
        (s.sample_id, s.prompt, s.answers)
        for s in KVRetrievalTask(lengths=[900], samples=2, seed=7).samples(tok)
    ]
    assert a == b and [x[0] for x in c] == [x[0] for x in a] and [x[2] for x in c] != [x[2] for x in a]
    assert a[0][1] != a[4][1]  # contexts differ
    short = next(iter(KVRetrievalTask(lengths=[900], samples=1).samples(tok)))
    long = next(iter(KVRetrievalTask(lengths=[1800], samples=1).samples(tok)))
    assert long.extra["num_pairs"] > short.extra["num_pairs"]


def test_kv_retrieval_without_chat_template_and_one_question(tok):
    (s,) = KVRetrievalTask(lengths=[700], samples=1, questions=1, chat_template=False).samples(tok)
    assert s.chat_template is False and s.context_id == "kv-700-0" and s.sample_id == "kv-700-0/q0"
    assert s.extra["actual_tokens"] == prompt_tokens(tok, s.context, s.question, False) <= 700
    assert not KVRetrievalTask(questions=1).multi_question()


def test_kv_retrieval_metrics(tok):
    value = "91c1cb25-4214-48a5-bb14-31fc94bb6d77"
    assert string_match(f'The value is "{value.upper()}".', value) == 1.0
    assert string_match("The value is 91c1cb25-4214.", value) == 0.0
    assert partial_match("The value is 91c1cb25-4214.", value) == pytest.approx(13 / 36)
    assert partial_match(f"{value}!", value) == 1.0 and partial_match("no hex here", value) == 0.0
    task = KVRetrievalTask(lengths=[700], samples=1, questions=2)
    s = next(iter(task.samples(tok)))
    assert task.score(s, s.answers[0]) == 1.0 and task.score(s, "I do not know.") == 0.0
    assert task.score_all(s, s.answers[0][:8]) == {"string_match": 0.0, "partial": pytest.approx(8 / 36)}


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"questions": 0}, "questions=0"),
        ({"questions": True}, "questions=True"),
        ({"samples": 0}, "samples=0"),
        ({"lengths": [1024, 0]}, "lengths=0"),
        ({"lengths": []}, "lengths=[]"),
        ({"max_new_tokens": -1}, "max_new_tokens=-1"),
        ({"chat_template": "yes"}, "chat_template='yes'"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_kv_retrieval_bad_values(kw, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        build_task("kv_retrieval", **kw)


def test_kv_retrieval_length_too_small(tok):
    with pytest.raises(ValueError, match="kv_retrieval length 100 is too small"):
        list(KVRetrievalTask(lengths=[100], samples=1).samples(tok))


def test_kv_retrieval_config():
    spec = RunSpec.from_config(compose_cfg(["task=kv_retrieval", "task.lengths=[1024]", "task.questions=3"]))
    task = spec.task
    assert isinstance(task, KVRetrievalTask) and task.multi_question()
    assert (task.lengths, task.n_samples, task.questions, task.max_new_tokens) == ([1024], 5, 3, 64)
    more = RunSpec.from_config(
        compose_cfg(["task=kv_retrieval", "task.lengths=[1024,2048]", "task.samples=9"])
    )
    assert more.method_hash == RunSpec.from_config(compose_cfg(["task=kv_retrieval"])).method_hash


def test_kv_retrieval_bad_config_exits_2_before_the_model_loads(monkeypatch, tmp_path, capsys):
    import eval.runner as runner
    import run as run_module

    def no_model(*a, **k):
        raise AssertionError("the model was loaded although the config is invalid")

    monkeypatch.setattr(runner, "load_model", no_model)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "run.py", f"hydra.run.dir={tmp_path}/hydra", "hydra.output_subdir=null",
            "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
            f"results_dir={tmp_path}/results", "task=kv_retrieval", "task.questions=0",
        ],
    )  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        run_module.cli()
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and "questions=0" in err[0], err
    assert not (tmp_path / "results").exists()


# --------------------------------------------------------------------------------------------- RULER
def test_ruler_default_keeps_samples_and_hash(tok, essays):
    kw = dict(tasks=["niah_multiquery"], lengths=[1024], samples=1, haystack=essays)
    old = [(s.sample_id, s.prompt, s.answers, s.extra) for s in RulerTask(**kw).samples(tok)]
    off = [
        (s.sample_id, s.prompt, s.answers, s.extra)
        for s in RulerTask(**kw, separate_questions=False).samples(tok)
    ]
    assert off == old and [x[0] for x in old] == ["niah_multiquery-1024-0"] and len(old[0][2]) == 4
    assert not RulerTask(**kw).multi_question()
    spec = RunSpec.from_config(compose_cfg(["task=ruler"]))
    assert spec.task_config["separate_questions"] is False
    assert spec.method_hash == hash_without(spec, "separate_questions")
    on = RunSpec.from_config(compose_cfg(["task=ruler", "task.separate_questions=true"]))
    assert on.method_hash != spec.method_hash and on.task.multi_question()


def test_ruler_multiquery_separate_questions(tok, essays):
    kw = dict(tasks=["niah_multiquery", "niah_multivalue"], lengths=[1024], samples=2, haystack=essays)
    task = RulerTask(**kw, separate_questions=True)
    samples = list(task.samples(tok))
    assert task.multi_question() and task.num_samples() == len(samples) == 2 * 4 + 2
    multiquery = [s for s in samples if s.dataset == "niah_multiquery"]
    joined = {
        s.extra["ruler_index"]: s for s in RulerTask(**kw).samples(tok) if s.dataset == "niah_multiquery"
    }
    budget = 1024 - FAMILIES["niah"].tokens_to_generate
    for cid, group in by_context(multiquery).items():
        check_shared_context(group, 4)
        index = group[0].extra["ruler_index"]
        assert cid == f"niah_multiquery-1024-{index}"
        # the same keys and values as RULER's joined question, asked in its query order
        assert [s.answers[0] for s in group] == joined[index].answers
        asked = re.search(r"numbers for (.+?) mentioned", joined[index].question).group(1)
        assert [s.extra["ruler_query"] for s in group] == re.split(r", (?:and )?", asked)
        for s in group:
            key = s.extra["ruler_query"]
            assert len(s.answers) == 1 and s.context.count(s.answers[0]) == 1
            assert (
                f"\nWhat is the special magic number for {key} mentioned in the provided text?" in s.question
            )
            assert s.question.endswith(
                f" The special magic number for {key} mentioned in the provided text is"
            )
            assert s.extra["actual_tokens"] == ruler_prompt_tokens(tok, s.context, s.question) <= budget
            assert task.score(s, s.answers[0]) == 1.0
            assert task.score(s, group[0].answers[0]) == float(s is group[0])
            # as a later turn (first_question, multi_turn): the question alone, then the prefix
            assert s.extra["chat_template_applied"]
            assert s.turn == (
                f"What is the special magic number for {key} mentioned in the provided text?",
                f" The special magic number for {key} mentioned in the provided text is",
            )
        assert max(s.extra["actual_tokens"] for s in group) >= budget - 64
    # niah_multivalue: one key, four values: still one question
    multivalue = [s for s in samples if s.dataset == "niah_multivalue"]
    assert [s.sample_id for s in multivalue] == ["niah_multivalue-1024-0", "niah_multivalue-1024-1"]
    assert all(s.context_id is None and len(s.answers) == 4 for s in multivalue)


def test_ruler_separate_questions_refuses_pregenerated_multiquery(tmp_path):
    rec = {"index": 0, "input": "x What are all the special magic numbers for a, b mentioned in the provided text? "
           "The special magic numbers for a, b mentioned in the provided text are", "outputs": ["1", "2"], "length": 99}  # fmt: skip
    (tmp_path / "niah_multiquery.jsonl").write_text(json.dumps(rec) + "\n")
    task = RulerTask(tasks=["niah_multiquery"], data_dir=str(tmp_path), separate_questions=True)
    with pytest.raises(ValueError, match="separate_questions=true needs generated niah_multiquery"):
        task.num_samples()
    assert RulerTask(tasks=["niah_multiquery"], data_dir=str(tmp_path)).num_samples() == 1


def test_ruler_separate_questions_must_be_a_bool():
    with pytest.raises(ValueError, match="separate_questions='yes'"):
        RulerTask(separate_questions="yes")


# -------------------------------------------------------------------------------------------- report
def test_question_table():
    from eval.report import prepare
    from eval.store import ROW_FIELDS

    rows = []
    for method, params, hit in (("full", {}, (1, 1, 1)), ("snapkv", {"budget": 64, "window": 8}, (1, 0, 0))):
        for ctx in range(2):
            for q in range(3):
                rows.append(
                    {**dict.fromkeys(ROW_FIELDS), "sample_id": f"kv-512-{ctx}/q{q}", "task": "kv_retrieval",
                     "dataset": "kv_retrieval", "model": "m", "method": method, "method_params": params,
                     "method_hash": method, "query_aware": True, "status": "ok", "score": float(hit[q]),
                     "scores": {}, "context_length": 512, "context_id": f"kv-512-{ctx}", "question_index": q}
                )  # fmt: skip
    df = prepare(pd.DataFrame(rows))
    (table,) = question_tables(df, "context_length", title="string match")
    lines = table.splitlines()
    assert lines[0] == "### kv_retrieval — m: string match"
    header = next(line for line in lines if line.startswith("| method"))
    assert header == "| method | context_length | q0 | q1 | q2 | all |"
    body = [line for line in lines if line.startswith("| ") and not line.startswith("| method")]
    assert body[0].startswith("| full | 512 | 100.00 | 100.00 | 100.00 | 100.00 |")
    assert body[1].startswith("| snapkv") and body[1].endswith("| 100.00 | 0.00 | 0.00 | 33.33 |")
    assert question_tables(df.drop(columns=["context_id"]), "context_length") == []
    assert KVRetrievalReport.tables(df) == [table]


# ------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-mq", tok)


def test_run_rows_and_report(tiny_dir, tmp_path):
    import eval.runner as runner
    from eval.report import build_report
    from eval.store import ResultStore

    results = tmp_path / "runs"
    common = [
        f"model.name={tiny_dir}",
        "budget=64",
        f"results_dir={results}",
        "progress=false",
        "report=false",
    ]
    kv = [
        "task=kv_retrieval",
        "task.lengths=[600]",
        "task.samples=1",
        "task.questions=2",
        "task.max_new_tokens=4",
    ]
    needle = [
        "task.haystack=noise",
        "task.lengths=[300]",
        "task.depths=[50]",
        "task.needles=2",
        "task.max_new_tokens=4",
    ]
    for overrides in (kv, needle):
        runner.run(compose_cfg(common + overrides))
    df = ResultStore.load_dir(results)
    assert set(df["status"]) == {"ok"}, df["error"].tolist()
    kv_rows = df[df["task"] == "kv_retrieval"].sort_values("sample_id")
    assert kv_rows["sample_id"].tolist() == ["kv-600-0/q0", "kv-600-0/q1"]
    assert kv_rows["question_index"].tolist() == [0, 1] and set(kv_rows["context_id"]) == {"kv-600-0"}
    assert (kv_rows["input_tokens"] == kv_rows["actual_tokens"]).all()  # the measured length is what ran
    needle_rows = df[df["task"] == "needle"].sort_values("sample_id")
    assert needle_rows["sample_id"].tolist() == ["len300_depth50/q0", "len300_depth50/q1"]
    assert needle_rows["needle_key"].nunique() == 2
    build_report(results)
    report = (results / "report.md").read_text()
    assert "## Key-value retrieval" in report and "### kv_retrieval — tiny-llama-mq: string match" in report
    assert "### needle — tiny-llama-mq: per question" in report
