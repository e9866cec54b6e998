"""task=scbench: SCBench's records as contexts with several questions, its prompts and truncation,
its metrics against the scores of SCBench's own code (tests/data/scbench_scores.json, written by
scripts/scbench_golden.py), local jsonl / parquet data, the refusals, and runs under the shared
protocols on a tiny model. The Hub path runs against the Hub look-alike in tests/e2e/test_scbench_hub.py.

Offline: a byte-level BPE tokenizer trained in code with a ChatML-like template; data files are
written to tmp_path.
"""

from __future__ import annotations

import json

import pytest
from conftest import CHATML, byte_level_bpe, save_tiny_llama
from hub_tasks import (
    ROOT,
    assert_offline_refusal,
    compose_cfg,
    run_cli,
    write_jsonl,
    write_parquet,
)

from eval.spec import RunSpec
from eval.tasks import build_task
from eval.tasks.scbench import metrics, repoqa
from eval.tasks.scbench.prompts import CONFIGS, DEFAULT, NEEDS_REPOQA
from eval.tasks.scbench.task import SCBenchTask, mf_prefix

ALL_GOLDEN = json.loads((ROOT / "tests" / "data" / "scbench_scores.json").read_text(encoding="utf-8"))
GOLDEN = [g for g in ALL_GOLDEN if "turn" in g]  # one turn each
REPOQA_GOLDEN = [g for g in ALL_GOLDEN if "record" in g]  # turns of one RepoQA record
WORDS = " ".join(f"line {i} of the book tells of gardens and rivers." for i in range(40))

KV = {
    "id": 7,
    "context": '{"k1": "v1", "k2": "v2", "k3": "v3"}',
    "multi_turns": [
        {"input": 'Key: "k2"\nThe value associated with the specified key is:', "answer": "v2"},
        {"input": 'Key: "k3"\nThe value associated with the specified key is:', "answer": "v3"},
    ],
}
CHOICE = {
    "id": 1,
    "context": WORDS,
    "multi_turns": [
        {"input": "Where?", "answer": "rivers", "options": ["gardens", "rivers", "hills", "sea"]},
        {"input": "What?", "answer": "book", "options": ["book", "film", "song", "play"]},
    ],
}
MF = {
    "id": 3,
    "context": [4, 97, 12],
    "multi_turns": [
        {
            "input": "What is the largest number in the list above? The largest number of the list is",
            "answer": 97,
        },
        {
            "input": "What is the smallest number in the list above? The smallest number of the list is",
            "answer": 4,
        },
    ],
}


@pytest.fixture(scope="module")
def tok():
    corpus = [WORDS, json.dumps(KV), json.dumps(CHOICE), json.dumps(MF)] + [g["prediction"] for g in GOLDEN]
    corpus += ["Extract the value corresponding to the specified key in the JSON object below."] * 3
    return byte_level_bpe(corpus, 600, ["<s>", "<|im_start|>", "<|im_end|>"], chat_template=CHATML)


# ------------------------------------------------------------------------------------------ metrics
@pytest.mark.parametrize("case", GOLDEN, ids=lambda g: f"{g['config']}:{g['prediction'][:20]!r}")
def test_scores_match_scbench(case, tok):
    """Each golden case, asked as a one-turn record through the task, scores as SCBench's code does."""
    task = SCBenchTask(configs=[case["config"]], max_prompt_tokens=4000)
    record = {"context": "some context", "multi_turns": [case["turn"]]}
    (sample,) = task.record_samples(case["config"], 0, record, tok, templated=True)
    assert task.score(sample, case["prediction"]) == case["score"]


@pytest.mark.parametrize("case", REPOQA_GOLDEN, ids=lambda g: f"q{g['turn_index']}:{g['prediction'][:20]!r}")
def test_repoqa_scores_match_scbench(case, tok):
    """RepoQA: the record's turns are its repository's needles; each prediction scores as SCBench's
    compute_scores (pass@1 at BLEU 0.8) gives it."""
    pytest.importorskip("tree_sitter_languages")
    task = SCBenchTask(configs=["scbench_repoqa"], max_prompt_tokens=20000)
    samples = task.record_samples("scbench_repoqa", 0, case["record"], tok, templated=True)
    sample = samples[case["turn_index"]]
    assert sample.answers == [case["record"]["multi_turns"][case["turn_index"]]["answer"]]
    assert task.score(sample, case["prediction"]) == case["score"]


