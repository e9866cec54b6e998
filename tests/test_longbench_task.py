"""LongBench task: config fidelity, data sources, LongBench's prompt + middle truncation, context/question split.

Offline: a byte-level BPE tokenizer trained in code, jsonl files in tmp_path, and
`huggingface_hub.hf_hub_download` replaced in every test (the Hub is never contacted).
"""

from __future__ import annotations

import json
import re
import sys
import types
import zipfile
from pathlib import Path

import huggingface_hub
import pytest
from conftest import byte_level_bpe

from eval.tasks.base import Sample
from eval.tasks.longbench import prompts as cfg
from eval.tasks.longbench.task import (
    LongBenchTask,
    model_max_length,
    read_jsonl,
    truncate_middle,
)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
SHARED_LB = SHARED / "data" / "longbench"

MULTI_NEWS_SUFFIX = "\n\nNow, write a one-page summary of all the news.\n\nSummary:"


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tokenizer():
    """A tiny byte-level BPE (GPT-2 style, like SmolLM2's) that adds a BOS token, as Llama's does."""
    corpus = [
        "You are given several news passages. Write a one-page summary of all news.",
        "Now, write a one-page summary of all the news. Summary:",
        "Please determine the type of the question below. Here are some examples of questions.",
        "Question: What is the capital of France? Type: Location",
        "The police said the protesters would stay in the park until the evening.",
    ]
    return byte_level_bpe(corpus, 400, ["<s>", "</s>"], bos="<s>", eos="</s>", add_bos=True)


class FakeHub:
    """Stands in for `huggingface_hub.hf_hub_download`: records calls, returns `archive` or raises."""

    def __init__(self, archive: Path | None = None):
        self.archive = archive
        self.calls: list[dict] = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if self.archive is None:
            raise OSError("We couldn't connect to 'https://huggingface.co'\n(second line)")
        return str(self.archive)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No test may reach the Hub or the user's real cache / LONGBENCH_DIR."""
    monkeypatch.delenv("LONGBENCH_DIR", raising=False)
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path / "cache_root"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub = FakeHub()
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub)
    return hub


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def trec_records(n: int = 3) -> list[dict]:
    classes = ["Location", "Person", "Date", "Number"]
    return [
        {
            "input": f"Question {i}: Where is the park number {i}?\nType:",
            "context": "Question: Who led the protest?\nType: Person\nQuestion: When did it end?\nType: Date",
            "answers": ["Location"],
            "length": 20 + i,
            "dataset": "trec",
            "language": "en",
            "all_classes": classes,
            "_id": f"trec-id-{i}",
        }
        for i in range(n)
    ]


@pytest.fixture
def multi_news_records() -> list[dict]:
    """The first three real multi_news records when ../shared is present, else synthetic ones."""
    src = SHARED_LB / "multi_news.jsonl"
    if src.is_file():
        with src.open(encoding="utf-8") as f:
            return [json.loads(next(f)) for _ in range(3)]
    para = "The police said the protesters would stay in the park until the evening. " * 150
    return [
        {
            "input": "",
            "context": f"Passage 1:\n{para}\nPassage 2:\n{para}",
            "answers": [f"Summary {i}."],
            "length": 2000 + i,
            "dataset": "multi_news",
            "language": "en",
            "all_classes": None,
            "_id": f"mn-{i}",
        }
        for i in range(3)
    ]


@pytest.fixture
def data_dir(tmp_path, multi_news_records) -> Path:
    d = tmp_path / "lb"
    write_jsonl(d / "multi_news.jsonl", multi_news_records)
    write_jsonl(d / "trec.jsonl", trec_records())
    return d


# ------------------------------------------------------------------------------------------ config
@pytest.mark.skipif(not SHARED_LB.is_dir(), reason="../shared/data/longbench not present")
def test_embedded_config_equals_upstream_json():
    prompts = json.loads((SHARED_LB / "config" / "dataset2prompt.json").read_text(encoding="utf-8"))
    maxlen = json.loads((SHARED_LB / "config" / "dataset2maxlen.json").read_text(encoding="utf-8"))
    model2maxlen = json.loads((SHARED_LB / "config" / "model2maxlen.json").read_text(encoding="utf-8"))
    assert cfg.DATASET2PROMPT == {d: prompts[d] for d in cfg.DATASETS}
    assert cfg.DATASET2MAXLEN == {d: maxlen[d] for d in cfg.DATASETS}
    assert cfg.MODEL2MAXLEN == model2maxlen


