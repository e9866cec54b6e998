"""task=infinitebench: InfiniteBench's scorers against the scores its own `compute_scores.py` gives
its published predictions (tests/data/infinitebench_scores.json, written by
scripts/infinitebench_golden.py), its prompts and middle truncation, local jsonl / parquet data,
the refusals, and one run on a tiny model. The Hub path runs against the Hub look-alike in
tests/e2e/test_infinitebench_hub.py.

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
from eval.tasks.infinitebench import metrics
from eval.tasks.infinitebench.prompts import GPT4, MAX_NEW_TOKENS, TASKS, YARN_MISTRAL
from eval.tasks.infinitebench.task import InfiniteBenchTask, math_find_prefix, prompt_parts

GOLDEN = json.loads((ROOT / "tests" / "data" / "infinitebench_scores.json").read_text(encoding="utf-8"))
WORDS = " ".join(f"line {i} of the book tells of gardens and rivers." for i in range(40))

PASSKEY = {
    "id": 0,
    "context": WORDS + " The pass key is 71432. Remember it. " + WORDS,
    "input": "What is the pass key?",
    "answer": ["71432"],
    "options": [],
}
CHOICE = {
    "id": 4,
    "context": WORDS,
    "input": "Where does the book end?",
    "answer": ["rivers"],
    "options": ["gardens", "rivers", "hills", "sea"],
}
MATH_FIND = {
    "id": 1,
    "context": "[4, 97, 12]",
    "input": "What is the largest number in the list above? The largest number of the list is",
    "answer": [97],
    "options": [],
}
CODE_RUN = {
    "id": 2,
    "context": "def func_1(x):\n    return x + 1",
    "input": "What is the return value of func_1(-3)?",
    "answer": [-2],
    "options": [],
}
DEBUG = {
    "id": 3,
    "context": "def a(): pass\ndef b(): 1/0",
    "input": "",
    "answer": "b",
    "options": ["a", "b", "c", "d"],
}


@pytest.fixture(scope="module")
def tok():
    corpus = [WORDS, json.dumps(PASSKEY), json.dumps(CHOICE), json.dumps(MATH_FIND), json.dumps(CODE_RUN)]
    corpus += list(YARN_MISTRAL.values()) + list(GPT4.values())
    return byte_level_bpe(corpus, 600, ["<s>", "<|im_start|>", "<|im_end|>"], chat_template=CHATML)


# ------------------------------------------------------------------------------------------ metrics
@pytest.mark.parametrize("case", GOLDEN, ids=lambda g: f"{g['task']}:{g['source']}:{g['prediction'][:16]!r}")
def test_scores_match_infinitebench(case):
    """Each published (or hand-written) prediction scores as InfiniteBench's get_score_one gives it."""
    assert metrics.score(case["task"], case["prediction"], case["label"]) == pytest.approx(
        case["score"], abs=1e-12
    )


def test_golden_covers_every_task():
    assert {g["task"] for g in GOLDEN} == set(TASKS)
    for task in TASKS:  # each task's cases include a wrong one and a right (or partly right) one
        values = {g["score"] for g in GOLDEN if g["task"] == task}
        assert 0.0 in values and max(values) > 0, task
    assert {g["source"] for g in GOLDEN} >= {"gpt4", "yarn-mistral", "claude2", "kimi", "hand"}


def test_labels_of_the_choice_tasks():
    assert metrics.answer_label("longbook_choice_eng", CHOICE) == ["rivers", "B"]
    assert metrics.answer_label("code_debug", DEBUG) == ["b", "B"]
    assert metrics.answer_label("code_debug", {**DEBUG, "answer": ["b", "B"]}) == ["b", "B"]
    assert metrics.answer_label("passkey", PASSKEY) == ["71432"]
    with pytest.raises(ValueError, match=r"code_debug answer 'z' is not one of its options"):
        metrics.answer_label("code_debug", {**DEBUG, "answer": "z"})


