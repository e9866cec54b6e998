"""What an engine adapter provides: a validated config (before anything loads), its identity (in
every row and in the config hash), a loaded model, and one greedy generation from token ids.

The harness keeps everything else: the task renders the prompt and scores the answer, and
`generate_text` below feeds the engine the very token ids the transformers path feeds the model
(`snapkv.prompts.encode_prompt`: the chat template applied as the run applies it), stops on the
same tokens (`snapkv.prompts.stop_token_ids`) and decodes the answer the same way (the stop token
dropped, special tokens skipped, stripped), so the two paths differ only in the model's forward and
its KV cache.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, ClassVar

from snapkv.methods import Method
from snapkv.prompts import encode_prompt, stop_token_ids


@dataclass
class EngineOutput:
    """One generation: the new token ids (the stop token included when it stopped at one), the
    generic row fields it measured (`ttft_s`, `tpot_s`, `e2e_s`, ...) and the engine's own columns."""

    ids: list[int]
    stop_reason: str  # eos | length
    fields: dict[str, Any] = field(default_factory=dict)


class Engine(ABC):
    """An inference engine beside the transformers path (`engine=<name>`, conf/engine/).

    A subclass is a dataclass of its options (conf/engine/<name>.yaml, every key a field) and
    implements: `check_model(name)` and `configure(method, chunk_size)` (map the run's method and
    prefill chunking onto the engine's own settings; ValueError naming what it cannot express,
    before anything loads), `identity()` (what a row's output depends on: engine, version, KV block
    size, KV precision, eviction; hashed), `load(model_name)` (the row's `attn_impl` and `device`)
    and `generate(ids, max_new_tokens, stop_ids)`. The harness' tokenizer of the same model renders
    the prompts (`eval.runner.load_tokenizer`).
    """

    name: ClassVar[str] = ""
    # How to install what the engine needs (the error line of a run without it).
    install: ClassVar[str] = ""

    @abstractmethod
    def check_model(self, name: str) -> None: ...

    @abstractmethod
    def configure(self, method: Method, chunk_size: int | None = None) -> None: ...

    @abstractmethod
    def identity(self) -> dict[str, Any]: ...

    @abstractmethod
    def load(self, model_name: str) -> dict[str, Any]: ...

    @abstractmethod
    def generate(self, ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> EngineOutput: ...

    def warm_up(self, vocab_size: int, tokens: int = 256) -> float:
        """One untimed generation of `tokens` fixed ids and 2 new tokens (see eval.runner.warm_up);
        its seconds."""
        ids = [(7919 * i) % vocab_size for i in range(1, tokens + 1)]
        t = time.perf_counter()
        self.generate(ids, 2, set())
        return round(time.perf_counter() - t, 3)


def stop_ids_of(tokenizer: Any) -> set[int]:
    """The stop tokens the transformers path uses, from the tokenizer alone (the engine's model has
    no transformers config; a GGUF's EOS is its tokenizer's)."""
    return stop_token_ids(SimpleNamespace(config=None), tokenizer)


def generate_text(
    engine: Engine,
    tokenizer: Any,
    context: str,
    question: str,
    chat_template: bool,
    max_new_tokens: int,
) -> tuple[str, EngineOutput]:
    """The answer to context + question through `engine`: the transformers path's prompt ids, stop
    tokens and decoding (module doc). Returns (text, the engine's output)."""
    head, tail = encode_prompt(tokenizer, context, question, chat_template)
    stops = stop_ids_of(tokenizer)
    out = engine.generate(head + tail, max_new_tokens, stops)
    ids = out.ids[:-1] if out.ids and out.ids[-1] in stops else out.ids
    out.fields.setdefault("input_tokens", len(head) + len(tail))
    return tokenizer.decode(ids, skip_special_tokens=True).strip(), out