def test_golden_covers_every_config():
    assert {g["config"] for g in ALL_GOLDEN} == set(CONFIGS) - {"scbench_repoqa_and_kv"}
    for config in CONFIGS:  # each config's cases include a right and a wrong prediction
        assert {g["score"] for g in ALL_GOLDEN if g["config"] == config} >= {
            0.0,
            1.0,
        } or config == "scbench_repoqa_and_kv"


def test_many_shot_whole_answer_metric(tok):
    task = SCBenchTask(configs=["scbench_many_shot"])
    record = {"context": "x", "multi_turns": [{"input": "Q:", "answer": "(A)"}], "task": "snarks"}
    (s,) = task.record_samples("scbench_many_shot", 0, record, tok, templated=True)
    assert s.extra["subtask"] == "snarks"
    assert task.score(s, "no idea") == 1.0  # SCBench's per-character test (metrics docstring)
    assert task.score_all(s, "no idea") == {"answer_in_prediction": 0.0}
    assert task.score_all(s, "it is (a).") == {"answer_in_prediction": 1.0}
    assert "subtask" in task.row_metadata(s) and "label" not in task.row_metadata(s)


def test_qa_chn_whole_answer_metric(tok):
    task = SCBenchTask(configs=["scbench_qa_chn"])
    record = {
        "context": "书",
        "multi_turns": [{"input": "谁？", "answer": "伊丽莎白"}, {"input": "哪里？", "answer": ["北京"]}],
    }
    s, listed = task.record_samples("scbench_qa_chn", 0, record, tok, templated=True)
    assert s.context == "阅读以下书籍然后回答问题。\n\n书" and s.question == "\n\n问题：谁？\n答案："
    assert task.score(s, "伊丽莎白") == 0.4  # SCBench's per-character labels (metrics docstring)
    assert task.score_all(s, "伊丽莎白") == {"f1_whole_answer": 1.0}
    assert task.score(listed, "北京") == 1.0 and task.score_all(listed, "北京") == {}


def test_choice_label_needs_the_answer_among_the_options():
    with pytest.raises(ValueError, match="not one of its options"):
        metrics.label("scbench_choice_eng", {"input": "q", "answer": "x", "options": ["a", "b", "c", "d"]})


# ------------------------------------------------------------------------------------------ prompts
def test_kv_samples_share_the_context(tmp_path, tok):
    task = SCBenchTask(configs=["scbench_kv"], data_files=str(write_jsonl(tmp_path / "kv.jsonl", [KV, KV])))
    assert task.num_samples() == 4 and task.multi_question()
    samples = list(task.samples(tok))
    assert [s.sample_id for s in samples] == [
        "scbench_kv-0/q0",
        "scbench_kv-0/q1",
        "scbench_kv-1/q0",
        "scbench_kv-1/q1",
    ]
    a, b = samples[:2]
    assert (
        a.context
        == b.context
        == (
            "Extract the value corresponding to the specified key in the JSON object below.\n\n"
            + KV["context"]
        )
    )
    assert (a.context_id, a.question_index, b.question_index) == ("scbench_kv-0", 0, 1)
    assert a.question == "\n\n" + KV["multi_turns"][0]["input"]
    assert b.turn == (KV["multi_turns"][1]["input"], "")  # a later chat turn: the query alone
    assert (a.answers, a.max_new_tokens, a.dataset) == (["v2"], 150, "scbench_kv")
    assert a.extra == {
        "label": "v2",
        "scorer": "scbench_kv",
        "prompt_tokens": a.extra["prompt_tokens"],
        "truncated": False,
        "record_id": 7,
        "turns": 2,
    }
    assert "label" not in task.row_metadata(a) and "scorer" not in task.row_metadata(a)


def test_choice_and_mf_prompts(tmp_path, tok):
    write_jsonl(tmp_path / "scbench_choice_eng.jsonl", [CHOICE])
    write_jsonl(tmp_path / "scbench_mf.jsonl", [MF])
    task = SCBenchTask(configs=["scbench_choice_eng", "scbench_mf"], data_files=str(tmp_path))
    choice, _, mf0, mf1 = task.samples(tok)
    assert choice.context == "Read the book and answer the question.\n\n" + WORDS
    assert choice.question == (
        "\n\nQuestion: Where?\nA. gardens\nB. rivers\nC. hills\nD. sea\n\nThe the correct answer is"
    )
    assert choice.answers == ["rivers", "B"] and choice.max_new_tokens == 40
    assert mf0.context == "What is the largest number of the list?\n\n[4, 97, 12]"
    assert mf1.question == "\n\nWhat is the smallest number of the list?\n\n" + MF["multi_turns"][1]["input"]
    assert (mf0.answers, mf0.max_new_tokens) == (["97"], 5)
    assert task.score(mf1, "It is 4.") == 1.0 and task.score(mf0, "4") == 0.0