# ------------------------------------------------------------------------------------------ prompts
def test_prompts_fill_the_templates():
    context, question = prompt_parts("passkey", PASSKEY)
    assert context + question == YARN_MISTRAL["passkey"].format(
        context=PASSKEY["context"], input=PASSKEY["input"]
    )
    assert question == "\n\nWhat is the pass key?\n\nThe pass key is"
    context, question = prompt_parts("longbook_choice_eng", CHOICE, "gpt4")
    assert context.startswith("Read the book and answer the question.\n\n" + WORDS[:20])
    assert "\nA. gardens\nB. rivers\nC. hills\nD. sea" in question
    context, question = prompt_parts("math_find", MATH_FIND)
    assert context == "What is the largest number in the following list?\n\n[4, 97, 12]"
    assert question == "\n\n" + MATH_FIND["input"]
    context, question = prompt_parts("code_run", CODE_RUN)
    assert context.startswith("There is a function called func_1 in the following Python code.\n\n")
    assert question.endswith("Please compute the exact value of func_1(-3). The value of func_1(-3) is")
    braces = {**PASSKEY, "context": "{not a field} {context}"}  # the context is never formatted
    assert prompt_parts("passkey", braces)[0].endswith("{not a field} {context}")


def test_prompt_errors():
    with pytest.raises(ValueError, match="math_find input has no 'The ... of' phrase"):
        math_find_prefix("What is the largest number?")
    with pytest.raises(ValueError, match=r"code_run input has no call func_<n>\(<int>\)"):
        prompt_parts("code_run", {**CODE_RUN, "input": "what does it return?"})
    with pytest.raises(ValueError, match="longbook_choice_eng needs 4 options"):
        prompt_parts("longbook_choice_eng", {**CHOICE, "options": ["a", "b"]})


def test_samples_from_local_jsonl(tmp_path, tok):
    for name, record in [("passkey", PASSKEY), ("longbook_choice_eng", CHOICE), ("code_run", CODE_RUN)]:
        write_jsonl(tmp_path / f"{name}.jsonl", [record, {**record, "id": 9}])
    task = InfiniteBenchTask(
        tasks=["passkey", "longbook_choice_eng", "code_run"], data_files=str(tmp_path), limit=1
    )
    assert task.num_samples() == 3
    samples = list(task.samples(tok))
    assert [s.sample_id for s in samples] == ["passkey-0", "longbook_choice_eng-4", "code_run-2"]
    assert [s.max_new_tokens for s in samples] == [6, 40, 5]
    assert samples[0].answers == ["71432"] and samples[2].answers == ["-2"]
    assert samples[0].context + samples[0].question == "".join(prompt_parts("passkey", PASSKEY))
    assert task.score(samples[0], "71432.") == 1.0 and task.score(samples[0], "71433") == 0.0
    assert task.score(samples[1], "B") == 1.0 and task.score(samples[1], "The answer is rivers") == 1.0
    assert task.score(samples[2], "The value is -2") == 1.0
    meta = task.row_metadata(samples[1])
    assert meta == {"prompt_tokens": meta["prompt_tokens"], "truncated": False, "record_id": 4}


def test_middle_truncation(tmp_path, tok):
    data = str(write_jsonl(tmp_path / "passkey.jsonl", [PASSKEY]))
    (full,) = InfiniteBenchTask(tasks=["passkey"], data_files=data, max_prompt_tokens=100000).samples(tok)
    n = full.extra["prompt_tokens"]
    ids = tok(full.context + full.question)["input_ids"]
    assert len(ids) == n and not full.extra["truncated"]
    budget = n // 2
    (cut,) = InfiniteBenchTask(tasks=["passkey"], data_files=data, max_prompt_tokens=budget).samples(tok)
    assert cut.extra == {**full.extra, "truncated": True}
    half = budget // 2  # InfiniteBench keeps max_length // 2 tokens of each end
    assert cut.context + cut.question == tok.decode(ids[:half], skip_special_tokens=True) + tok.decode(
        ids[-half:], skip_special_tokens=True
    )
    assert cut.question == full.question  # the end of the prompt survives whole


def test_local_parquet_and_single_file(tmp_path, tok):
    write_parquet(tmp_path / "math_find.parquet", [MATH_FIND])
    for data_files in (tmp_path / "math_find.parquet", tmp_path):
        task = InfiniteBenchTask(tasks=["math_find"], data_files=str(data_files))
        (sample,) = task.samples(tok)
        assert sample.answers == ["97"] and task.score(sample, "97") == 1.0, data_files