def test_config_covers_the_16_english_datasets():
    assert len(cfg.DATASETS) == 16 == len(set(cfg.DATASETS))
    assert set(cfg.DATASET2PROMPT) == set(cfg.DATASET2MAXLEN) == set(cfg.DATASETS)
    assert cfg.NO_CHAT_TEMPLATE == {"trec", "triviaqa", "samsum", "lcc", "repobench-p"}
    for d, template in cfg.DATASET2PROMPT.items():
        assert template.count("{context}") == 1, d
    assert LongBenchTask().datasets == list(cfg.DATASETS)


def test_model_max_length():
    assert model_max_length("llama2-7b-chat-4k") == 3500
    assert model_max_length("mistral-7B-instruct-v0.2") == 31500
    with pytest.raises(ValueError, match="unknown LongBench model name 'gpt-9'.*llama2-7b-chat-4k"):
        model_max_length("gpt-9")


# -------------------------------------------------------------------------------------- validation
def test_unknown_dataset_lists_known_ones():
    with pytest.raises(
        ValueError, match="unknown LongBench dataset 'multifieldqa_zh'.*narrativeqa.*repobench-p"
    ):
        LongBenchTask(datasets=["trec", "multifieldqa_zh"])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"datasets": []}, "must not be empty"),
        ({"datasets": ["trec", "trec"]}, "listed twice"),
        ({"limit": 0}, "limit=0"),
        ({"max_prompt_tokens": 1}, "max_prompt_tokens must be an int >= 2, got 1"),
    ],
)
def test_invalid_parameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LongBenchTask(**kwargs)


def test_single_dataset_string_is_accepted():
    assert LongBenchTask(datasets="trec").datasets == ["trec"]


# ----------------------------------------------------------------------------- prompts and samples
def test_multi_news_untruncated_prompt_is_longbench_prompt(tokenizer, data_dir, multi_news_records):
    task = LongBenchTask(datasets=["multi_news"], data_dir=str(data_dir), max_prompt_tokens=10**7)
    samples = list(task.samples(tokenizer))
    assert len(samples) == len(multi_news_records)
    for s, r in zip(samples, multi_news_records):
        assert isinstance(s, Sample)
        assert s.prompt == cfg.DATASET2PROMPT["multi_news"].format(**r)
        assert s.question == MULTI_NEWS_SUFFIX
        assert s.context.startswith("You are given several news passages.")
        assert s.context.endswith("\n\nNews:\n" + r["context"])
        assert s.sample_id == r["_id"]
        assert s.answers == r["answers"]
        assert s.length == r["length"]
        assert s.all_classes is None
        assert s.max_new_tokens == 512
        assert s.chat_template is True
        assert s.extra["truncated"] is False
        assert s.extra["prompt_tokens"] == len(tokenizer(s.prompt).input_ids)


def test_middle_truncation_keeps_first_and_last_half_tokens(tokenizer, data_dir, multi_news_records):
    max_tokens = 301  # odd on purpose: LongBench keeps 2 * int(301 / 2) = 300 tokens
    task = LongBenchTask(datasets=["multi_news"], data_dir=str(data_dir), max_prompt_tokens=max_tokens)
    for s, r in zip(task.samples(tokenizer), multi_news_records):
        full = cfg.DATASET2PROMPT["multi_news"].format(**r)
        ids = tokenizer(full, truncation=False).input_ids
        assert ids[0] == tokenizer.bos_token_id and len(ids) > max_tokens
        head = tokenizer.decode(ids[:150], skip_special_tokens=True)  # BOS counts, then is dropped
        tail = tokenizer.decode(ids[-150:], skip_special_tokens=True)
        assert s.prompt == head + tail
        assert full.startswith(head) and full.endswith(tail)  # byte-level BPE round-trips exactly
        # The question survives in the tail, so the split is the normal one.
        assert s.question == MULTI_NEWS_SUFFIX
        assert s.context == s.prompt[: -len(MULTI_NEWS_SUFFIX)]
        assert s.extra == {"prompt_tokens": len(ids), "truncated": True}


