"""Protocols: when the question enters the cache, and how many questions one compressed cache serves.

SnapKV (https://arxiv.org/abs/2404.14469) selects the KV entries the last `window` prompt tokens
attend to, and its prompts end with the question, so the question picks what is kept. A cache that
is compressed once and then asked questions it never saw measures how much of that is luck. The
run-level config key `protocol` (conf/config.yaml) chooses:

- `query_aware` (default; the paper, LongBench): context + question prefilled and compressed
  together, one fresh cache per question.
- `context_only`: the context prefilled and compressed alone, then the question fed; one fresh
  cache per question (kvpress' default; `query_aware: false` is the older spelling).
- `first_question`: per context, context + question 1 prefilled and compressed together (question 1
  is answered exactly as `query_aware` answers it), the cache checkpointed right after compression;
  each later question is rolled back to that checkpoint and fed as the next user turn after an empty
  assistant turn (`snapkv.prompts.next_turn_text`), answered, and rolled back again.
- `multi_request`: per context, the context compressed once (`compress_context`); each question fed,
  answered and rolled back (`answer`): the same forwards as `context_only`, with one prefill.
- `multi_turn`: per context, the context compressed once; question 1 fed and answered; each later
  question fed as the next user turn after the model's actual previous answer, which stays in the
  cache (no rollback: SCBench's multi-turn, https://arxiv.org/abs/2412.10319).

The last three (`SHARED`) need a task that asks several questions per context
(`Task.multi_question()`; samples sharing `Sample.context_id`, numbered by `question_index`).

Config hashes: `query_aware` and `context_only` hash as they did before the protocol key existed
(only `query_aware` true/false), so their results files resume; the shared protocols add
`protocol` to the hash. Old rows without `protocol` read as `query_aware` (query_aware true) or
`context_only` (false): `row_protocol`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from eval.tasks import Sample
from snapkv.cache import CompressedCache
from snapkv.forward import PeakMemory, clock
from snapkv.generation import answer, cache_sizes, compress_context, generate
from snapkv.kv_quant import KVQuant
from snapkv.methods import Method, post_init_from_tokenizer
from snapkv.prompts import (
    chat_templated,
    encode_prompt,
    generation_prompt_length,
    next_turn_text,
    stop_token_ids,
)

PROTOCOLS: tuple[str, ...] = ("query_aware", "context_only", "first_question", "multi_request", "multi_turn")
# Protocols that compress a context once and ask all of its questions on that cache.
SHARED: tuple[str, ...] = ("first_question", "multi_request", "multi_turn")
DEFAULT = "query_aware"
# Protocols whose compression sees a question (the rows' `query_aware`).
QUESTION_IN_WINDOW = ("query_aware", "first_question")


def resolve(protocol: Any, query_aware: Any) -> tuple[str, bool]:
    """`(protocol, query_aware)` of a run from the config's `protocol` and `query_aware` keys.

    `query_aware: false` with the default protocol means `context_only` (the older spelling);
    with a protocol that compresses without a question it is redundant; with `first_question`
    it contradicts it. ValueError naming the bad value.
    """
    if protocol is None:
        protocol = DEFAULT
    if not isinstance(protocol, str) or protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got protocol={protocol!r}")
    if not isinstance(query_aware, bool):
        raise ValueError(f"query_aware must be true or false, got query_aware={query_aware!r}")
    if not query_aware:
        if protocol == "query_aware":
            protocol = "context_only"
        elif protocol == "first_question":
            raise ValueError(
                "query_aware=false contradicts protocol=first_question (question 1 is compressed with "
                "the context); drop query_aware=false or choose protocol=multi_request"
            )
    return protocol, protocol in QUESTION_IN_WINDOW


def hash_fields(protocol: str) -> dict[str, str]:
    """What `protocol` adds to a run's config hash: nothing for the two per-question protocols
    (their files predate the key; `query_aware` tells them apart), itself for the shared ones."""
    return {"protocol": protocol} if protocol in SHARED else {}


def row_protocol(protocol: Any, query_aware: Any) -> str:
    """The protocol of a stored row: its `protocol`, else (rows written before the key) `query_aware`
    for query_aware true or missing, `context_only` for false."""
    if isinstance(protocol, str) and protocol in PROTOCOLS:
        return protocol
    if query_aware is False or (isinstance(query_aware, (int, float)) and not isinstance(query_aware, bool)
                                and query_aware == 0):  # fmt: skip
        return "context_only"
    return "query_aware"


def label_suffix(protocol: str) -> str:
    """What a config label gets for its protocol: nothing for `query_aware`, the report's
    long-standing ` q-agnostic` for `context_only`, ` (<protocol>)` for the shared ones."""
    if protocol == "query_aware":
        return ""
    if protocol == "context_only":
        return " q-agnostic"  # eval.report.QUERY_AGNOSTIC_SUFFIX, as committed reports spell it
    return f" ({protocol})"


# ------------------------------------------------------------------------------------------- contexts
def context_key(sample: Sample) -> str:
    """The sample's context: its `context_id`, else its own `sample_id` (a single-question sample)."""
    return sample.context_id if sample.context_id is not None else sample.sample_id