def test_summary_prompts_and_mixed_turns(tmp_path, tok):
    summary = {
        "context": WORDS,
        "multi_turns": [{"input": "Summarize.", "answer": "s1"}, {"input": "Again.", "answer": "s2"}],
    }
    needles = {
        "context": WORDS,
        "multi_turns": [
            {"input": "Summarize.", "answer": "a summary", "task": "scbench_summary"},
            {"input": "What is the pass key?", "answer": "123", "task": "scbench_passkey"},
        ],
    }
    write_jsonl(tmp_path / "scbench_summary.jsonl", [summary])
    write_jsonl(tmp_path / "scbench_summary_with_needles.jsonl", [needles])
    task = SCBenchTask(configs=["scbench_summary", "scbench_summary_with_needles"], data_files=str(tmp_path))
    s0, s1, n0, n1 = task.samples(tok)
    assert s0.context == WORDS and s0.question == "\n\nSummarize." and s0.max_new_tokens == 200
    # SCBench's multi-turn mode prefixes later summaries with "This paper" (an answer prefix)
    assert (s0.turn, s1.turn) == (("Summarize.", ""), ("Again.", "This paper"))
    assert (n0.dataset, n1.dataset) == (
        "scbench_summary_with_needles:summary",
        "scbench_summary_with_needles:passkey",
    )
    assert (n0.max_new_tokens, n1.max_new_tokens) == (800, 15) and n0.context_id == n1.context_id
    assert n1.extra["subtask"] == "scbench_passkey" and "scorer" not in task.row_metadata(n1)
    assert task.score(n1, "The key is 123.") == 1.0 and task.score(n0, "a summary") == 1.0
    # the context keeps (800 + 15) x 2 turns // 2 tokens free for the answers
    tight = SCBenchTask(
        configs=["scbench_summary_with_needles"], data_files=str(tmp_path), max_prompt_tokens=830
    )
    assert next(iter(tight.samples(tok))).extra["truncated"]
    with pytest.raises(ValueError, match="leaves no room"):
        list(
            SCBenchTask(
                configs=["scbench_summary_with_needles"],
                data_files=str(tmp_path),
                max_prompt_tokens=816,
            ).samples(tok)
        )
    bad = {**needles, "multi_turns": [{"input": "x", "answer": "y", "task": "scbench_kv"}]}
    with pytest.raises(
        ValueError, match="turn task must be one of scbench_summary, scbench_passkey, got task='scbench_kv'"
    ):
        task.record_samples("scbench_summary_with_needles", 0, bad, tok, templated=True)


def test_repoqa_and_kv_mixed_turns(tmp_path, tok):
    pytest.importorskip("tree_sitter_languages")
    code = "def add(a, b):\n    return a + b"
    other = "def sub(a, b):\n    return a - b"
    record = {
        "context": code + "\n\n" + other + '\n{"k1": "v1"}',
        "lang": "python",
        "repo": "o/r",
        "multi_turns": [
            {"input": "Adds.", "answer": code, "name": "add", "task": "scbench_repoqa"},
            {"input": 'Key: "k1"', "answer": "v1", "task": "scbench_kv"},
            {"input": "Subtracts.", "answer": other, "name": "sub", "task": "scbench_repoqa"},
        ],
    }
    write_jsonl(tmp_path / "scbench_repoqa_and_kv.jsonl", [record, {**record, "repo": "o/other"}])
    task = SCBenchTask(configs=["scbench_repoqa_and_kv"], data_files=str(tmp_path))
    q0, q1, q2, *_ = task.samples(tok)
    assert [s.dataset for s in (q0, q1, q2)] == [
        "scbench_repoqa_and_kv:repoqa", "scbench_repoqa_and_kv:kv", "scbench_repoqa_and_kv:repoqa",
    ]  # fmt: skip
    assert [s.max_new_tokens for s in (q0, q1, q2)] == [1024, 80, 1024] and q0.context == record["context"]
    # the needles of a repository: its RepoQA turns only, over every record about it
    assert q0.extra["label"]["needles"] == [["add", code], ["sub", other]]
    meta = task.row_metadata(q0)
    assert (meta["function"], meta["lang"], meta["repo"], meta["subtask"]) == (
        "add",
        "python",
        "o/r",
        "scbench_repoqa",
    )
    assert (
        task.score(q0, f"```python\n{code}\n```") == 1.0 and task.score(q2, f"```python\n{code}\n```") == 0.0
    )
    assert task.score(q1, "The value is v1.") == 1.0 and task.score(q1, "V1") == 0.0