def test_bos_counts_toward_the_limit(tokenizer):
    prompt = "The police said the protesters would stay in the park."
    n = len(tokenizer(prompt).input_ids)  # includes BOS
    assert truncate_middle(prompt, tokenizer, n) == (prompt, n)
    truncated, count = truncate_middle(prompt, tokenizer, n - 1)
    assert count == n and truncated != prompt


def test_tiny_max_length_puts_everything_in_context(tokenizer, data_dir):
    task = LongBenchTask(datasets=["multi_news", "trec"], data_dir=str(data_dir), max_prompt_tokens=6)
    for s in task.samples(tokenizer):
        assert s.question == ""
        assert s.context == s.prompt
        assert s.extra["truncated"] is True
        assert len(tokenizer(s.prompt, add_special_tokens=False).input_ids) <= 6


def test_trec_sample_fields_and_split(tokenizer, data_dir):
    records = trec_records()
    task = LongBenchTask(datasets=["trec"], data_dir=str(data_dir))
    samples = list(task.samples(tokenizer))
    assert [s.sample_id for s in samples] == [r["_id"] for r in records]
    for s, r in zip(samples, records):
        assert s.chat_template is False
        assert s.max_new_tokens == 64
        assert s.all_classes == r["all_classes"]
        assert s.answers == ["Location"]
        assert s.question == "\n" + r["input"]  # template "...\n\n{context}\n{input}"
        assert s.context == (
            "Please determine the type of the question below. Here are some examples of questions.\n\n"
            + r["context"]
        )


@pytest.mark.parametrize("dataset", sorted(cfg.DATASETS))
def test_chat_template_flag_and_split_for_every_dataset(tokenizer, tmp_path, dataset):
    record = {"input": "What happened in the park?", "context": "Passage 1:\nA protest.", "answers": ["x"]}
    write_jsonl(tmp_path / "d" / f"{dataset}.jsonl", [record])
    (s,) = LongBenchTask(datasets=[dataset], data_dir=str(tmp_path / "d")).samples(tokenizer)
    assert s.chat_template is (dataset not in {"trec", "triviaqa", "samsum", "lcc", "repobench-p"})
    assert s.prompt == cfg.DATASET2PROMPT[dataset].format(**record)
    prefix, after = cfg.DATASET2PROMPT[dataset].split("{context}")
    assert s.context == prefix + record["context"]
    assert s.question == after.format(input=record["input"])
    assert s.sample_id == f"{dataset}-0"  # no _id → dataset-index
    assert s.length is None and s.all_classes is None


def test_record_missing_template_field(tokenizer, tmp_path):
    write_jsonl(tmp_path / "trec.jsonl", [{"context": "c", "answers": ["a"]}])
    task = LongBenchTask(datasets=["trec"], data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="trec record 0 lacks the field 'input'"):
        list(task.samples(tokenizer))


def test_limit_and_num_samples(tokenizer, data_dir, multi_news_records):
    task = LongBenchTask(datasets=["trec", "multi_news"], data_dir=str(data_dir), limit=2)
    samples = list(task.samples(tokenizer))
    assert [s.dataset for s in samples] == ["trec", "trec", "multi_news", "multi_news"]
    assert [s.sample_id for s in samples[2:]] == [r["_id"] for r in multi_news_records[:2]]
    assert task.num_samples() == 4
    assert LongBenchTask(datasets=["trec"], data_dir=str(data_dir)).num_samples() == 3


def test_score_delegates_to_metrics(monkeypatch):
    calls = []

    def score_sample(dataset, prediction, answers, all_classes):
        calls.append((dataset, prediction, answers, all_classes))
        return 0.5

    monkeypatch.setitem(
        sys.modules, "eval.tasks.longbench.metrics", types.SimpleNamespace(score_sample=score_sample)
    )
    sample = Sample("id", "trec", "ctx", "q", ["Location"], 64, False, all_classes=["Location", "Person"])
    assert LongBenchTask(datasets=["trec"]).score(sample, "Location\nmore") == 0.5
    assert calls == [("trec", "Location\nmore", ["Location"], ["Location", "Person"])]