@dataclass
class Context:
    """The samples of one context, in the order they are asked (`question_index`)."""

    key: str
    samples: list[Sample]


def group_contexts(samples: Iterable[Sample]) -> list[Context]:
    """Samples grouped by context (contexts in order of first appearance, questions by
    `question_index`). ValueError when samples of one context differ in `context` text or repeat a
    `question_index` (a task bug: the shared protocols compress one text per context)."""
    groups: dict[str, list[Sample]] = {}
    for s in samples:
        groups.setdefault(context_key(s), []).append(s)
    out = []
    for key, group in groups.items():
        group.sort(key=lambda s: s.question_index)
        indices = [s.question_index for s in group]
        if len(set(indices)) != len(indices):
            raise ValueError(f"context {key!r} repeats a question_index: {indices}")
        if any(s.context != group[0].context for s in group):
            raise ValueError(f"samples of context {key!r} differ in their context text")
        out.append(Context(key, group))
    return out


def shard_contexts(contexts: list[Context], shard: int, num_shards: int) -> list[Context]:
    """Context i (in order) goes to shard `i % num_shards`: a context's questions stay together."""
    return [c for i, c in enumerate(contexts) if i % num_shards == shard]


def context_sizes(samples: Iterable[Sample]) -> dict[str, int]:
    """Questions per context key."""
    sizes: dict[str, int] = {}
    for s in samples:
        sizes[context_key(s)] = sizes.get(context_key(s), 0) + 1
    return sizes


def question_fields(sample: Sample, questions_in_context: int) -> dict[str, Any]:
    """The row columns that place a question in its context."""
    return {
        "context_id": sample.context_id,
        "question_index": sample.question_index,
        "questions_in_context": questions_in_context,
    }


# ------------------------------------------------------------------------------------------ answering
@dataclass
class Outcome:
    """One question of a shared context: its prediction and row columns, or the error it met."""

    sample: Sample
    text: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None


def _text(tokenizer: Any, ids: list[int], stops: set[int]) -> str:
    """The prediction as `generate` decodes it: the final stop token dropped, special tokens skipped."""
    if ids and ids[-1] in stops:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