def test_local_data_errors(tmp_path):
    with pytest.raises(
        FileNotFoundError,
        match=r"InfiniteBench task kv_retrieval not found in task.data_files=.*xinrongzhang2022",
    ):
        InfiniteBenchTask(tasks=["kv_retrieval"], data_files=str(tmp_path)).num_samples()
    one = write_jsonl(tmp_path / "p.jsonl", [PASSKEY])
    with pytest.raises(ValueError, match="is one file but 2 InfiniteBench tasks"):
        InfiniteBenchTask(tasks=["passkey", "kv_retrieval"], data_files=str(one)).num_samples()
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"input": "x"}])
    with pytest.raises(ValueError, match=r"InfiniteBench passkey record 0: no \['context', 'answer'\]"):
        InfiniteBenchTask(tasks=["passkey"], data_files=str(bad)).num_samples()


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"tasks": ["nope"]}, "unknown InfiniteBench task 'nope'; known: passkey"),
        ({"tasks": []}, "tasks must not be empty"),
        ({"tasks": ["passkey", "passkey"]}, "listed twice"),
        ({"template": "kimi"}, "template must be one of yarn_mistral, gpt4, got template='kimi'"),
        ({"limit": 0}, "limit=0"),
        ({"max_prompt_tokens": 1}, "max_prompt_tokens=1"),
        ({"chat_template": "yes"}, "chat_template='yes'"),
        ({"repo": ""}, "repo=''"),
    ],
)
def test_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        InfiniteBenchTask(**kw)


# ------------------------------------------------------------------------------------------ config, CLI
def test_config_builds_the_task_and_selection_keeps_the_hash():
    spec = RunSpec.from_config(compose_cfg(["task=infinitebench"]))
    assert isinstance(spec.task, InfiniteBenchTask) and spec.task.tasks == list(TASKS)
    assert set(MAX_NEW_TOKENS) == set(TASKS) == set(YARN_MISTRAL) == set(GPT4)
    fewer = RunSpec.from_config(compose_cfg(["task=infinitebench", "task.tasks=[passkey]", "task.limit=2"]))
    assert fewer.method_hash == spec.method_hash
    assert build_task("infinitebench", tasks="passkey").tasks == ["passkey"]
    gpt4 = RunSpec.from_config(compose_cfg(["task=infinitebench", "task.template=gpt4"]))
    assert gpt4.task.template == "gpt4"


def test_offline_without_data_files_exits_2_before_the_model_loads(monkeypatch, tmp_path, capsys):
    assert_offline_refusal(
        monkeypatch,
        tmp_path,
        capsys,
        "infinitebench",
        ["task.tasks=[passkey]"],
        ["passkey", "xinrongzhang2022/InfiniteBench"],
    )


def test_bad_task_exits_2(monkeypatch, tmp_path, capsys):
    code, err = run_cli(monkeypatch, tmp_path, capsys, "infinitebench", "task.tasks=[passkey,nope]")
    assert code == 2 and len(err) == 1 and "unknown InfiniteBench task 'nope'" in err[0], err


# ------------------------------------------------------------------------------------------ run
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-ib", tok)


def test_runs_and_reports(tiny_dir, tmp_path):
    import eval.runner as runner
    from eval.report import build_report
    from eval.store import ResultStore

    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "passkey.jsonl", [PASSKEY])
    write_jsonl(tmp_path / "data" / "longbook_choice_eng.jsonl", [CHOICE])
    results = tmp_path / "runs"
    runner.run(
        compose_cfg(
            [
                f"model.name={tiny_dir}",
                "budget=64",
                f"results_dir={results}",
                "progress=false",
                "report=false",
                "task=infinitebench",
                "task.tasks=[passkey,longbook_choice_eng]",
                f"task.data_files={tmp_path / 'data'}",
                "task.max_prompt_tokens=1500",
            ]
        )  # fmt: skip
    )
    df = ResultStore.load_dir(results).sort_values("sample_id")
    assert set(df["status"]) == {"ok"}, df["error"].tolist()
    assert df["sample_id"].tolist() == ["longbook_choice_eng-4", "passkey-0"]
    assert df["dataset"].tolist() == ["longbook_choice_eng", "passkey"]
    for _, row in df.iterrows():  # the stored score is the scorer's on the stored prediction
        label = ["71432"] if row["dataset"] == "passkey" else ["rivers", "B"]
        assert row["score"] == metrics.score(row["dataset"], row["prediction"], label)
    build_report(results)
    assert "infinitebench" in (results / "report.md").read_text()