# ------------------------------------------------------------------------------------ data sources
def test_env_var_fallback(tokenizer, monkeypatch, data_dir, offline):
    monkeypatch.setenv("LONGBENCH_DIR", str(data_dir))
    assert len(list(LongBenchTask(datasets=["trec"]).samples(tokenizer))) == 3
    assert offline.calls == []


def test_data_dir_wins_over_env_and_unzipped_layout(tokenizer, monkeypatch, tmp_path, offline):
    monkeypatch.setenv("LONGBENCH_DIR", str(tmp_path / "elsewhere"))
    write_jsonl(tmp_path / "unzipped" / "data" / "trec.jsonl", trec_records(2))
    task = LongBenchTask(datasets=["trec"], data_dir=str(tmp_path / "unzipped"))
    assert len(list(task.samples(tokenizer))) == 2
    assert offline.calls == []


def test_missing_file_in_data_dir_names_the_path(tokenizer, data_dir, offline):
    task = LongBenchTask(datasets=["qasper"], data_dir=str(data_dir))
    with pytest.raises(FileNotFoundError, match=re.escape(str(data_dir / "qasper.jsonl"))):
        list(task.samples(tokenizer))
    assert offline.calls == []  # an explicit directory never falls through to the Hub


def test_missing_file_in_env_dir_does_not_fall_through(tokenizer, monkeypatch, tmp_path, offline):
    monkeypatch.setenv("LONGBENCH_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="qasper.jsonl"):
        list(LongBenchTask(datasets=["qasper"]).samples(tokenizer))
    assert offline.calls == []


def test_hub_fallback_downloads_once_and_caches(tokenizer, monkeypatch, tmp_path):
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("data/", "")
        zf.writestr("data/trec.jsonl", "".join(json.dumps(r) + "\n" for r in trec_records()))
        zf.writestr("data/README.txt", "not a dataset")
    hub = FakeHub(archive)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hub)

    task = LongBenchTask(datasets=["trec"], limit=2)
    assert task.num_samples() == 2
    samples = list(task.samples(tokenizer))
    assert [s.sample_id for s in samples] == ["trec-id-0", "trec-id-1"]
    # HF_HUB_OFFLINE=1 here: the Hub is not probed, the download asks the local cache only.
    assert hub.calls == [
        {
            "repo_id": "THUDM/LongBench",
            "filename": "data.zip",
            "repo_type": "dataset",
            "local_files_only": True,
        }
    ]
    cached = tmp_path / "cache_root" / "longbench" / "data"
    assert sorted(p.name for p in cached.iterdir()) == ["trec.jsonl"]

    # A dataset the archive lacks: a clear error, no second download loop.
    with pytest.raises(FileNotFoundError, match="has no qasper.jsonl"):
        list(LongBenchTask(datasets=["qasper"]).samples(tokenizer))


def test_hub_failure_message(tokenizer, tmp_path, offline):
    with pytest.raises(FileNotFoundError) as info:
        list(LongBenchTask(datasets=["trec"]).samples(tokenizer))
    msg = str(info.value)
    assert "\n" not in msg
    assert "data_dir" in msg and "$LONGBENCH_DIR" in msg and "THUDM/LongBench" in msg
    assert str(tmp_path / "cache_root" / "longbench" / "data") in msg
    assert "task.data_dir=..." in msg and "LONGBENCH_DIR=..." in msg
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in msg  # why the Hub was not used
    assert len(offline.calls) == 1


# ------------------------------------------------------------------------------------------- jsonl
def test_malformed_jsonl_names_file_and_line(tokenizer, tmp_path):
    path = tmp_path / "trec.jsonl"
    path.write_text(json.dumps(trec_records(1)[0]) + "\n\n{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: malformed JSON")):
        list(LongBenchTask(datasets=["trec"], data_dir=str(tmp_path)).samples(tokenizer))


def test_read_jsonl_rejects_non_objects_and_respects_limit(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n[3]\n', encoding="utf-8")
    assert [r["a"] for r in read_jsonl(path, limit=2)] == [1, 2]
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: expected a JSON object")):
        list(read_jsonl(path))
