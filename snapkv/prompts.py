"""The text a model sees and the tokens it is fed: a prompt through the tokenizer's chat template
(`render_prompt`, `prompt_token_ids`), split into context and question ids (`encode_prompt`), the
template's generation prompt at the prompt's end (`generation_prompt_length`), the next turn of a
conversation the cache already holds (`next_turn_text`), and the stop tokens (`stop_token_ids`:
the model's EOS and the chat end-of-turn tokens its tokenizer knows)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Chat end-of-turn tokens of common instruct models; used as stop tokens when in the vocabulary.
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


def stop_token_ids(model, tokenizer) -> set[int]:
    """The model's EOS id(s) and the chat end-of-turn tokens its tokenizer knows."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list | tuple):
            ids.update(int(e) for e in eos)
    vocab = tokenizer.get_vocab()
    ids.update(vocab[t] for t in CHAT_END_TOKENS if t in vocab)
    return ids


def chat_templated(tokenizer, chat_template: bool) -> bool:
    """Whether a prompt goes through the chat template: asked for, and the tokenizer has one."""
    return bool(chat_template and getattr(tokenizer, "chat_template", None))


def render_prompt(
    tokenizer, content: str, chat_template: bool = True, history: Iterable[tuple[str, str]] = ()
) -> str:
    """The text the model sees: `content` as the last user turn of the tokenizer's chat template,
    after the `history` (user, assistant) exchanges, with the generation prompt, when
    `chat_templated(tokenizer, chat_template)`; else `content` itself (`history` then unused: raw
    text has no turns)."""
    if not chat_templated(tokenizer, chat_template):
        return content
    messages = []
    for user, assistant in history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    messages.append({"role": "user", "content": content})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_token_ids(tokenizer, content: str, chat_template: bool = True) -> list[int]:
    """Token ids of `render_prompt(tokenizer, content, chat_template)`: a templated text already
    carries its special tokens, so only a raw prompt gets the tokenizer's own (e.g. BOS)."""
    text = render_prompt(tokenizer, content, chat_template)
    templated = chat_templated(tokenizer, chat_template)
    return tokenizer(text, add_special_tokens=not templated, verbose=False)["input_ids"]


def encode_prompt(tokenizer, context: str, question: str, chat_template: bool) -> tuple[list[int], list[int]]:
    """Token ids of (context part, question part) of the prompt, chat template applied if asked.

    The template wraps `context + question` as one user turn (`render_prompt`); the rendered text is
    split where the context ends, so the question part carries the template's end-of-turn and
    assistant header.
    """
    text = context + question
    if chat_templated(tokenizer, chat_template):
        rendered = render_prompt(tokenizer, text)
        start = rendered.find(text)
        if start < 0:  # templates that trim the content
            start = rendered.find(text.strip())
            context = context.lstrip()
        if start < 0:
            raise ValueError("the chat template changed the prompt text; cannot split context/question")
        split = start + len(context)
        head, tail = rendered[:split], rendered[split:]
        ids_head = tokenizer(head, add_special_tokens=False).input_ids
        ids_tail = tokenizer(tail, add_special_tokens=False).input_ids
    else:
        ids_head = tokenizer(context).input_ids  # the tokenizer's own BOS handling
        ids_tail = tokenizer(question, add_special_tokens=False).input_ids if question else []
    return ids_head, ids_tail


def generation_prompt_text(tokenizer, chat_template: bool = True) -> str:
    """What the chat template renders after a user turn's content when asked for the generation
    prompt: the end of the turn and the assistant header (ChatML: `<|im_end|>\n<|im_start|>assistant\n`),
    "" when the prompt does not go through a template (`chat_templated`)."""
    if not chat_templated(tokenizer, chat_template):
        return ""
    content = "generation prompt probe"
    rendered = render_prompt(tokenizer, content)
    at = rendered.rfind(content)
    if at < 0:
        raise ValueError("the chat template changed the prompt text; cannot find its generation prompt")
    return rendered[at + len(content) :]


def generation_prompt_length(tokenizer, ids: Sequence[int]) -> int:
    """How many of the last tokens of `ids` (a prompt, or a later turn's feed) are the tokenizer's
    chat template's generation prompt (`generation_prompt_text`) and what follows it: its own
    tokens where `ids` end with them; else (a tokenizer that merges the question's last characters
    into the template's first token) the fewest last tokens whose text ends with it, the merged
    token included; else the tokens from its last occurrence on (a task that renders the template
    itself and starts the assistant's turn with an answer prefix, RULER: the prefix is protected
    with it). 0 for a tokenizer without a chat template, or `ids` without the generation prompt (a
    raw prompt)."""
    text = generation_prompt_text(tokenizer)
    if not text or not ids:
        return 0
    ids = list(ids)
    own = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    m = len(own)
    if not m:
        return 0
    if ids[-m:] == own:
        return m
    for k in range(1, min(len(ids), m + 2) + 1):
        if tokenizer.decode(ids[-k:]).endswith(text):
            return k
    for start in range(len(ids) - m, -1, -1):
        if ids[start] == own[0] and ids[start : start + m] == own:
            return len(ids) - start
    return 0


def next_turn_text(
    tokenizer, history: Sequence[tuple[str, str]], question: str, chat_template: bool = True
) -> str:
    """The text that asks `question` as the next user turn of a conversation the cache already holds.

    `history`: the (user, assistant) exchanges so far, the last assistant text being what follows the
    last generation prompt in the cache (the model's answer, or "" for an empty turn). The cache
    holds the template's rendering of every exchange but the last, the last user turn with the
    generation prompt, then that assistant text; this returns what the template renders beyond it
    for the conversation continued by `question` (with the generation prompt): the assistant's
    end-of-turn, the user turn, the next assistant header. E.g. ChatML with history
    [(context + q1, "")] and q2: `<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n`.

    Without a chat template (not asked for, or the tokenizer has none): `"\n\n" + question`.
    ValueError for an empty history, or a template whose rendering of the conversation does not
    extend what it rendered for the turns so far (it rewrites earlier turns).
    """
    if not history:
        raise ValueError("next_turn_text needs at least one earlier exchange, got history=[]")
    if not (chat_template and getattr(tokenizer, "chat_template", None)):
        return "\n\n" + question
    messages = []
    for user, assistant in history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    before = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    after = tokenizer.apply_chat_template(
        messages + [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    if not after.startswith(before):
        raise ValueError(
            "the chat template renders an earlier turn differently once the conversation goes on; "
            f"cannot append the next turn (rendered so far: {before[-80:]!r})"
        )
    rest, reply = after[len(before) :], history[-1][1]
    for text in (reply, reply.strip()):  # templates that trim the assistant's content
        if rest.startswith(text):
            return rest[len(text) :]
    raise ValueError(
        f"the chat template changed the assistant's text {reply[:80]!r}; cannot append the next turn"
    )