def test_mf_prefix_needs_its_phrase():
    assert mf_prefix("... The sum of the list is") == "What is the sum of the list?"
    with pytest.raises(ValueError, match="scbench_mf input has no"):
        mf_prefix("no phrase here")


def test_without_chat_template(tmp_path, tok):
    data = str(write_jsonl(tmp_path / "kv.jsonl", [KV]))
    plain = list(SCBenchTask(configs=["scbench_kv"], data_files=data, chat_template=False).samples(tok))
    assert [s.turn for s in plain] == [None, None] and not plain[0].chat_template


def test_middle_truncation(tmp_path, tok):
    record = {
        "context": WORDS,
        "multi_turns": [{"input": "Q1", "answer": "a"}, {"input": "Q2", "answer": "b"}],
    }
    data = str(write_jsonl(tmp_path / "qa.jsonl", [record]))
    full = list(SCBenchTask(configs=["scbench_qa_eng"], data_files=data, max_prompt_tokens=4000).samples(tok))
    n = full[0].extra["prompt_tokens"]
    assert not full[0].extra["truncated"]
    budget = 30
    cut = list(
        SCBenchTask(configs=["scbench_qa_eng"], data_files=data, max_prompt_tokens=budget + 2 * 40).samples(
            tok
        )
    )  # 2 turns x 40 new tokens are reserved
    assert cut[0].extra == {**full[0].extra, "truncated": True} and cut[0].context == cut[1].context
    ids = tok(full[0].context)["input_ids"]
    assert len(ids) == n > budget
    head, tail = tok.decode(ids[: budget // 2]), tok.decode(ids[-(budget // 2) :])
    assert cut[0].context == head + tail
    with pytest.raises(ValueError, match="leaves no room"):
        list(SCBenchTask(configs=["scbench_qa_eng"], data_files=data, max_prompt_tokens=81).samples(tok))


# ------------------------------------------------------------------------------------------ data
def test_local_parquet_layouts(tmp_path, tok):
    write_parquet(tmp_path / "scbench_kv.parquet", [KV])
    write_parquet(tmp_path / "hub" / "scbench_kv" / "test-00000-of-00001.parquet", [KV])
    for data_files in (tmp_path / "scbench_kv.parquet", tmp_path, tmp_path / "hub"):
        task = SCBenchTask(configs=["scbench_kv"], data_files=str(data_files), limit=1)
        assert task.records("scbench_kv") == [KV], data_files
        assert [s.answers for s in task.samples(tok)] == [["v2"], ["v3"]]


def test_local_data_errors(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"scbench_vt not found in task.data_files=.*microsoft/SCBench"
    ):
        SCBenchTask(configs=["scbench_vt"], data_files=str(tmp_path)).num_samples()
    one = write_jsonl(tmp_path / "kv.jsonl", [KV])
    with pytest.raises(ValueError, match="is one file but 2 SCBench configs"):
        SCBenchTask(configs=["scbench_kv", "scbench_vt"], data_files=str(one)).num_samples()
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"context": "x", "multi_turns": []}])
    with pytest.raises(ValueError, match="scbench_kv record 0: expected a 'context' and a non-empty list"):
        SCBenchTask(configs=["scbench_kv"], data_files=str(bad)).num_samples()


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"configs": ["scbench_nope"]}, "unknown SCBench config 'scbench_nope'; known: scbench_kv"),
        ({"configs": []}, "configs must not be empty"),
        ({"configs": ["scbench_kv", "scbench_kv"]}, "listed twice"),
        ({"limit": 0}, "limit=0"),
        ({"max_prompt_tokens": 1}, "max_prompt_tokens=1"),
        ({"chat_template": "yes"}, "chat_template='yes'"),
        ({"split": ""}, "split=''"),
    ],
)
def test_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SCBenchTask(**kw)


