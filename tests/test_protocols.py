"""The `protocol` axis end to end on the tiny model: every protocol through `eval.runner.run` with a
multi-question task defined here, one row per question; `context_only` == `multi_request` for every
method of the catalogue; `first_question`'s question 1 == `query_aware`'s; per-question resume;
bad input; the next-turn rendering; config hashes of the two older protocols unchanged."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
from cache_paths import catalogue_cases
from omegaconf import OmegaConf, open_dict
from transformers import AutoTokenizer

import eval.protocols as protocols
import eval.runner as runner
import eval.spec as spec_module
from eval.spec import RunSpec
from eval.store import read_rows
from eval.tasks import TASKS, Sample, Task, register_task
from eval.tasks import haystack as hs
from snapkv import build_method, generate
from snapkv.prompts import encode_prompt, next_turn_text, render_prompt
from tests import test_runner
from tests.test_runner import _no_model_load, make_cfg, result_files, run_cli_in_process

tiny_dir = test_runner.tiny_dir  # the saved tiny model (session fixture)

FACTS = [("apple", "red"), ("sky", "blue"), ("grass", "green"), ("sun", "yellow")]


@dataclass
class AskMany(Task):
    """`contexts` documents of noise with facts in them, `questions` questions about each."""

    name: ClassVar[str] = "askmany"
    selection_keys: ClassVar[tuple[str, ...]] = ("contexts",)

    contexts: int = 2
    questions: int = 3
    repeat: int = 1  # noise sentences before each fact (the tiny tokenizer: 134 tokens per context)
    new_tokens: int = 6

    def multi_question(self) -> bool:
        return self.questions > 1

    def samples(self, tokenizer):
        for c in range(self.contexts):
            facts = FACTS[c:] + FACTS[:c]
            noise = " ".join([hs.NOISE_TEXT] * self.repeat)
            context = "Read the facts. " + " ".join(f"{noise} The {k} is {v}." for k, v in facts) + "\n"
            for q, (key, value) in enumerate(facts[: self.questions]):
                yield Sample(
                    sample_id=f"c{c}_q{q}",
                    dataset="askmany",
                    context=context,
                    question=f"What colour is the {key}?",
                    answers=[value],
                    max_new_tokens=self.new_tokens,
                    context_id=f"c{c}",
                    question_index=q,
                )

    def score(self, sample, prediction):
        return float(sample.answers[0] in prediction)


@pytest.fixture
def askmany():
    register_task(AskMany)
    yield
    TASKS.pop("askmany")


def cfg_for(tiny_dir, results, protocol, *overrides, contexts=2, questions=3):
    cfg = make_cfg(tiny_dir, results, f"protocol={protocol}", *overrides)
    with open_dict(cfg):
        cfg.task = OmegaConf.create(
            {"name": "askmany", "contexts": contexts, "questions": questions, "shard": 0, "num_shards": 1}
        )
    return cfg


def rows_by_id(path) -> dict[str, dict]:
    return {r["sample_id"]: r for r in read_rows(path)}


QUESTION_IDS = {f"c{c}_q{q}" for c in range(2) for q in range(3)}


# ---------------------------------------------------------------------------------------- end to end
def test_every_protocol_writes_one_row_per_question(askmany, tiny_dir, tmp_path):
    results = tmp_path / "results"
    for protocol in protocols.PROTOCOLS:
        runner.run(cfg_for(tiny_dir, results, protocol))
    files = result_files(results)
    assert len(files) == len(protocols.PROTOCOLS)  # each protocol its own results file
    by_protocol = {}
    for path in files:
        rows = read_rows(path)
        assert {r["sample_id"] for r in rows} == QUESTION_IDS and len(rows) == len(QUESTION_IDS)
        (protocol,) = {r["protocol"] for r in rows}
        by_protocol[protocol] = {r["sample_id"]: r for r in rows}
        for r in rows:
            assert r["status"] == "ok", r["error"]
            assert r["context_id"] == r["sample_id"][:2] and r["question_index"] == int(r["sample_id"][-1])
            assert r["questions_in_context"] == 3
            assert r["query_aware"] is (protocol in ("query_aware", "first_question"))
            assert r["context_prefill_s"] > 0 and r["prefill_s"] == r["context_prefill_s"]
            assert r["ttft_s"] > 0 and (r["tpot_s"] is None or r["tpot_s"] > 0)
            assert r["compressed"] and 0 < r["kv_tokens"] <= 64 and 0 < r["kv_bytes"] < r["kv_bytes_full"]
            assert isinstance(r["prediction"], str) and r["new_tokens"] >= 1
            if protocol in ("first_question", "multi_request"):
                assert r["rollback_bytes"] == 0  # snapkv never evicts while decoding: nothing held
            else:
                assert r["rollback_bytes"] is None
    assert set(by_protocol) == set(protocols.PROTOCOLS)

    # One compression per context: its measurements are on every question's row.
    for protocol in protocols.SHARED:
        rows = by_protocol[protocol]
        for c in ("c0", "c1"):
            shared = {
                (rows[f"{c}_q{q}"]["context_prefill_s"], rows[f"{c}_q{q}"]["kv_bytes"]) for q in range(3)
            }
            assert len(shared) == 1, (protocol, c)
    # first_question's question 1 is query_aware's run; multi_request's questions are context_only's.
    for sid in QUESTION_IDS:
        qa, first = by_protocol["query_aware"][sid], by_protocol["first_question"][sid]
        if sid.endswith("q0"):
            assert first["prediction"] == qa["prediction"] and first["input_tokens"] == qa["input_tokens"]
            assert first["kv_tokens"] == qa["kv_tokens"]
        else:
            assert first["input_tokens"] > qa["input_tokens"]  # the previous turn's markers as well
        assert (
            by_protocol["multi_request"][sid]["prediction"] == by_protocol["context_only"][sid]["prediction"]
        )
        assert (
            by_protocol["multi_request"][sid]["input_tokens"]
            == by_protocol["context_only"][sid]["input_tokens"]
        )
    # multi_turn's first turn is multi_request's; later turns see every earlier turn in the cache.
    turns = by_protocol["multi_turn"]
    for c in ("c0", "c1"):
        assert turns[f"{c}_q0"]["prediction"] == by_protocol["multi_request"][f"{c}_q0"]["prediction"]
        tokens = [turns[f"{c}_q{q}"]["input_tokens"] for q in range(3)]
        for q in (1, 2):
            prev = turns[f"{c}_q{q - 1}"]
            assert tokens[q] > tokens[q - 1] + prev["new_tokens"] - 1
        assert all(turns[f"{c}_q{q}"]["kv_tokens_end"] is not None for q in range(3))


def test_first_question_answers_question_one_exactly_as_query_aware(askmany, tiny_dir):
    """Token for token: the same prompt, the same cache after compression, the same greedy decode."""
    model, tokenizer, _ = runner.get_model(RunSpec.from_config(cfg_for(tiny_dir, "unused", "query_aware")))
    (context, *_) = protocols.group_contexts(AskMany().samples(tokenizer))
    for name, params in [("snapkv", dict(budget=40, window=8, kernel_size=5)), ("h2o", dict(budget=40))]:
        method = build_method(name, **params)
        q1 = context.samples[0]
        want = generate(
            model, tokenizer, context=q1.context, question=q1.question, method=method, max_new_tokens=6
        )
        (got, *_) = protocols.ask_context(
            "first_question", context, {q1.sample_id}, model, tokenizer, method, chat_template=True
        )
        assert got.error is None and got.text == want.text and got.fields["kv_tokens"] == want.kv_tokens
        assert got.fields["new_tokens"] == want.new_tokens and got.fields["input_tokens"] == want.input_tokens


# The catalogue on the tiny Llama: in the fast tier the first entry of each mechanism and the cache
# paths' representatives (the two protocols share the compress / feed / decode forwards, whichever
# entries a method's switches keep), the other switch settings in the slow tier (tests/cache_paths.py).
@pytest.mark.parametrize("name,params", catalogue_cases())
def test_context_only_and_multi_request_give_identical_predictions(askmany, tiny_dir, name, params):
    """The same forwards: compress the context, feed the question, decode; once per question
    (context_only, `generate(query_aware=False)`) or once per context with rollbacks (multi_request)."""
    model, tokenizer, _ = runner.get_model(RunSpec.from_config(cfg_for(tiny_dir, "unused", "query_aware")))
    method = build_method(name, **params)
    for context in protocols.group_contexts(AskMany(contexts=1, new_tokens=4).samples(tokenizer)):
        todo = {s.sample_id for s in context.samples}
        shared = list(
            protocols.ask_context(
                "multi_request", context, todo, model, tokenizer, method, chat_template=True
            )
        )
        assert [o.sample for o in shared] == context.samples
        for outcome in shared:
            s = outcome.sample
            alone = generate(
                model, tokenizer, context=s.context, question=s.question, method=method,
                query_aware=False, max_new_tokens=s.max_new_tokens,
            )  # fmt: skip
            assert outcome.error is None and outcome.text == alone.text, s.sample_id
            assert outcome.fields["new_tokens"] == alone.new_tokens
            assert outcome.fields["kv_tokens"] == alone.kv_tokens


def test_catalogue_contexts_really_evict(askmany, tiny_dir):
    """The catalogue's budgets (40) are below the contexts' lengths, so every method but full evicts."""
    model, tokenizer, _ = runner.get_model(RunSpec.from_config(cfg_for(tiny_dir, "unused", "query_aware")))
    for context in protocols.group_contexts(AskMany().samples(tokenizer)):
        head, _ = encode_prompt(tokenizer, context.samples[0].context, context.samples[0].question, True)
        assert 96 <= len(head) < 200


# -------------------------------------------------------------------------------------------- resume
class CountingAnswer:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return REAL_ANSWER(*args, **kwargs)


REAL_ANSWER = protocols.answer
LOST = {"c0_q0", "c1_q2"}


@pytest.mark.parametrize("protocol", protocols.PROTOCOLS)
def test_resume_reruns_only_the_deleted_questions(askmany, tiny_dir, tmp_path, monkeypatch, protocol):
    results = tmp_path / "results"
    cfg = cfg_for(tiny_dir, results, protocol)
    runner.run(cfg)
    (path,) = result_files(results)
    before = rows_by_id(path)
    kept = [line for line in path.read_text().splitlines() if not any(f'"{sid}"' in line for sid in LOST)]
    path.write_text("\n".join(kept) + "\n")

    counting = CountingAnswer()
    monkeypatch.setattr(protocols, "answer", counting)
    sample_calls = test_runner.CountingGenerate()
    monkeypatch.setattr(runner, "generate", sample_calls)
    runner.run(cfg)
    rows = read_rows(path)
    assert len(rows) == len(QUESTION_IDS) and {r["sample_id"] for r in rows} == QUESTION_IDS
    assert {r["sample_id"] for r in rows[-len(LOST) :]} == LOST  # appended; the others untouched
    assert rows[: -len(LOST)] == [before[r["sample_id"]] for r in rows[: -len(LOST)]]
    for r in rows[-len(LOST) :]:
        assert r["status"] == "ok" and r["prediction"] == before[r["sample_id"]]["prediction"]
    expected_answers = {
        "query_aware": 0,
        "context_only": 0,
        "multi_request": 2,  # the two lost questions
        "first_question": 1,  # c1_q2; c0_q0 is question 1, decoded with the prefill
        "multi_turn": 6,  # both conversations replayed, all three turns each
    }[protocol]
    assert counting.calls == expected_answers
    assert len(sample_calls.calls) == (len(LOST) if protocol in ("query_aware", "context_only") else 0)

    runner.run(cfg)  # everything done: nothing runs
    assert len(read_rows(path)) == len(QUESTION_IDS) and counting.calls == expected_answers


def test_shards_keep_a_context_together(askmany, tiny_dir, tmp_path):
    results = tmp_path / "results"
    runner.run(cfg_for(tiny_dir, results, "multi_request", contexts=3))
    rows = [r for f in result_files(results) for r in read_rows(f)]
    assert len(rows) == 9
    results2 = tmp_path / "sharded"
    for i in range(2):
        cfg = cfg_for(tiny_dir, results2, "multi_request", contexts=3)
        cfg.task.shard, cfg.task.num_shards = i, 2
        runner.run(cfg)
    files = result_files(results2)
    contexts = [{r["context_id"] for r in read_rows(f)} for f in files]
    assert contexts == [{"c0", "c2"}, {"c1"}]
    sharded = {r["sample_id"]: r["prediction"] for f in files for r in read_rows(f)}
    assert sharded == {r["sample_id"]: r["prediction"] for r in rows}


# --------------------------------------------------------------------------------------- bad input
BAD = {
    "unknown protocol": (["protocol=bogus"], "protocol must be one of query_aware, context_only"),
    "shared protocol, single-question task": (
        ["protocol=multi_request"],
        "protocol=multi_request asks several",
    ),
    "first_question with query_aware=false": (
        ["protocol=first_question", "query_aware=false"],
        "query_aware=false contradicts protocol=first_question",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_protocol_is_one_line_and_exit_2(case, monkeypatch, tmp_path, capsys):
    args, expected = BAD[case]
    monkeypatch.setattr(runner, "load_model", _no_model_load)
    code = run_cli_in_process(monkeypatch, tmp_path, f"results_dir={tmp_path}/results", *args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not (tmp_path / "results").exists()


def test_a_shared_protocol_on_a_task_asking_one_question_per_context_is_refused(askmany, tiny_dir, tmp_path):
    with pytest.raises(ValueError, match="task 'askmany' as configured asks one"):
        RunSpec.from_config(cfg_for(tiny_dir, tmp_path, "multi_turn", questions=1))


# ------------------------------------------------------------------------------------------ hashing
def test_older_protocols_hash_as_before_and_shared_ones_get_their_own_file(
    askmany, tiny_dir, tmp_path, monkeypatch
):
    hashed = []
    real = spec_module.config_hash
    monkeypatch.setattr(spec_module, "config_hash", lambda d: hashed.append(d) or real(d))
    older = {"method", "method_params", "query_aware", "task", "model", "prefill_chunk_size"}

    def spec(*overrides, drop_protocol=False):
        cfg = cfg_for(tiny_dir, tmp_path, "query_aware", *overrides)
        if drop_protocol:  # a config from before the key existed
            with open_dict(cfg):
                del cfg["protocol"]
        return RunSpec.from_config(cfg)

    qa = spec().method_hash
    assert set(hashed[-1]) == older and hashed[-1]["query_aware"] is True
    assert spec(drop_protocol=True).method_hash == qa
    co = spec("protocol=context_only").method_hash
    assert set(hashed[-1]) == older and hashed[-1]["query_aware"] is False
    assert spec("query_aware=false").method_hash == co
    assert spec("query_aware=false", drop_protocol=True).method_hash == co
    shared = {spec(f"protocol={p}").method_hash for p in protocols.SHARED}
    assert len(shared | {qa, co}) == 5
    assert spec("protocol=multi_turn", "query_aware=false").protocol == "multi_turn"


# ------------------------------------------------------------------------------------ next user turn
CHATML = test_runner.CHATML
# Llama-3 style: a system-less header per turn, the content trimmed.
TRIMMING = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# Rewrites earlier turns once the conversation goes on (keeps only the last user turn).
FORGETFUL = (
    "{% for m in messages %}{% if loop.last %}<u>{{ m['content'] }}</u>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)


@pytest.fixture
def tokenizer_with(tiny_dir):
    """The tiny tokenizer with another chat template (None: none)."""

    def make(template: str | None):
        tok = AutoTokenizer.from_pretrained(tiny_dir)
        tok.chat_template = template
        return tok

    return make


def test_next_turn_text_on_chatml(tokenizer_with):
    tok = tokenizer_with(CHATML)
    history = [("Doc. Q1?", "")]
    assert (
        next_turn_text(tok, history, "Q2?")
        == "<|im_end|>\n<|im_start|>user\nQ2?<|im_end|>\n<|im_start|>assistant\n"
    )
    # The cache then holds the whole conversation exactly as the template renders it.
    first = tok.apply_chat_template(
        [{"role": "user", "content": "Doc. Q1?"}], tokenize=False, add_generation_prompt=True
    )
    convo = [
        {"role": "user", "content": "Doc. Q1?"},
        {"role": "assistant", "content": " red"},
        {"role": "user", "content": "Q2?"},
    ]
    whole = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert first + " red" + next_turn_text(tok, [("Doc. Q1?", " red")], "Q2?") == whole
    # Turn 3 follows turn 2's answer.
    turn3 = next_turn_text(tok, [("Doc. Q1?", " red"), ("Q2?", "blue")], "Q3?")
    convo3 = convo + [{"role": "assistant", "content": "blue"}, {"role": "user", "content": "Q3?"}]
    assert whole + "blue" + turn3 == tok.apply_chat_template(
        convo3, tokenize=False, add_generation_prompt=True
    )


def test_next_turn_text_on_a_trimming_template_without_one_and_refused(tokenizer_with):
    tok = tokenizer_with(TRIMMING)
    assert next_turn_text(tok, [("Doc. Q1?", " red ")], "Q2?") == (
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nQ2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert next_turn_text(tokenizer_with(None), [("Doc. Q1?", "")], "Q2?") == "\n\nQ2?"
    assert next_turn_text(tokenizer_with(CHATML), [("Doc. Q1?", "")], "Q2?", chat_template=False) == "\n\nQ2?"
    with pytest.raises(ValueError, match="renders an earlier turn differently"):
        next_turn_text(tokenizer_with(FORGETFUL), [("Doc. Q1?", "")], "Q2?")
    with pytest.raises(ValueError, match="history"):
        next_turn_text(tok, [], "Q2?")


def record_feeds(monkeypatch) -> list[list[int]]:
    """The token ids of every question feed `protocols.answer` receives (it still answers)."""
    fed: list[list[int]] = []
    monkeypatch.setattr(
        protocols,
        "answer",
        lambda m, c, q, *a, **k: fed.append(q[0].tolist()) or REAL_ANSWER(m, c, q, *a, **k),
    )
    return fed


def test_later_questions_are_fed_as_the_next_user_turn(askmany, tiny_dir, monkeypatch):
    """first_question: after an empty assistant turn; multi_turn: after the answer. The template's
    increment, tokenized without special tokens."""
    model, tokenizer, _ = runner.get_model(RunSpec.from_config(cfg_for(tiny_dir, "unused", "query_aware")))
    (context, *_) = protocols.group_contexts(AskMany().samples(tokenizer))
    fed = record_feeds(monkeypatch)
    method = build_method("snapkv", budget=40, window=8, kernel_size=5)
    todo = {s.sample_id for s in context.samples}
    outcomes = list(
        protocols.ask_context("first_question", context, todo, model, tokenizer, method, chat_template=True)
    )
    assert [o.error for o in outcomes] == [None] * 3
    q2, q3 = (s.question for s in context.samples[1:])
    assert len(fed) == 2  # question 1 is answered from the prefill
    for feed, q in zip(fed, (q2, q3)):
        assert (
            tokenizer.decode(feed) == f"<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
        )

    # multi_turn: question 1's own part, then each turn after the model's answer (kept in the cache;
    # an answer cut by max_new_tokens first gets its last token, generated but never fed).
    fed.clear()
    outcomes = list(
        protocols.ask_context("multi_turn", context, todo, model, tokenizer, method, chat_template=True)
    )
    assert [o.error for o in outcomes] == [None] * 3
    q1 = context.samples[0]
    assert fed[0] == encode_prompt(tokenizer, q1.context, q1.question, True)[1]
    for feed, q in zip(fed[1:], (q2, q3)):
        assert tokenizer.decode(feed).endswith(
            f"<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
        )


def test_prerendered_questions_are_asked_as_template_turns_with_their_answer_prefix(
    askmany, tiny_dir, monkeypatch
):
    """A task that renders the chat template itself (RULER: `chat_template=False`, the question
    holding the turn markers and an answer prefix) gives `Sample.turn`: a later question is the
    template's next user turn with its own answer prefix, and the earlier prefix counts as assistant
    text already in the cache."""
    model, tokenizer, _ = runner.get_model(RunSpec.from_config(cfg_for(tiny_dir, "unused", "query_aware")))
    (context, *_) = protocols.group_contexts(AskMany().samples(tokenizer))
    prefix = " Answer:"
    rendered = []
    for s in context.samples:
        text = render_prompt(tokenizer, s.context + s.question)
        head = text[: text.index(s.question)]
        rendered.append(
            dataclasses.replace(
                s,
                context=head,
                question=text[len(head) :] + prefix,
                chat_template=False,
                turn=(s.question, prefix),
            )
        )
    context = dataclasses.replace(context, samples=rendered)
    fed = record_feeds(monkeypatch)
    method = build_method("snapkv", budget=40, window=8, kernel_size=5)
    todo = {s.sample_id for s in rendered}
    for protocol in ("first_question", "multi_turn"):
        fed.clear()
        outcomes = list(
            protocols.ask_context(protocol, context, todo, model, tokenizer, method, chat_template=False)
        )
        assert [o.error for o in outcomes] == [None] * 3
        later = fed if protocol == "first_question" else fed[1:]
        assert len(later) == 2
        for feed, s in zip(later, rendered[1:]):
            turn = f"<|im_end|>\n<|im_start|>user\n{s.turn[0]}<|im_end|>\n<|im_start|>assistant\n{prefix}"
            assert tokenizer.decode(feed).endswith(turn)
        if protocol == "first_question":  # after question 1's prefix: the empty turn closes at once
            assert tokenizer.decode(fed[0]).startswith("<|im_end|>")
