"""Fidelity to the full cache on any text: how far a compressed cache moves the model's next-token
distributions away from the full cache's, teacher-forced on a continuation of the compressed text.

No task data and no answer to grade: any text serves (the Paul Graham essays, RULER's noise, every
`.txt` file of a folder: `eval.tasks.haystack`), and every position of the continuation is a
measurement, so a few passages separate methods that a needle grid scores alike.

Passages. The haystack is tokenized once (without special tokens) into one token stream, repeated
(joined by its separator) when it is shorter than needed. Passage i is the stream's tokens
[i * L, (i + 1) * L) with L = ``context_tokens`` + ``continuation_tokens`` + 1: consecutive, never
overlapping, and the same for every ``num_samples`` (growing it adds passages). Its context is the
tokenizer's own leading special tokens (BOS where it adds one) and the first ``context_tokens``
tokens; the rest is the continuation. No chat template: the text is a document, not a turn.

Per passage and method:

1. Compress the context exactly as generation does (`snapkv.compress_context`: the method's
   prefill, compression at the end of it, the run's prefill chunking).
2. Feed the first ``continuation_tokens`` continuation tokens on that cache in ONE forward
   (`snapkv.teacher_force`, phase "decode" as a question is fed), keeping every position's logits:
   position j predicts continuation token j + 1 from the compressed context and the continuation
   up to j. These T = ``continuation_tokens`` predictions are the ones scored. The prediction of the
   first continuation token (the prefill's own last logits) is left out: compression runs after the
   last prefill chunk's attention, so it is the full cache's for every method.
3. The full cache's log-probabilities of the same passage `[T, vocab]` (fp32) come from the same
   two steps with `method=full`, computed once per passage and model and kept on disk
   (`{results_dir}/.cache/fidelity/{model key}/{sha}.pt`, sha over the model's identity, the
   prefill chunking and the passage's token ids), so every method of a sweep, and a later run into
   the same results dir, reads them instead of recomputing them.

Teacher forcing in one forward measures the compressed context: a method that also evicts while
decoding (H2O's original, StreamingLLM's rolling window, `decode_schedule`) does so only after the
forward (`decode_evicted` says whether it did), not between continuation tokens as a token-by-token
generation would.

Metrics per passage, over the T positions (p = full cache, q = method; natural logs):

- ``kl``: mean per-token KL(p ‖ q) = Σ_v p(v) (log p(v) - log q(v)), nats; exactly 0 for `full`.
- ``top1_agreement`` (the row's ``score``, in [0, 1]; the report shows it x100): the fraction of
  positions where q's argmax is p's argmax.
- ``nll_full`` / ``nll_method``: mean negative log-likelihood of the true continuation tokens;
  ``ppl_full`` / ``ppl_method`` = exp of those; ``delta_log_ppl`` = nll_method - nll_full (> 0: the
  compressed cache finds the real text less likely).
- ``kl_max``: the largest per-token KL (the worst position).
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from eval.store import canonical_json
from eval.tasks.base import EvalContext, Evaluation, Sample, Task
from eval.tasks.haystack import check_haystack_name, load_haystack
from eval.tasks.registry import register_task
from snapkv import build_method, compress_context, teacher_force
from snapkv.forward import PeakMemory, clock
from snapkv.generation import cache_sizes
from snapkv.methods import Method, post_init_from_tokenizer

VERSION = "1"


@dataclass
class Passage(Sample):
    """A fidelity sample: `ids` the passage's tokens (special prefix + context + continuation + 1),
    the first `context_len` of them the context."""

    ids: list[int] = field(default_factory=list)
    context_len: int = 0


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"fidelity {key} must be a positive integer, got {key}={value!r}")
    return value


def special_prefix(tokenizer: Any) -> list[int]:
    """The special tokens the tokenizer puts before a text of its own accord (BOS, where it adds one)."""
    plain = tokenizer("a", add_special_tokens=False).input_ids
    full = tokenizer("a").input_ids
    n = len(full) - len(plain)
    return list(full[:n]) if n > 0 and full[n:][: len(plain)] == plain else []


def token_stream(tokenizer: Any, haystack: str, n: int) -> list[int]:
    """The first `n` tokens of the haystack tokenized once, repeated with its separator as needed."""
    base, sep = load_haystack(haystack)
    ids = tokenizer(base, add_special_tokens=False).input_ids
    if not ids:
        raise ValueError(f"fidelity haystack {haystack!r} tokenizes to no token")
    sep_ids = tokenizer(sep, add_special_tokens=False).input_ids
    stream = list(ids)
    while len(stream) < n:
        stream += sep_ids + ids
    return stream[:n]


def continuation_logprobs(
    model: Any, ids: list[int], context_len: int, method: Method, chunk_size: int | None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Compress `ids[:context_len]` with `method`, teacher-force the rest but its last token and
    return the log-probs `[T, vocab]` (fp32, CPU) of the T tokens after the first continuation
    token, and the row's measurements: the cache's sizes right after compression (as a generated
    row's), what the continuation's forward evicted, and the seconds of both steps."""
    device = model.device
    tokens = torch.tensor([ids])
    with PeakMemory(device) as mem:
        t0 = clock(device)
        cache = compress_context(model, tokens[:, :context_len], method, chunk_size=chunk_size)
        prefill_s = clock(device) - t0
        fields = {
            "input_tokens": context_len,
            # A generated row's size fields; its `kv_tokens_per_layer` is not a row column (the
            # runner keeps the `ROW_FIELDS` of `Evaluation.fields`).
            **cache_sizes(cache),
            "prefill_s": prefill_s,
            "context_prefill_s": prefill_s,
            "scoring_s": cache.scoring_s,
        }
        t1 = clock(device)
        logits = teacher_force(model, cache, tokens[:, context_len:-1], method, rollback=False)
        tf_s = clock(device) - t1
    evicted = [layer.decode_evicted for _, layer in cache.compressible_layers()]
    end = cache.kept_tokens()
    fields.update(
        evicted_during_decode=any(n > 0 for n in evicted),
        decode_evicted=sum(evicted) / len(evicted) if evicted else 0.0,
        kv_tokens_end=sum(end) / len(end) if end else 0.0,
        e2e_s=prefill_s + tf_s,
        peak_mem_bytes=int(mem.peak),
        teacher_force_s=tf_s,
    )
    return torch.log_softmax(logits[0], dim=-1).cpu(), fields