def test_repoqa_configs_need_their_grammars(monkeypatch):
    assert set(DEFAULT) == set(CONFIGS) - set(NEEDS_REPOQA)
    monkeypatch.setattr(repoqa, "available", lambda: False)
    for config in NEEDS_REPOQA:
        with pytest.raises(ValueError, match=rf"'{config}' needs the tree-sitter grammars.*\.\[repoqa\]"):
            SCBenchTask(configs=["scbench_kv", config])
    SCBenchTask(configs=list(DEFAULT))


# ------------------------------------------------------------------------------------------ config, CLI
def test_config_builds_the_task_and_selection_keeps_the_hash():
    spec = RunSpec.from_config(compose_cfg(["task=scbench"]))
    assert isinstance(spec.task, SCBenchTask) and spec.task.configs == list(DEFAULT)
    fewer = RunSpec.from_config(compose_cfg(["task=scbench", "task.configs=[scbench_kv]", "task.limit=2"]))
    assert fewer.method_hash == spec.method_hash
    assert build_task("scbench", configs="scbench_vt").configs == ["scbench_vt"]


def test_offline_without_data_files_exits_2_before_the_model_loads(monkeypatch, tmp_path, capsys):
    assert_offline_refusal(
        monkeypatch,
        tmp_path,
        capsys,
        "scbench",
        ["task.configs=[scbench_kv]"],
        ["scbench_kv", "microsoft/SCBench"],
    )


def test_bad_config_exits_2(monkeypatch, tmp_path, capsys):
    code, err = run_cli(monkeypatch, tmp_path, capsys, "scbench", "task.configs=[scbench_kv,scbench_nope]")
    assert code == 2 and len(err) == 1 and "unknown SCBench config 'scbench_nope'" in err[0], err
    monkeypatch.setattr(repoqa, "available", lambda: False)
    code, err = run_cli(monkeypatch, tmp_path, capsys, "scbench", "task.configs=[scbench_repoqa_and_kv]")
    assert code == 2 and len(err) == 1 and "pip install -e '.[repoqa]'" in err[0], err


# ------------------------------------------------------------------------------------------ runs
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-scb", tok)


def test_runs_under_each_protocol_and_reports(tiny_dir, tmp_path):
    import eval.runner as runner
    from eval.report import build_report
    from eval.store import ResultStore

    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "scbench_kv.jsonl", [KV])
    write_jsonl(tmp_path / "data" / "scbench_choice_eng.jsonl", [CHOICE])
    results = tmp_path / "runs"
    common = [
        f"model.name={tiny_dir}", "budget=64", f"results_dir={results}", "progress=false", "report=false",
        "task=scbench", "task.configs=[scbench_kv,scbench_choice_eng]", f"task.data_files={tmp_path / 'data'}",
    ]  # fmt: skip
    protocols = ("query_aware", "context_only", "first_question", "multi_request", "multi_turn")
    for protocol in protocols:
        runner.run(compose_cfg(common + [f"protocol={protocol}"]))
    df = ResultStore.load_dir(results)
    assert set(df["status"]) == {"ok"}, df["error"].tolist()
    assert len(df) == 4 * len(protocols) and set(df["protocol"]) == set(protocols)
    for _, part in df.groupby("protocol"):
        part = part.sort_values("sample_id")
        assert part["sample_id"].tolist() == [
            "scbench_choice_eng-0/q0", "scbench_choice_eng-0/q1", "scbench_kv-0/q0", "scbench_kv-0/q1",
        ]  # fmt: skip
        assert part["question_index"].tolist() == [0, 1, 0, 1]
        assert set(part["dataset"]) == {"scbench_kv", "scbench_choice_eng"}
    shared = df[df["protocol"] == "multi_turn"].sort_values("sample_id")
    assert (shared["questions_in_context"] == 2).all()
    assert shared["input_tokens"].iloc[1] > shared["input_tokens"].iloc[0]  # turn 2 follows turn 1
    build_report(results)
    report = (results / "report.md").read_text()
    for heading in ("### scbench — tiny-llama-scb", "### Score per question — scbench — tiny-llama-scb",
                    "### Reuse penalty — scbench — tiny-llama-scb"):  # fmt: skip
        assert heading in report, heading
