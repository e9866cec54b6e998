"""`Method.protect`: the end of a chat-templated prompt (the template's generation prompt, or the whole
question) is never evicted, at the end of prefill and while decoding, under every protocol; the
query-agnostic methods (K-norm, Expected Attention, KVzip) protect the generation prompt by
default, the others nothing (and keep their config hashes)."""

from __future__ import annotations

import pytest
import torch
from conftest import CHATML, byte_level_bpe, random_ids, tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig

from eval.tasks import haystack as hs
from snapkv import METHODS, build_method, generate, generate_ids
from snapkv.generation import answer, compress_context
from snapkv.prompts import encode_prompt, generation_prompt_length, generation_prompt_text, render_prompt

QUESTION = " What is the magic number mentioned above?"
GENERATION_PROMPT = "<|im_end|>\n<|im_start|>assistant\n"
QUERY_AGNOSTIC = ("knorm", "expected_attention", "adakv_expected_attention", "kvzip")


@pytest.fixture(scope="module")
def chat():
    """A byte-level BPE with a ChatML template and a random 2-layer Llama (GQA 4/2) over its vocabulary."""
    corpus = [hs.NOISE_TEXT] * 10 + [QUESTION, "The magic number is 7341.", GENERATION_PROMPT]
    tokenizer = byte_level_bpe(corpus, 400, ["<|im_start|>", "<|im_end|>"], chat_template=CHATML)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return model, tokenizer


def context_text() -> str:
    return hs.NOISE_TEXT * 12 + " The magic number is 7341. " + hs.NOISE_TEXT * 6


def prompt_parts(tokenizer) -> tuple[list[int], list[int], int]:
    """(context ids, question ids, generation prompt tokens) of the test prompt, templated."""
    head, tail = encode_prompt(tokenizer, context_text(), QUESTION, chat_template=True)
    return head, tail, generation_prompt_length(tokenizer, head + tail)


def kept_sets(cache) -> list[set[int]]:
    """The positions kept by each (layer, batch row, KV head)."""
    out = []
    for _, layer in cache.compressible_layers():
        positions = layer.head_positions() if layer.per_head else layer.positions
        out += [set(p.tolist()) - {-1} for row in positions for p in row]
    return out


def compressed_cache(model, tokenizer, method, **options):
    """The cache of a generation of the test prompt (after its last step) and the result."""
    held = {}
    result = generate(
        model, tokenizer, context=context_text(), question=QUESTION, method=method,
        on_compressed=lambda cache: held.update(cache=cache), **{"max_new_tokens": 4, **options},
    )  # fmt: skip
    return held["cache"], result


def test_generation_prompt_is_what_follows_the_users_content(chat):
    _, tokenizer = chat
    assert generation_prompt_text(tokenizer) == GENERATION_PROMPT
    assert generation_prompt_text(tokenizer, chat_template=False) == ""
    head, tail, n = prompt_parts(tokenizer)
    assert tokenizer.decode((head + tail)[-n:]) == GENERATION_PROMPT
    assert tokenizer.decode((head + tail)[-n - 1 :]) != GENERATION_PROMPT  # no more than that
    raw_head, raw_tail = encode_prompt(tokenizer, context_text(), QUESTION, chat_template=False)
    assert generation_prompt_length(tokenizer, raw_head + raw_tail) == 0  # no template rendered
    assert generation_prompt_length(tokenizer, head) == 0  # the context alone holds none
    # A task that renders the template and starts the assistant's turn with an answer prefix
    # (RULER): the prefix is protected with the generation prompt.
    prefix = tokenizer(" The magic number is", add_special_tokens=False)["input_ids"]
    assert generation_prompt_length(tokenizer, head + tail + prefix) == n + len(prefix)


def test_a_generation_prompt_merged_into_the_question_counts_the_merged_token():
    """A template whose generation prompt is plain text ("ers:") merges with a question ending in
    "Answ" into " Answers": the merged token is counted with the rest."""
    template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}ers:{% endif %}"
    )
    tokenizer = byte_level_bpe(["Answers: yes. Answers: no."] * 20, 300, ["<s>"], chat_template=template)
    ids = tokenizer(render_prompt(tokenizer, "Question. Answ"), add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode([i]) for i in ids[-2:]] == [" Answers", ":"]
    assert generation_prompt_length(tokenizer, ids) == 2


@pytest.mark.parametrize("name", QUERY_AGNOSTIC)
def test_query_agnostic_methods_keep_the_generation_prompt_by_default(chat, name):
    """Query-aware, with a budget of a tenth of the prompt: by default every (layer, head) keeps the
    generation prompt's entries; with `protect=none` (the methods' originals' scores alone) some
    head evicts one, so the default is what keeps them."""
    model, tokenizer = chat
    head, tail, n = prompt_parts(tokenizer)
    length = len(head) + len(tail)
    budget = length // 10
    gen = set(range(length - n, length))
    method = build_method(name, budget=budget)
    assert method.protect == "generation_prompt"
    cache, result = compressed_cache(model, tokenizer, method)
    assert result.compressed and n >= 4
    assert all(gen <= kept for kept in kept_sets(cache))
    bare, _ = compressed_cache(model, tokenizer, build_method(name, budget=budget, protect="none"))
    assert any(not gen <= kept for kept in kept_sets(bare))


