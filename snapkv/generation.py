"""Generation with KV-cache compression, timing and memory probes: greedy, or sampled with a seed.
The pieces it composes live beside it: the prompt's text and tokens (`snapkv.prompts`), the token
picker (`snapkv.sampling`), the forward step, prefill, clock and peak memory (`snapkv.forward`).

`generate()` is the one call the harness makes per sample. Every entry point is a composition of
two steps sharing one `GenerationConfig`: `compress()` prefills the prompt through the model's own
attention (sdpa / flash / eager) with `logits_to_keep=1` (never full-sequence logits), optionally
in chunks with explicit positions, each compressible layer compressed right after its attention in
the last prefill chunk, and returns the cache with the prefill's measurements (`Compressed`);
`decode()` feeds the question where it was left out of the prefill, then decodes token by token
with explicit `position_ids` (`Decoded`: the tokens and the decode's measurements). `generate_ids`
runs both in one session (the method's `post_init_from_model` once) under one peak-memory probe.
Decoding picks each token greedily (argmax, the default) or samples it
(`Sampling`: transformers' `TemperatureLogitsWarper` then `TopPLogitsWarper`, then
`torch.multinomial` drawing from a `torch.Generator` seeded for that sample alone, never the global
RNG), so a seed gives the same tokens under every method wherever the logits agree.

Several samples of one prompt (`sample_ids` / `generate_samples`, one seed each): the prompt is
prefilled and compressed once, the cache is `checkpoint()`ed once the whole prompt is in it, and
each sample decodes from that checkpoint (`rollback()` before every sample but the first), its first
token drawn from the prompt's last logits with its own generator. A sample's tokens are
bit-identical to a fresh `generate_ids` run with its seed; its `prefill_s` is the shared prefill
and `e2e_s` what one request would have taken (prefill + compression + its own decode).

Progress: `on_progress(stage, done, total)` (a `ProgressCallback`, optional) reports where a sample
is, for a caller's progress bar or log; the library prints nothing itself. Stages, in order:

- `"prefill"`, `done` = prompt tokens already in the cache, `total` = prompt tokens: before each
  prompt forward (`done=0` first; once per chunk with `chunk_size`; before the question with
  `query_aware=False`), and once with `done == total` when the whole prompt is in the (compressed)
  cache and the first token is out.
- `"decode"`, `done` = tokens generated so far (1 = the first token), `total` = `max_new_tokens`:
  after each token. Generation may stop at a stop token with `done < total`.

The callback never runs inside a timed region: prefill start is before the clock starts, the
others after `ttft_s` / each decode step is measured, and between prefill chunks the clock is
paused (synchronized, on CUDA) while it runs, so a slow callback does not change `prefill_s`,
`ttft_s` or `tpot_s`.

Compress once, ask many: `compress_context()` prefills and compresses a context (left-padded
batches allowed) and returns its cache; `answer()` feeds one question on it, decodes greedily and
rolls the cache back to its state before the question (`CompressedCache.checkpoint` / `rollback`),
so the next question sees exactly the compressed context again, at the same positions.
`answer(..., rollback=False)` leaves the question and the answer in the cache (a conversation's
next turn follows them; `next_turn_text` renders that turn), and `generate(..., on_compressed=f)`
hands the cache to `f` right after compression (e.g. to `checkpoint()` it and ask further questions
on the query-aware cache once the first answer is out). `teacher_force()` feeds given tokens on a
compressed context in one forward and returns every position's logits (fidelity to the full cache:
the same continuation scored on the full and on a compressed cache).
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

import torch

from snapkv import hooks, padding
from snapkv.cache import CompressedCache
from snapkv.forward import PeakMemory, clock, prefill, stepper
from snapkv.hooks import Session
from snapkv.kv_quant import KVQuant
from snapkv.methods import Method, build_method, check_model_generate, post_init_from_tokenizer
from snapkv.prompts import chat_templated, encode_prompt, generation_prompt_length, stop_token_ids
from snapkv.sampling import Sampling, TokenPicker


class ProgressCallback(Protocol):
    """Called by `generate` / `generate_ids` as a sample advances (stages: see the module doc)."""

    def __call__(self, stage: str, done: int, total: int) -> None: ...


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def cache_sizes(cache: CompressedCache) -> dict[str, Any]:
    """The cache's size fields of a `GenerationResult`, read from `cache` now (`compress` reads them
    right after compression; a caller that compresses with `compress_context` reads them the same
    way): `compressed`, `kv_tokens`, `kv_tokens_per_layer`, `kv_bytes_full`, `kv_bytes`,
    `kv_bytes_logical`, `kv_index_bytes`."""
    kept = cache.kept_tokens()
    return {
        "compressed": any(layer.compressed for _, layer in cache.compressible_layers()),
        "kv_tokens": _mean(kept),
        "kv_tokens_per_layer": kept,
        "kv_bytes_full": cache.kv_bytes_full(),
        "kv_bytes": cache.kv_bytes(),
        "kv_bytes_logical": cache.kv_bytes_logical(),
        "kv_index_bytes": cache.kv_index_bytes(),
    }


@dataclass
class GenerationResult:
    """Text plus measurements of one compressed generation.

    kv_* fields are measured right after prefill + compression: `kv_tokens` is the mean number of
    entries kept per compressible layer and KV head, `kv_bytes` the bytes really stored (all layers,
    Σ numel·element_size: allocated), `kv_bytes_logical` the bytes of the entries kept (less than
    `kv_bytes` only with padded per-head storage, Ada-KV layout="padded"), `kv_bytes_full` what the
    same cache holds with nothing evicted, `kv_index_bytes` the kept-index bookkeeping beside the
    stored entries (`CompressedCache.kv_index_bytes`: the compressed layers' positions; None where
    no compressed cache measured it). With quantized storage (`kv_quant`) `kv_bytes` is the packed
    codes, scales, zero points and the full-precision residual. `compressed`: whether any layer was compressed at the end
    of prefill (False when the prompt fits the budget).

    What decoding did (H2O's original and StreamingLLM evict while decoding, e.g. once a prompt
    shorter than the budget has grown past it): `evicted_during_decode`, `decode_evicted` (entries
    evicted while decoding per KV head, summed over steps, mean over the compressible layers) and
    `kv_tokens_end` / `kv_tokens_end_per_layer`, the entries kept at the end of generation
    (same units as `kv_tokens`). `decode_compressions`: scheduled compressions performed while
    decoding (`Method.decode_schedule`); `kv_entries_peak` / `kv_entries_mean`: the largest / mean
    entries per KV head the forwards after the prefill attended to (same units; None when no
    forward followed the prefill). See `CompressedCache.decode_stats`.

    `e2e_s`: end to end, prefill + compression + every decode step (`ttft_s` + Σ `decode_s`; progress
    callbacks excluded), the cost of a long generation's extra tokens included.
    `scoring_s`: seconds of the method's own pass after the prompt forward (KVzip's context
    reconstruction, `OwnPass.after_prefill`), part of `prefill_s` and `ttft_s`; ~0 for the others.

    Memory (`snapkv.forward.PeakMemory`: the CUDA allocator's peak, or the process RSS on CPU):
    `peak_mem_bytes` over the whole generation, usually the prefill's activations;
    `decode_peak_mem_bytes` from the end of compression on, where the kept cache is what changes
    (on CPU an upper bound: RSS counts freed memory the allocator keeps; None where not measured).
    """

    text: str
    output_ids: list[int]
    input_tokens: int
    compressed: bool
    kv_tokens: float
    kv_tokens_per_layer: list[float]
    kv_bytes_full: int
    kv_bytes: int
    kv_bytes_logical: int
    prefill_s: float
    ttft_s: float
    tpot_s: float | None
    peak_mem_bytes: int
    attn_impl: str
    device: str
    new_tokens: int
    stop_reason: str
    evicted_during_decode: bool
    decode_evicted: float
    kv_tokens_end: float
    kv_tokens_end_per_layer: list[float]
    e2e_s: float
    decode_compressions: int = 0
    kv_entries_peak: float | None = None
    kv_entries_mean: float | None = None
    decode_s: list[float] = field(default_factory=list, repr=False)
    logits: list[torch.Tensor] | None = field(default=None, repr=False)
    scoring_s: float = 0.0
    kv_index_bytes: int | None = None
    decode_peak_mem_bytes: int | None = None

    def to_dict(self, with_steps: bool = False) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "logits"}
        if not with_steps:
            d.pop("decode_s")
        return d

    def measurements(self) -> dict[str, Any]:
        """The measured fields, as a results row stores them: everything but the output itself
        (`text`, `output_ids`), the per-step timings and the logits."""
        return {k: v for k, v in self.to_dict().items() if k not in ("text", "output_ids")}

    @classmethod
    def of(
        cls,
        model,
        prompt: Compressed,
        decoded: Decoded,
        peak_mem_bytes: int,
        decode_peak_mem_bytes: int | None = None,
    ) -> GenerationResult:
        """The result of one sample: `decoded` from `prompt` on `model`, under a memory peak of
        `peak_mem_bytes`, `decode_peak_mem_bytes` while decoding (text left empty: the id entry
        points return ids)."""
        return cls(
            text="",
            output_ids=decoded.ids[0].tolist(),
            **prompt.measurements(),
            **decoded.measurements(),
            peak_mem_bytes=peak_mem_bytes,
            decode_peak_mem_bytes=decode_peak_mem_bytes,
            attn_impl=model.config._attn_implementation,
            device=str(model.device),
            decode_s=decoded.steps,
            logits=decoded.logits,
        )


@dataclass
class Compressed:
    """A prompt in its compressed cache (`compress`), ready for `decode`.

    `logits` `[batch, vocab]`: the last prompt position's; None while `question` `[batch, q]` is
    pending (query_aware=False, `answer`): `decode` feeds it on the compressed cache first.
    `input_tokens`: the prompt's tokens, the pending question included. Measured (the progress and
    `on_compressed` callbacks' time left out): `prefill_s`, the prompt's forwards with compression
    and the method's own pass (`scoring_s`); `prompt_s`, from the first forward until the sizes
    (`cache_sizes`, read right after compression) were taken: where `ttft_s` starts.
    """

    cache: CompressedCache
    method: Method
    input_tokens: int
    logits: torch.Tensor | None = None
    question: torch.Tensor | None = None
    prefill_s: float = 0.0
    prompt_s: float = 0.0
    scoring_s: float = 0.0
    sizes: dict[str, Any] = field(default_factory=dict)

    def measurements(self) -> dict[str, Any]:
        """The `GenerationResult` fields measured up to compression."""
        return {
            "input_tokens": self.input_tokens,
            **self.sizes,
            "prefill_s": self.prefill_s,
            "scoring_s": self.scoring_s,
        }


@dataclass
class Decoded:
    """One sample decoded from a `Compressed` prompt (`decode`): the tokens `[batch]` in order, each
    step's seconds after the first token, the kept logits, whether every row stopped at a stop
    token, `ttft_s` (the prompt's `prompt_s`, the pending question's forward and the first pick)
    and the cache at the end (`kept_end` per layer, `evicted` per layer while decoding,
    `CompressedCache.decode_stats`)."""

    tokens: list[torch.Tensor]
    steps: list[float]
    logits: list[torch.Tensor] | None
    eos: bool
    ttft_s: float
    kept_end: list[float]
    evicted: list[float]
    stats: tuple[int, float | None, float | None]

    @property
    def ids(self) -> torch.Tensor:
        return torch.stack(self.tokens, dim=1)

    @property
    def stop_reason(self) -> str:
        return "eos" if self.eos else "length"

    @property
    def tpot_s(self) -> float | None:
        return statistics.median(self.steps) if self.steps else None

    def measurements(self) -> dict[str, Any]:
        """The `GenerationResult` fields measured while decoding."""
        compressions, entries_peak, entries_mean = self.stats
        return {
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "new_tokens": len(self.tokens),
            "stop_reason": self.stop_reason,
            "evicted_during_decode": any(n > 0 for n in self.evicted),
            "decode_evicted": _mean(self.evicted),
            "kv_tokens_end": _mean(self.kept_end),
            "kv_tokens_end_per_layer": self.kept_end,
            "e2e_s": self.ttft_s + sum(self.steps),
            "decode_compressions": compressions,
            "kv_entries_peak": entries_peak,
            "kv_entries_mean": entries_mean,
        }


@dataclass(frozen=True)
class GenerationConfig:
    """How a prompt is generated, in one object: every entry point (`generate`, `generate_samples`,
    `generate_ids`, `sample_ids`, `compress`, `decode`, `answer`) takes it as `config=` and its
    fields as keywords, which override it (as transformers' `generate(generation_config, **kwargs)`
    does); `compress` and `decode` each read the fields of their step.

    query_aware: True, context + question are prefilled (and compressed) together; False, the
    context is prefilled and compressed alone, then the question is fed on the compressed cache.
    max_new_tokens (>= 1); stop_ids: tokens that end a row (None: the model's EOS and the chat
    end-of-turn tokens for the text entry points, none for the id entry points); chunk_size: prefill
    chunk (None: one forward); sampling: a `Sampling` (None: greedy; a seed per sample then);
    keep_logits: keep each step's last-position logits `[batch, vocab]` in `result.logits`;
    chat_template / ignore_eos (text entry points only): render through the tokenizer's chat template
    / no stop tokens (speed runs); on_progress(stage, done, total): told where generation is (module
    doc), never inside a timing; on_compressed(cache): runs once, right after the prefill's
    compression (before any question or decode token is fed), also off the clock;
    generation_prompt: how many of the prompt's last tokens are the chat template's generation
    prompt, what `Method.protect="generation_prompt"` keeps (the text entry points count them,
    `snapkv.prompts.generation_prompt_length`; the id entry points take the count given, 0: none).
    kv_quant: how the cache stores the kept entries (`snapkv.kv_quant.KVQuant`; None: the model's
    dtype).
    """

    query_aware: bool = True
    max_new_tokens: int = 32
    stop_ids: set[int] | None = None
    chunk_size: int | None = None
    sampling: Sampling | None = None
    keep_logits: bool = False
    chat_template: bool = True
    ignore_eos: bool = False
    on_progress: ProgressCallback | None = None
    on_compressed: Callable[[CompressedCache], None] | None = None
    generation_prompt: int = 0
    kv_quant: KVQuant | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got max_new_tokens={self.max_new_tokens}")
        g = self.generation_prompt
        if isinstance(g, bool) or not isinstance(g, int) or g < 0:
            raise ValueError(f"generation_prompt must be an integer >= 0, got generation_prompt={g!r}")

    @classmethod
    def of(cls, config: GenerationConfig | None, options: dict[str, Any]) -> GenerationConfig:
        """`config` (default: `GenerationConfig()`) with the keyword `options` set (TypeError naming
        an option that is not a field, as for any unexpected keyword)."""
        if config is not None and not isinstance(config, GenerationConfig):
            raise ValueError(f"config must be a GenerationConfig, got {type(config).__name__}")
        config = config if config is not None else cls()
        return replace(config, **options) if options else config


_DEFAULTS = GenerationConfig()


def _ids_config(config: GenerationConfig | None, options: dict[str, Any], entry: str) -> GenerationConfig:
    cfg = GenerationConfig.of(config, options)
    if not cfg.chat_template or cfg.ignore_eos:
        raise ValueError(
            f"{entry} takes token ids: chat_template and ignore_eos apply to text prompts (generate, "
            "generate_samples); the ids are fed as given and stop at stop_ids (none by default)"
        )
    return cfg


def _method(method: Method | str | None) -> Method:
    if isinstance(method, str):
        return build_method(method)
    return method if method is not None else build_method("full")


def _notify(
    on_progress: ProgressCallback | None, device: torch.device, stage: str, done: int, total: int
) -> float:
    """Run the progress callback; return the seconds it took (device synchronized on both sides),
    which a caller takes off its clock when it ran inside a timed stretch."""
    if on_progress is None:
        return 0.0
    t = clock(device)
    on_progress(stage, done, total)
    return clock(device) - t


def _protected_tail(method: Method, question: int, generation_prompt: int, fed: int) -> int:
    """How many of the `fed` tokens about to be fed, at their end, `method.protect` keeps (the
    question part is the last `question` of them); ValueError when they leave nothing to evict."""
    tail = min(method.protected_tail(question, generation_prompt), fed)
    method.check_protected(tail)
    return tail


def _session(
    model, method: Method, cache: CompressedCache, session: Session | None
) -> contextlib.AbstractContextManager[Session]:
    """`session` (the caller's, left open) or a new one for `method` on `cache`."""
    return contextlib.nullcontext(session) if session is not None else hooks.session(model, method, cache)


@contextlib.contextmanager
def _feeding(
    model, method: Method, cache: CompressedCache, session: Session | None = None, **step_kwargs: Any
) -> Iterator[Callable[[torch.Tensor], Any]]:
    """`forward(ids)`: tokens fed on a compressed cache (phase "decode"; positions continuing from
    it, a left-padded batch's rows at their own), in `session` or in one of its own meanwhile."""
    prompt_pads = next(
        (layer.prompt_pads for _, layer in cache.compressible_layers() if layer.prompt_pads is not None), None
    )
    with _session(model, method, cache, session) as s:
        s.phase = "decode"
        yield stepper(model, cache, prompt_pads=prompt_pads, session=s, **step_kwargs)


# Every entry point reaches the model under inference mode: without it (model weights require grad
# after `from_pretrained`) each cached key and value would hold its autograd graph, keeping every
# forward's activations alive until the sample ends (memory growing with every token).
@torch.inference_mode()
def compress(
    model,
    context_ids: torch.Tensor,
    method: Method | None = None,
    *,
    question_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    session: Session | None = None,
    config: GenerationConfig | None = None,
    **options: Any,
) -> Compressed:
    """Prefill `context_ids` `[batch, len]` (with `question_ids` `[batch, q]` where `query_aware`;
    else the question is left to `decode`) and compress it with `method`: the cache and what was
    measured (`Compressed`). The options are `GenerationConfig`'s fields (those that apply here:
    query_aware, chunk_size, on_progress, on_compressed, generation_prompt, kv_quant).

    attention_mask `[batch, len]`: a left-padded context (1 = real token; positions as
    `model.generate` derives them, rows handled as in `snapkv.padding`), prefilled in one forward.
    session: an open `snapkv.session(model, method, cache)` on a fresh cache, to prefill into and
    leave open for `decode` (`method` is the session's); None: a new cache, in a session of its own.
    """
    cfg = GenerationConfig.of(config, options)
    method = session.method if session is not None else _method(method)
    device = model.device
    context_ids = context_ids.to(device)
    question_ids = question_ids.to(device) if question_ids is not None and question_ids.numel() else None
    batch, n = context_ids.shape
    asked = question_ids.shape[1] if question_ids is not None else 0
    if (n + asked if cfg.query_aware else n) == 0:  # the prefill's tokens
        raise ValueError("empty prompt: the context has 0 tokens")
    pads = None
    if attention_mask is not None:
        if tuple(attention_mask.shape) != (batch, n):
            raise ValueError(
                f"attention_mask must be [batch, len] = {(batch, n)}, got {tuple(attention_mask.shape)}"
            )
        pads = padding.left_pads(attention_mask.to(device))
    if pads is not None:
        if cfg.chunk_size:
            raise ValueError(
                f"a left-padded batch is prefilled in one forward, got chunk_size={cfg.chunk_size}"
            )
        check_model_generate(method)  # what padded batches support is what model.generate supports
    if cfg.query_aware and question_ids is not None:
        context_ids, question_ids = torch.cat([context_ids, question_ids], dim=1), None
    context_len = context_ids.shape[1]
    input_tokens = n + asked
    # The prompt's protected end (`Method.protect`), compressed with the prompt (query-aware) or
    # fed after it: kept at the end of prefill and by every eviction while decoding.
    tail = _protected_tail(method, asked, cfg.generation_prompt, input_tokens)
    cache = session.cache if session is not None else _new_cache(model, method, cfg.kv_quant)
    cache.protect(input_tokens - tail, input_tokens)
    paused = 0.0  # seconds spent in the callback between prefill chunks, off every timing

    def between_chunks(start: int, end: int, out) -> None:
        nonlocal paused
        if end < context_len:
            paused += _notify(cfg.on_progress, device, "prefill", end, input_tokens)

    with _session(model, method, cache, session) as s:
        _notify(cfg.on_progress, device, "prefill", 0, input_tokens)
        t0 = clock(device)
        out = prefill(
            model, context_ids, cache, session=s, chunk_size=cfg.chunk_size, on_chunk=between_chunks,
            prompt_pads=pads,
        )  # fmt: skip
        prefill_s = clock(device) - t0 - paused
        sizes = cache_sizes(cache)
        prompt_s = clock(device) - t0 - paused
        if cfg.on_compressed is not None:
            cfg.on_compressed(cache)
    return Compressed(
        cache, method, input_tokens, logits=out.logits[:, -1] if question_ids is None else None,
        question=question_ids, prefill_s=prefill_s, prompt_s=prompt_s, scoring_s=cache.scoring_s, sizes=sizes,
    )  # fmt: skip


@torch.inference_mode()
def decode(
    model,
    prompt: Compressed,
    *,
    seeds: Sequence[int | None] = (None,),
    session: Session | None = None,
    config: GenerationConfig | None = None,
    **options: Any,
) -> list[Decoded]:
    """Decode from a compressed prompt, one sample per seed (None: greedy): feed the pending question
    (`prompt.question`) once, then for each seed pick the first token from the prompt's last logits
    and feed each token and pick the next until every row has emitted a stop token or
    `max_new_tokens` are out. With several seeds the cache is checkpointed once the prompt is in it
    and rolled back before every sample but the first, off the clock. The options are
    `GenerationConfig`'s fields (those that apply here: max_new_tokens, stop_ids, sampling,
    keep_logits, on_progress).

    Timing: `ttft_s` = `prompt.prompt_s` + the question's forward + the first pick; each step's
    seconds cover its forward and pick; the progress callback runs off the clock. session: the open
    session `compress` prefilled in (kept open); None: one of its own. The cache moves on with the
    tokens: a prompt is decoded once (several samples: `seeds`).
    """
    cfg = GenerationConfig.of(config, options)
    device, cache, new = model.device, prompt.cache, cfg.max_new_tokens
    pickers = [TokenPicker(cfg.sampling, seed, device) for seed in seeds]
    stop = torch.tensor(sorted(cfg.stop_ids or ()), dtype=torch.long, device=device)

    def notify(stage: str, done: int, total: int) -> None:
        _notify(cfg.on_progress, device, stage, done, total)

    decoded = []
    with _feeding(model, prompt.method, cache, session) as forward:
        logits, prompt_s = prompt.logits, prompt.prompt_s
        if prompt.question is not None:
            question = prompt.question.to(device)
            notify("prefill", prompt.input_tokens - question.shape[1], prompt.input_tokens)
            t = clock(device)
            logits = forward(question).logits[:, -1]
            prompt_s += clock(device) - t
        mark = cache.checkpoint() if len(pickers) > 1 else None
        for i, pick in enumerate(pickers):
            if i > 0:
                cache.rollback(mark)
            t = clock(device)
            token = pick(logits)
            ttft_s = prompt_s + clock(device) - t
            if i == 0:
                notify("prefill", prompt.input_tokens, prompt.input_tokens)
            notify("decode", 1, new)
            finished = torch.zeros(token.shape[0], dtype=torch.bool, device=device)
            tokens, steps = [token], []
            kept = [logits.float().cpu()] if cfg.keep_logits else None
            while len(tokens) < new:
                finished |= torch.isin(token, stop)
                if bool(finished.all()):
                    break
                t = clock(device)
                out = forward(token[:, None])
                token = pick(out.logits[:, -1])
                steps.append(clock(device) - t)
                tokens.append(token)
                if kept is not None:
                    kept.append(out.logits[:, -1].float().cpu())
                notify("decode", len(tokens), new)
            finished |= torch.isin(token, stop)
            evicted = [layer.decode_evicted for _, layer in cache.compressible_layers()]
            eos = bool(finished.all())
            decoded.append(
                Decoded(tokens, steps, kept, eos, ttft_s, cache.kept_tokens(), evicted, cache.decode_stats())
            )
    return decoded


@torch.inference_mode()
def _generate(
    model,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor | None,
    method: Method | None,
    seeds: list[int | None],
    cfg: GenerationConfig,
) -> list[tuple[torch.Tensor, GenerationResult]]:
    """`compress` then `decode` (`generate_ids`: one seed, None when greedy; `sample_ids`: several)
    in one session, under one memory probe."""
    method = _method(method)
    for seed in seeds:  # before any forward
        TokenPicker.check(cfg.sampling, seed)
    cache = _new_cache(model, method, cfg.kv_quant)
    with hooks.session(model, method, cache) as s, PeakMemory(model.device) as mem:
        prompt = compress(model, context_ids, question_ids=question_ids, session=s, config=cfg)
        mem.phase()
        decoded = decode(model, prompt, seeds=seeds, session=s, config=cfg)
    during = int(mem.phase_peak) if mem.phase_peak is not None else None
    return [(d.ids, GenerationResult.of(model, prompt, d, int(mem.peak), during)) for d in decoded]


def _new_cache(model, method: Method, kv_quant: KVQuant | None) -> CompressedCache:
    """A fresh cache for `method`, its entries stored as `kv_quant` says (checked against the method
    before any forward)."""
    if kv_quant is not None:
        kv_quant.check_method(method)
    return CompressedCache(model.config, layer_factory=method.cache_layer, kv_quant=kv_quant)


@torch.inference_mode()
def generate_ids(
    model,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor | None = None,
    method: Method | None = None,
    *,
    seed: int | None = None,
    config: GenerationConfig | None = None,
    **options: Any,
) -> tuple[torch.Tensor, GenerationResult]:
    """Generation from token ids `[batch, len]` (equal lengths, no padding; left-padded
    batches: `with snapkv.apply(model, method): model.generate(ids, attention_mask=mask)`): greedy,
    or sampled with `sampling` and `seed` (`Sampling`, `TokenPicker`); the options are
    `GenerationConfig`'s fields.

    Returns the generated ids `[batch, new]` and the measurements (text left empty).
    """
    cfg = _ids_config(config, options, "generate_ids")
    ((ids, result),) = _generate(model, context_ids, question_ids, method, [seed], cfg)
    return ids, result


@torch.inference_mode()
def sample_ids(
    model,
    context_ids: torch.Tensor,
    question_ids: torch.Tensor | None = None,
    method: Method | None = None,
    *,
    sampling: Sampling,
    seeds: Sequence[int],
    config: GenerationConfig | None = None,
    **options: Any,
) -> list[tuple[torch.Tensor, GenerationResult]]:
    """`len(seeds)` samples of one prompt, one per seed, with one prefill + compression: each sample
    decodes from a checkpoint of the cache taken once the prompt is in it (module doc). Sample i's
    tokens equal `generate_ids(..., sampling=sampling, seed=seeds[i])`'s. Every result carries the
    shared `prefill_s`, `peak_mem_bytes` (the peak over all samples) and kv_* sizes after
    compression, and its own `ttft_s` (the prompt's forwards + its first draw), decode timings,
    `e2e_s`, `kv_tokens_end` and eviction counts. Other arguments as `generate_ids`."""
    if sampling is None:
        raise ValueError("sample_ids needs a Sampling; greedy decoding is generate_ids")
    if not seeds:
        raise ValueError(f"sample_ids needs at least one seed, got seeds={list(seeds)!r}")
    cfg = _ids_config(config, {**options, "sampling": sampling}, "sample_ids")
    return _generate(model, context_ids, question_ids, method, list(seeds), cfg)


@torch.inference_mode()
def compress_context(
    model,
    context_ids: torch.Tensor,
    method: Method | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int | None = None,
    kv_quant: KVQuant | None = None,
) -> CompressedCache:
    """Prefill `context_ids` `[batch, len]` and compress it with `method`; returns the cache, ready
    for `answer()`: `compress` of the context alone (the context half of
    `generate_ids(..., query_aware=False)`, same forwards). `attention_mask` `[batch, len]`: a
    left-padded batch (`compress`; `chunk_size` must be None then). `kv_quant`: as
    `GenerationConfig.kv_quant`."""
    return compress(
        model, context_ids, method, attention_mask=attention_mask, chunk_size=chunk_size, kv_quant=kv_quant
    ).cache


@dataclass
class Answer:
    """One question answered on a compressed cache (`answer`): the tokens `[batch, new]`,
    each step's last-position logits `[batch, vocab]` (fp32, CPU; with `keep_logits`), why it
    stopped, and the bytes the rollback had kept alive beyond the cache (`rollback_bytes`: 0 unless
    decoding evicted or a sliding window rolled, see `CompressedCache.checkpoint`; 0 without a
    rollback). `ttft_s`: from feeding the question to the first token; `tpot_s`: median seconds per
    token after it (None with one token)."""

    ids: torch.Tensor
    logits: list[torch.Tensor] | None
    stop_reason: str
    rollback_bytes: int
    ttft_s: float | None = None
    tpot_s: float | None = None


@torch.inference_mode()
def answer(
    model,
    cache: CompressedCache,
    question_ids: torch.Tensor,
    method: Method | None = None,
    *,
    seed: int | None = None,
    rollback: bool = True,
    config: GenerationConfig | None = None,
    **options: Any,
) -> Answer:
    """Answer one question on a compressed context and leave the cache as it was.

    `cache` comes from `compress_context` (with the same `method`); `question_ids` `[batch, q]`
    (q >= 1; a padded batch's rows need no extra padding, each continues at its own position).
    Takes `cache.checkpoint()` (replacing an earlier mark), feeds the question, decodes (greedily, or
    sampled with `sampling` and `seed`) like `generate_ids(..., query_aware=False)` (`decode`; the
    method may evict while decoding), then `cache.rollback()`s, also when a forward raises. The
    options are `GenerationConfig`'s fields that apply once the context is compressed:
    max_new_tokens, stop_ids, keep_logits, sampling, generation_prompt (the last tokens of
    `question_ids` that are the chat template's generation prompt; the question's entries
    `method.protect` names are kept from eviction while it decodes); the others are refused, naming
    them.

    rollback=False: no checkpoint and no rollback; the question and every generated token but the
    last (never fed: decoding stops once it is out) stay in the cache, for a conversation's next turn.
    """
    cfg = GenerationConfig.of(config, options)
    unused = [
        f for f in ("query_aware", "chunk_size", "chat_template", "ignore_eos", "on_progress", "on_compressed")
        if getattr(cfg, f) != getattr(_DEFAULTS, f)
    ]  # fmt: skip
    if unused:
        raise ValueError(
            f"answer() feeds a question on a compressed context: {', '.join(unused)} do not apply"
        )
    method = _method(method)
    question_ids = question_ids.to(model.device)
    if question_ids.dim() != 2 or question_ids.shape[1] == 0:
        raise ValueError(f"question_ids must be [batch, q>=1], got shape {tuple(question_ids.shape)}")
    TokenPicker.check(cfg.sampling, seed)
    q = question_ids.shape[1]
    tail = _protected_tail(method, q, cfg.generation_prompt, q)
    mark = cache.checkpoint() if rollback else None
    layers = cache.compressible_layers()
    start = layers[0][1].seen if layers else 0
    # The question's protected end, at the positions it is fed to (the rollback clears it).
    cache.protect(start + q - tail, start + q)
    prompt = Compressed(cache, method, start + q, question=question_ids)
    try:
        (d,) = decode(model, prompt, seeds=[seed], config=cfg)
    finally:
        held = cache.rollback(mark) if mark is not None else 0
    return Answer(d.ids, d.logits, d.stop_reason, held, d.ttft_s, d.tpot_s)


@torch.inference_mode()
def teacher_force(
    model,
    cache: CompressedCache,
    ids: torch.Tensor,
    method: Method | None = None,
    *,
    rollback: bool = True,
) -> torch.Tensor:
    """Feed `ids` `[batch, q]` on a compressed context in one forward and return the logits of every
    position, `[batch, q, vocab]` (fp32, on the model's device): row i is the model's distribution of
    the token after `ids[:, i]` given the cache and `ids[:, :i+1]`.

    `cache` comes from `compress_context` (with the same `method`). The tokens go through the cache as
    `answer` feeds a question (phase "decode", positions continuing from the cache), so a method that
    evicts while decoding does so after this forward, as it would after a multi-token question; inside
    the forward every one of the q tokens attends to the compressed context and to the tokens before
    it. rollback: checkpoint the cache first and restore it after (also when the forward raises);
    False leaves the q tokens in it.
    """
    method = _method(method)
    ids = ids.to(model.device)
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"ids must be [batch, q>=1], got shape {tuple(ids.shape)}")
    mark = cache.checkpoint() if rollback else None
    try:
        with _feeding(model, method, cache, logits_to_keep=0) as forward:
            return forward(ids).logits.float()
    finally:
        if mark is not None:
            cache.rollback(mark)


def generate(
    model,
    tokenizer,
    prompt: str | None = None,
    *,
    context: str | None = None,
    question: str = "",
    method: Method | str | None = None,
    seed: int | None = None,
    config: GenerationConfig | None = None,
    **options: Any,
) -> GenerationResult:
    """Generate from `prompt` (or `context` + `question`) with `method` compressing the KV cache:
    greedily, or sampled with `sampling` and `seed`; the options are `GenerationConfig`'s fields.

    Stop tokens: the model's EOS and the chat end-of-turn tokens (`ignore_eos=True` for speed runs).
    """
    cfg = GenerationConfig.of(config, options)
    (result,) = _generate_text(model, tokenizer, prompt, context, question, method, [seed], cfg)
    return result


def generate_samples(
    model,
    tokenizer,
    prompt: str | None = None,
    *,
    sampling: Sampling,
    seeds: Sequence[int],
    context: str | None = None,
    question: str = "",
    method: Method | str | None = None,
    config: GenerationConfig | None = None,
    **options: Any,
) -> list[GenerationResult]:
    """`len(seeds)` sampled generations of one prompt with one prefill + compression (`sample_ids`);
    result i equals `generate(..., sampling=sampling, seed=seeds[i])`'s tokens and text."""
    if sampling is None:
        raise ValueError("generate_samples needs a Sampling; greedy decoding is generate")
    if not seeds:
        raise ValueError(f"generate_samples needs at least one seed, got seeds={list(seeds)!r}")
    cfg = GenerationConfig.of(config, {**options, "sampling": sampling})
    return _generate_text(model, tokenizer, prompt, context, question, method, list(seeds), cfg)


def _generate_text(
    model,
    tokenizer,
    prompt: str | None,
    context: str | None,
    question: str,
    method: Method | str | None,
    seeds: list[int | None],
    cfg: GenerationConfig,
) -> list[GenerationResult]:
    if prompt is not None and context is not None:
        raise ValueError("pass either prompt or context/question, not both")
    context = prompt if prompt is not None else context
    if not context:
        raise ValueError("empty prompt: context is empty")
    method = _method(method)
    head, tail = encode_prompt(tokenizer, context, question, cfg.chat_template)
    post_init_from_tokenizer(method, tokenizer, chat_templated(tokenizer, cfg.chat_template))
    stops = (
        set()
        if cfg.ignore_eos
        else (cfg.stop_ids if cfg.stop_ids is not None else stop_token_ids(model, tokenizer))
    )
    cfg = replace(cfg, generation_prompt=generation_prompt_length(tokenizer, head + tail), stop_ids=stops)
    outputs = _generate(
        model, torch.tensor([head]), torch.tensor([tail]) if tail else None, method, seeds, cfg
    )
    results = []
    for ids, result in outputs:
        out = ids[0].tolist()
        if out and out[-1] in stops:
            out = out[:-1]
        result.text = tokenizer.decode(out, skip_special_tokens=True).strip()
        results.append(result)
    return results