class _Shared:
    """One context's compressed cache and the questions asked on it."""

    def __init__(
        self, protocol, context, todo, model, tokenizer, method, chat_template, chunk_size, kv_quant
    ):
        self.protocol, self.samples, self.todo = protocol, context.samples, todo
        self.kv_quant = kv_quant
        self.model, self.tokenizer, self.method = model, tokenizer, method
        self.chat_template, self.chunk_size = chat_template, chunk_size
        self.device = model.device
        self.stops = stop_token_ids(model, tokenizer)
        self.shared: dict[str, Any] = {"questions_in_context": len(self.samples)}
        self.peak = 0

    def wanted(self, s: Sample) -> bool:
        return s.sample_id in self.todo

    def fail(self, samples: Iterable[Sample], err: BaseException) -> Iterator[Outcome]:
        for s in samples:
            if self.wanted(s):
                yield Outcome(s, fields=dict(self.shared), error=err)

    def compress(self, ids: list[int]) -> CompressedCache:
        post_init_from_tokenizer(
            self.method, self.tokenizer, chat_templated(self.tokenizer, self.chat_template)
        )
        with PeakMemory(self.device) as mem:
            t0 = clock(self.device)
            cache = compress_context(
                self.model,
                torch.tensor([ids]),
                self.method,
                chunk_size=self.chunk_size,
                kv_quant=self.kv_quant,
            )
            seconds = clock(self.device) - t0
        self.peak = int(mem.peak)
        self.shared.update(
            cache_sizes(cache), context_prefill_s=seconds, prefill_s=seconds, scoring_s=cache.scoring_s
        )
        return cache

    def ask(self, cache: CompressedCache, s: Sample, ids: list[int], rollback: bool):
        """`answer` with the question's memory peak; returns (Answer, its row columns)."""
        if not ids:
            raise ValueError(f"sample {s.sample_id!r}: the question has 0 tokens")
        with PeakMemory(self.device) as mem:
            a = answer(
                self.model, cache, torch.tensor([ids]), self.method,
                max_new_tokens=s.max_new_tokens, stop_ids=self.stops, rollback=rollback,
                generation_prompt=generation_prompt_length(self.tokenizer, ids),
            )  # fmt: skip
        fields = {
            **self.shared,
            "ttft_s": a.ttft_s,
            "tpot_s": a.tpot_s,
            "new_tokens": a.ids.shape[1],
            "stop_reason": a.stop_reason,
            "rollback_bytes": a.rollback_bytes if rollback else None,
            "peak_mem_bytes": max(self.peak, int(mem.peak)),
        }
        return a, fields

    def turn_ids(self, history: list[tuple[str, str]], s: Sample) -> list[int]:
        """Sample `s`'s question as the next user turn after `history` (see `Sample.turn`)."""
        if s.turn is None:
            text = next_turn_text(self.tokenizer, history, s.question, self.chat_template)
        else:
            user, prefix = s.turn
            text = next_turn_text(self.tokenizer, history, user, chat_template=True) + prefix
        return self.tokenizer(text, add_special_tokens=False).input_ids

    @staticmethod
    def in_cache(s: Sample, reply: str) -> str:
        """The assistant text the cache holds after `s`'s generation prompt: its answer prefix (a
        task that renders its own template puts it there) and `reply`."""
        return (s.turn[1] if s.turn is not None else "") + reply

    # ---- the protocols
    def multi_request(self) -> Iterator[Outcome]:
        first = self.samples[0]
        try:
            head, _ = encode_prompt(self.tokenizer, first.context, first.question, self.chat_template)
            cache = self.compress(head)
        except Exception as err:  # noqa: BLE001 - every question of the context records it
            yield from self.fail(self.samples, err)
            return
        for s in self.samples:
            if not self.wanted(s):
                continue
            try:
                h, tail = encode_prompt(self.tokenizer, s.context, s.question, self.chat_template)
                if h != head:
                    raise ValueError(
                        f"sample {s.sample_id!r}: the prompt's context part differs from question 1's"
                    )
                a, fields = self.ask(cache, s, tail, rollback=True)
                fields["input_tokens"] = len(head) + len(tail)
                yield Outcome(s, _text(self.tokenizer, a.ids[0].tolist(), self.stops), fields)
            except Exception as err:  # noqa: BLE001 - the rollback restored the cache: go on
                yield Outcome(s, fields=dict(self.shared), error=err)

    def multi_turn(self) -> Iterator[Outcome]:
        first = self.samples[0]
        try:
            head, tail = encode_prompt(self.tokenizer, first.context, first.question, self.chat_template)
            cache = self.compress(head)
        except Exception as err:  # noqa: BLE001
            yield from self.fail(self.samples, err)
            return
        history: list[tuple[str, str]] = []
        pending: list[int] = []  # the previous answer's last token: generated, never fed
        fed = len(head)
        for i, s in enumerate(self.samples):
            try:
                ids = tail if i == 0 else pending + self.turn_ids(history, s)
                fed += len(ids)
                a, fields = self.ask(cache, s, ids, rollback=False)
                out = a.ids[0].tolist()
                kept = cache.kept_tokens()
                fields.update(input_tokens=fed, kv_tokens_end=sum(kept) / len(kept) if kept else 0.0)
                fed += len(out) - 1  # every answer token but the last went through the model
                stopped = a.stop_reason == "eos"
                pending = [] if stopped else out[-1:]
                reply = self.tokenizer.decode(out[:-1] if stopped else out, skip_special_tokens=True)
                user = s.context + s.question if i == 0 else (s.turn[0] if s.turn else s.question)
                history.append((user, self.in_cache(s, reply)))
            except Exception as err:  # noqa: BLE001 - later turns build on this one: they fail too
                yield from self.fail(self.samples[i : i + 1], err)
                later = ValueError(f"an earlier turn ({s.sample_id}) failed: {type(err).__name__}: {err}")
                yield from self.fail(self.samples[i + 1 :], later)
                return
            if self.wanted(s):
                yield Outcome(s, _text(self.tokenizer, out, self.stops), fields)

    def first_question(self) -> Iterator[Outcome]:
        first = self.samples[0]
        held: dict[str, Any] = {}

        def keep(cache: CompressedCache) -> None:
            held["cache"], held["mark"] = cache, cache.checkpoint()

        result, q1_error = None, None
        try:
            head, tail = encode_prompt(self.tokenizer, first.context, first.question, self.chat_template)
            result = generate(
                self.model, self.tokenizer, context=first.context, question=first.question,
                method=self.method, query_aware=True, chat_template=self.chat_template,
                # A done question 1 is prefilled for its cache only.
                max_new_tokens=first.max_new_tokens if self.wanted(first) else 1,
                chunk_size=self.chunk_size, on_compressed=keep, kv_quant=self.kv_quant,
            )  # fmt: skip
        except Exception as err:  # noqa: BLE001
            if "mark" not in held:  # no compressed cache: nothing to ask
                yield from self.fail(self.samples, err)
                return
            q1_error = err
        try:
            cache = held["cache"]
            rolled_back = cache.rollback(held["mark"])
            self.shared.update(
                cache_sizes(cache),
                context_prefill_s=result.prefill_s if result is not None else None,
                prefill_s=result.prefill_s if result is not None else None,
            )
            self.peak = result.peak_mem_bytes if result is not None else 0
        except Exception as err:  # noqa: BLE001
            yield from self.fail(self.samples, q1_error or err)
            return
        if self.wanted(first):
            if q1_error is not None:
                yield Outcome(first, fields=dict(self.shared), error=q1_error)
            else:
                measured = result.measurements()
                fields = {**measured, **self.shared, "rollback_bytes": rolled_back}
                fields["peak_mem_bytes"] = result.peak_mem_bytes
                yield Outcome(first, result.text, fields)
        # an empty assistant turn after question 1 (its answer prefix, where the task has one)
        history = [(first.context + first.question, self.in_cache(first, ""))]
        for s in self.samples[1:]:
            if not self.wanted(s):
                continue
            try:
                ids = self.turn_ids(history, s)
                a, fields = self.ask(cache, s, ids, rollback=True)
                fields["input_tokens"] = len(head) + len(tail) + len(ids)
                yield Outcome(s, _text(self.tokenizer, a.ids[0].tolist(), self.stops), fields)
            except Exception as err:  # noqa: BLE001 - the rollback restored the cache: go on
                yield Outcome(s, fields=dict(self.shared), error=err)