@pytest.mark.parametrize("wrapper", ["adakv", "pyramidkv", "chunkkv", "criticalkv"])
def test_a_wrapper_around_a_query_agnostic_scorer_keeps_its_generation_prompt(chat, wrapper):
    """A wrapper takes its scorer's `protect` (K-norm's default: the generation prompt, as kvpress'
    AdaKVPress(KnormPress) never compresses it); `scorer_params.protect=none` turns it off."""
    model, tokenizer = chat
    head, tail, n = prompt_parts(tokenizer)
    length = len(head) + len(tail)
    budget = length // 10
    gen = set(range(length - n, length))
    # PyramidKV's last layer keeps the least: a gentle pyramid leaves it room for the 5 protected.
    extra = {"chunkkv": {"chunk_length": 2}, "pyramidkv": {"beta": 2}}.get(wrapper, {})
    method = build_method(wrapper, budget=budget, scorer="knorm", **extra)
    cache, result = compressed_cache(model, tokenizer, method)
    assert result.compressed
    assert all(gen <= kept for kept in kept_sets(cache))
    bare = build_method(wrapper, budget=budget, scorer="knorm", scorer_params={"protect": "none"}, **extra)
    cache, _ = compressed_cache(model, tokenizer, bare)
    assert any(not gen <= kept for kept in kept_sets(cache))


def test_a_prompt_its_task_rendered_keeps_its_generation_prompt_and_answer_prefix(chat):
    """RULER renders the template itself and appends the answer prefix (`chat_template=False` for
    the generator): K-norm's default keeps both."""
    model, tokenizer = chat
    rendered = render_prompt(tokenizer, context_text() + QUESTION)
    split = rendered.index(QUESTION)
    context, question = rendered[:split], rendered[split:] + " The magic number is"
    head, tail = encode_prompt(tokenizer, context, question, chat_template=False)
    length, n = len(head) + len(tail), generation_prompt_length(tokenizer, head + tail)
    prefix = len(tokenizer(" The magic number is", add_special_tokens=False)["input_ids"])
    assert n == len(tokenizer(GENERATION_PROMPT, add_special_tokens=False)["input_ids"]) + prefix
    end = set(range(length - n, length))

    def kept(**params):
        held = {}
        generate(
            model, tokenizer, context=context, question=question, method=build_method("knorm", **params),
            chat_template=False, max_new_tokens=1, on_compressed=lambda cache: held.update(cache=cache),
        )  # fmt: skip
        return kept_sets(held["cache"])

    assert all(end <= k for k in kept(budget=40))
    assert any(not end <= k for k in kept(budget=40, protect="none"))


def test_protect_question_keeps_the_whole_question_part(chat):
    model, tokenizer = chat
    head, tail, _ = prompt_parts(tokenizer)
    length = len(head) + len(tail)
    method = build_method("knorm", budget=len(tail) + 8, protect="question")
    cache, _ = compressed_cache(model, tokenizer, method, max_new_tokens=1)  # nothing fed after
    question = set(range(len(head), length))
    assert all(question <= kept and len(kept) == len(tail) + 8 for kept in kept_sets(cache))


def test_protected_entries_beyond_the_budget_are_refused(chat):
    model, tokenizer = chat
    _, tail, _ = prompt_parts(tokenizer)
    method = build_method("knorm", budget=len(tail) - 1, protect="question")
    with pytest.raises(ValueError, match=rf"protects {len(tail)} entries.*got budget={len(tail) - 1}"):
        compressed_cache(model, tokenizer, method)


@pytest.mark.parametrize("query_aware", [True, False])
def test_decode_time_eviction_keeps_the_generation_prompt(chat, query_aware):
    """K-norm evicting after every decoding step, fed the question before (query-aware) or after
    (context-only) compression: after the last step the generation prompt is still in every head."""
    model, tokenizer = chat
    head, tail, n = prompt_parts(tokenizer)
    length = len(head) + len(tail)
    method = build_method("knorm", budget=40, evict_during_decode=True)
    cache, result = compressed_cache(model, tokenizer, method, query_aware=query_aware, ignore_eos=True)
    assert result.decode_evicted > 0
    assert all(set(range(length - n, length)) <= kept for kept in kept_sets(cache))
    bare, _ = compressed_cache(
        model, tokenizer, build_method("knorm", budget=40, evict_during_decode=True, protect="none"),
        query_aware=query_aware, ignore_eos=True,
    )  # fmt: skip
    assert any(not set(range(length - n, length)) <= kept for kept in kept_sets(bare))