def reference_logprobs(sample: Passage, context: EvalContext) -> torch.Tensor:
    """The full cache's log-probs `[T, vocab]` of `sample`: read from `context.cache_dir` when a run
    over the same model, prefill chunking and passage computed them, else computed (`method=full`,
    the same path as every method) and written there for the next run."""
    key = {"model": context.model_id, "chunk_size": context.chunk_size, "ids": sample.ids}
    digest = hashlib.sha256(canonical_json(key).encode("utf-8")).hexdigest()[:32]
    path = Path(context.cache_dir) / f"{digest}.pt"
    if path.exists():
        stored = torch.load(path, map_location="cpu", weights_only=True)
        if stored.get("ids") == sample.ids:
            return stored["logprobs"]
    logprobs, _ = continuation_logprobs(
        context.model, sample.ids, sample.context_len, build_method("full"), context.chunk_size
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: a concurrent shard or an interrupted run never leaves half a file.
    fd, tmp = tempfile.mkstemp(prefix=f".{digest}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        torch.save({"ids": sample.ids, "logprobs": logprobs}, tmp)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from the results dir's other users
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return logprobs


def fidelity_metrics(full: torch.Tensor, method: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Per-token KL(full ‖ method), top-1 agreement and NLLs from log-probs `[T, vocab]` (both) and
    the true next tokens `[T]` (module docstring). Float64 sums: identical inputs give KL exactly 0."""
    p_log, q_log = full.double(), method.double()
    kl = (p_log.exp() * (p_log - q_log)).sum(dim=-1)  # [T]
    agree = (full.argmax(dim=-1) == method.argmax(dim=-1)).double()
    nll_full = -p_log.gather(-1, targets[:, None]).squeeze(-1).mean().item()
    nll_method = -q_log.gather(-1, targets[:, None]).squeeze(-1).mean().item()
    return {
        "kl": kl.mean().item(),
        "kl_max": kl.max().item(),
        "top1_agreement": agree.mean().item(),
        "nll_full": nll_full,
        "nll_method": nll_method,
        "ppl_full": math.exp(nll_full),
        "ppl_method": math.exp(nll_method),
        "delta_log_ppl": nll_method - nll_full,
    }


@register_task
class FidelityTask(Task):
    """Fidelity of a compressed cache to the full one on `num_samples` passages of a haystack
    (see the module docstring).

    haystack: ``paul_graham`` | ``noise`` | ``dir:PATH`` (`eval.tasks.haystack`); context_tokens:
    tokens of text compressed (plus the tokenizer's BOS, where it adds one); continuation_tokens: T,
    the continuation positions scored; num_samples: passages (selection key: consecutive passages of
    the stream, a larger value keeps the earlier ones).

    Row columns: passage_index, passage_offset (the passage's first token in the stream),
    context_tokens, continuation_tokens, haystack, and the measured kl, kl_max, top1_agreement,
    nll_full, nll_method, ppl_full, ppl_method, delta_log_ppl, teacher_force_s. `score` =
    top1_agreement, `scores` = {"top1_agreement": ...}. `prediction`: the method's greedy
    continuation (its argmax at each position), decoded.
    """

    name: ClassVar[str] = "fidelity"
    version: ClassVar[str] = VERSION
    selection_keys: ClassVar[tuple[str, ...]] = ("num_samples",)
    generates: ClassVar[bool] = False

    def __init__(
        self,
        haystack: str = "paul_graham",
        context_tokens: int = 4096,
        continuation_tokens: int = 128,
        num_samples: int = 8,
    ) -> None:
        if not isinstance(haystack, str):
            raise ValueError(f"fidelity haystack must be a string, got haystack={haystack!r}")
        check_haystack_name(haystack)
        self.haystack = haystack
        self.context_tokens = _positive_int("context_tokens", context_tokens)
        self.continuation_tokens = _positive_int("continuation_tokens", continuation_tokens)
        self.passages = _positive_int("num_samples", num_samples)

    def num_samples(self) -> int:
        return self.passages

    @property
    def passage_tokens(self) -> int:
        """Tokens of one passage in the stream: context, the first continuation token (predicted by
        the prefill, not scored), then the T scored ones."""
        return self.context_tokens + self.continuation_tokens + 1

    def samples(self, tokenizer: Any) -> Iterator[Passage]:
        n = self.passage_tokens
        stream = token_stream(tokenizer, self.haystack, n * self.passages)
        prefix = special_prefix(tokenizer)
        for i in range(self.passages):
            text_ids = stream[i * n : (i + 1) * n]
            ids = prefix + text_ids
            context_len = len(prefix) + self.context_tokens
            yield Passage(
                sample_id=f"passage{i}",
                dataset=self.name,
                context=tokenizer.decode(ids[:context_len]),
                question="",
                answers=[tokenizer.decode(ids[context_len:])],
                max_new_tokens=1,
                chat_template=False,
                ids=ids,
                context_len=context_len,
                extra={
                    "passage_index": i,
                    "passage_offset": i * n,
                    "context_tokens": self.context_tokens,
                    "continuation_tokens": self.continuation_tokens,
                    "haystack": self.haystack,
                },
            )

    def evaluate(self, sample: Passage, context: EvalContext) -> Evaluation:
        model, method = context.model, context.method
        post_init_from_tokenizer(method, context.tokenizer, False)
        if context.on_progress is not None:
            context.on_progress("prefill", 0, sample.context_len)
        full = reference_logprobs(sample, context)
        logprobs, fields = continuation_logprobs(
            model, sample.ids, sample.context_len, method, context.chunk_size
        )
        if context.on_progress is not None:
            context.on_progress("prefill", sample.context_len, sample.context_len)
        targets = torch.tensor(sample.ids[sample.context_len + 1 :])
        metrics = fidelity_metrics(full, logprobs, targets)
        teacher_force_s = fields.pop("teacher_force_s")
        return Evaluation(
            score=metrics["top1_agreement"],
            scores={"top1_agreement": metrics["top1_agreement"]},
            fields=fields,
            columns={**metrics, "teacher_force_s": teacher_force_s},
            prediction=context.tokenizer.decode(logprobs.argmax(dim=-1).tolist()),
        )