def ask_context(
    protocol: str,
    context: Context,
    todo: set[str],
    model: Any,
    tokenizer: Any,
    method: Method,
    *,
    chat_template: bool,
    chunk_size: int | None = None,
    kv_quant: KVQuant | None = None,
) -> Iterator[Outcome]:
    """Run one context's questions under a shared `protocol` on one compressed cache; yield an
    `Outcome` for each question whose sample_id is in `todo`, in question order, as soon as it is
    answered. Never raises for a question: a failure is that question's outcome (and, for
    `multi_turn`, every later turn's; a failed compression: every question's).

    Resume: `multi_request` / `first_question` answer only the questions in `todo` (each answer is
    independent after the rollback; `first_question` prefills question 1 with the context even when
    it is done, decoding one token); `multi_turn` replays every turn (greedy, deterministic) and
    yields only those in `todo`.

    Outcome fields: `questions_in_context`, `context_prefill_s` (= `prefill_s`: the shared prefill +
    compression, on every question's row), the cache's size after compression (`kv_tokens`,
    `kv_bytes`, ...), the question's own `ttft_s` (from its feed; on `first_question`'s question 1
    the query-aware one, prefill included), `tpot_s`, `new_tokens`, `stop_reason`, `input_tokens`
    (tokens in the cache before the first answer token: the context plus this question's feed, and
    for `multi_turn` every earlier turn), `rollback_bytes` (null for `multi_turn`) and
    `peak_mem_bytes` (the compression's peak or this question's, the larger). `kv_quant`: how the
    compressed cache stores its entries (`snapkv.kv_quant.KVQuant`; None: the model's dtype).
    """
    if protocol not in SHARED:
        raise ValueError(
            f"ask_context runs the shared protocols {', '.join(SHARED)}, got protocol={protocol!r}"
        )
    run = _Shared(protocol, context, todo, model, tokenizer, method, chat_template, chunk_size, kv_quant)
    return getattr(run, protocol)()