def test_answer_protects_the_question_while_decoding_and_the_rollback_clears_it(chat):
    model, tokenizer = chat
    head, tail, n = prompt_parts(tokenizer)
    method = build_method("knorm", budget=40, evict_during_decode=True, protect="question")
    cache = compress_context(model, torch.tensor([head]), method)
    spans = []
    real_step = method.compress_decode

    def step(layer, query, module):
        spans.append(layer.protected_span)
        return real_step(layer, query, module)

    method.compress_decode = step
    answer(model, cache, torch.tensor([tail]), method, max_new_tokens=3, generation_prompt=n)
    assert set(spans) == {(len(head), len(head) + len(tail))}
    assert all(layer.protected_span is None for _, layer in cache.compressible_layers())


def test_hashes_move_only_where_the_default_protects():
    """`protect` is left out of `params()` at "none": a method protecting nothing by default hashes
    as before the switch; K-norm / Expected Attention / KVzip name their default."""
    for name, cls in METHODS.items():
        method = cls() if name == "full" else cls(budget=64)
        assert ("protect" in method.params()) == (name in QUERY_AGNOSTIC), name
        assert (
            "protect"
            not in (cls(protect="none") if name == "full" else cls(budget=64, protect="none")).params()
        )


def test_per_step_eviction_needs_room_beside_the_protected_entries(chat):
    """H2O keeps its `recent` tokens and the protected question beside them while decoding: a
    budget without room for one more is refused before the prompt is fed."""
    model, tokenizer = chat
    _, tail, _ = prompt_parts(tokenizer)
    method = build_method("h2o", budget=len(tail) + 7, recent=8, protect="question")
    with pytest.raises(ValueError, match=rf"h2o protects {len(tail) + 8} entries while decoding"):
        compressed_cache(model, tokenizer, method)
    compressed_cache(
        model, tokenizer, build_method("h2o", budget=len(tail) + 8, recent=8, protect="question")
    )


def test_streamingllm_refuses_protection():
    with pytest.raises(ValueError, match="streamingllm keeps exactly .* got protect='question'"):
        build_method("streamingllm", budget=64, protect="question")


# Every scoring method with `protect=question` on a question longer than its window (16 > 8): the
# question's entries are in every (layer, batch row, KV head) right after compression.
QUESTION_PROTECTED = [
    ("snapkv", dict(window=8, kernel_size=5)),
    ("pyramidkv", dict(window=8, kernel_size=5, budget=64)),  # its top layer's budget holds the 16
    ("adakv", dict(window=8)),
    ("adakv", dict(window=8, normalize=True)),
    ("adakv", dict(window=8, normalize="sum", allocation="exact")),
    ("adakv", dict(window=8, allocation="kvpress")),
    ("criticalkv", dict(window=8)),
    ("criticalkv", dict(window=8, base="adakv")),
    ("chunkkv", dict(window=8, chunk_length=5)),
    ("h2o", dict(recent=8)),
    ("tova", dict()),
    ("knorm", dict()),
    ("expected_attention", dict()),
    ("adakv_expected_attention", dict()),
    ("kvzip", dict(repeat_chunk=32)),
    ("kvzip", dict(repeat_chunk=32, selection="head")),
    ("snapkv_d", dict(window=8)),
    ("rkv", dict(window=8)),
]


@pytest.mark.parametrize("name,params", QUESTION_PROTECTED, ids=[f"{n}-{p}" for n, p in QUESTION_PROTECTED])
def test_every_method_keeps_the_question_ids_it_protects(name, params):
    model = tiny_model("llama")
    ids = random_ids(96, batch=2)
    ctx, q = ids[:, :80], ids[:, 80:]
    question = set(range(80, 96))

    def kept(protect: str) -> list[set[int]]:
        held = {}
        method = build_method(name, protect=protect, **{"budget": 40, **params})
        generate_ids(
            model, ctx, q, method, max_new_tokens=1, on_compressed=lambda cache: held.update(cache=cache)
        )
        return kept_sets(held["cache"])

    assert all(question <= k for k in kept("question"))
    assert any(not question <= k for k in kept("none"))  # the method's own scores evict some


@pytest.mark.parametrize("name", ["knorm", "adakv", "kvzip"])
def test_a_question_longer_than_the_budget_is_refused_on_every_layout(name):
    """Uniform (K-norm) and per-head (Ada-KV, KVzip) storage: a protected span longer than the
    budget is a ValueError naming both, not a silent eviction of part of it."""
    model = tiny_model("llama")
    ids = random_ids(96)
    params = {"window": 8} if name == "adakv" else {}
    method = build_method(name, budget=12, protect="question", **params)
    with pytest.raises(ValueError, match=r"protects 16 entries .*got budget=12"):
        generate_ids(model, ids[:, :80], ids[:, 80:], method, max_new_tokens=1)
