"""One forward step of a generation on a (compressed) cache, and what every caller measures around it.

`step` feeds tokens on a cache with explicit positions continuing from `cache.get_seq_length()`
(a left-padded batch's rows at their own positions) and keeps only the last position's logits: the
one forward every caller makes; `prefill` steps through a prompt, optionally in chunks, the last
chunk marked for compression. `clock`
is the one wall clock (the device synchronized first) and `PeakMemory` the one memory probe.
`cache_kwarg` is the forward argument that takes the cache (it changed name inside the supported
transformers range).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import psutil
import torch
from transformers import Cache

if TYPE_CHECKING:
    from snapkv.hooks import Session


def clock(device: torch.device) -> float:
    """`time.perf_counter()` once the device has finished its queued work (CUDA: synchronized)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def cache_kwarg(model) -> str:
    """The forward kwarg that takes the cache: `cache` from transformers 5.24, `past_key_values`
    before (5.23 silently ignores `cache=` and builds its own: the one compatibility seam)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class PeakMemory:
    """Peak memory over a block: the CUDA allocator peak on GPU, else the process RSS peak (sampled
    every `interval` s in a thread; the OS's own ru_maxrss cannot be reset within a process).

    `phase()` starts a later phase inside the block (e.g. decoding after the prompt's prefill):
    `peak` stays the whole block's, `phase_peak` is the peak from that call on (None without one).
    A decode phase's peak is what the kept cache costs while generating, which the prefill's
    activations hide in `peak`."""

    def __init__(self, device: torch.device, interval: float = 0.005):
        self.device, self.interval = device, interval
        self.peak = 0
        self.phase_peak: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._proc = psutil.Process()
            self._stop = threading.Event()
            self._lock = threading.Lock()  # a sample read before `phase()` never counts into its peak
            self.peak = self._proc.memory_info().rss
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self._see()

    def _see(self) -> None:
        with self._lock:
            rss = self._proc.memory_info().rss
            self.peak = max(self.peak, rss)
            if self.phase_peak is not None:
                self.phase_peak = max(self.phase_peak, rss)

    def phase(self) -> None:
        """Start the later phase: its peak starts at the memory in use now."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # the allocator has one resettable peak: fold the block's so far into `peak` first
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)
            self.phase_peak = torch.cuda.memory_allocated(self.device)
        else:
            with self._lock:
                rss = self._proc.memory_info().rss
                self.peak, self.phase_peak = max(self.peak, rss), rss

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            now = torch.cuda.max_memory_allocated(self.device)
            self.peak = max(self.peak, now)
            if self.phase_peak is not None:
                self.phase_peak = max(self.phase_peak, now)
        else:
            self._stop.set()
            self._thread.join()
            self._see()


def step(
    model,
    cache: Cache,
    ids: torch.Tensor,
    *,
    prompt_pads: torch.Tensor | None = None,
    session: Session | None = None,
    cache_arg: str | None = None,
    logits_to_keep: int = 1,
    **model_kwargs: Any,
) -> Any:
    """Feed `ids` `[batch, q]` (moved to the model's device) on `cache`: positions continue from
    `cache.get_seq_length()`, `use_cache=True`, logits of the last `logits_to_keep` positions (1 by
    default; 0: every position, transformers' convention, for teacher forcing); `model_kwargs` go to
    the forward.

    prompt_pads `[batch]`: the leading pad slots of a left-padded batch's rows (a padded row's
    positions count its real tokens only, its pads stay masked at position 0, where
    `model.generate` puts them); the mask is also handed to the open `session`
    (`Session.padding`), whose hooks run per row on it. cache_arg: `cache_kwarg(model)` when the
    caller already has it (a decode loop reads the signature once, not per token).
    """
    device = model.device
    batch, q = ids.shape
    start = cache.get_seq_length()
    pos = torch.arange(start, start + q, device=device).unsqueeze(0).expand(batch, -1)
    if prompt_pads is not None:
        pads = prompt_pads.to(device)
        pos = (pos - pads[:, None]).clamp_min(0)  # only a padded prompt's own pad slots go below 0
        mask = (torch.arange(start + q, device=device)[None, :] >= pads[:, None]).long()
        model_kwargs["attention_mask"] = mask
        if session is not None:
            session.padding = mask
    return model(
        input_ids=ids.to(device),
        position_ids=pos,
        use_cache=True,
        logits_to_keep=logits_to_keep,
        **model_kwargs,
        **{cache_arg or cache_kwarg(model): cache},
    )


def stepper(model, cache: Cache, **kwargs: Any) -> Callable[[torch.Tensor], Any]:
    """`forward(ids)`: `step(model, cache, ids, **kwargs)`, for loops that feed one token at a time
    (and for a method's own pass after the prefill, `OwnPass.after_prefill`)."""

    kwargs.setdefault("cache_arg", cache_kwarg(model))

    def forward(ids: torch.Tensor) -> Any:
        return step(model, cache, ids, **kwargs)

    return forward


def _chunks(n: int, chunk_size: int | None, min_last: int) -> list[tuple[int, int]]:
    """[start, end) prefill chunks; the last one holds at least `min_last` tokens (SnapKV's window)."""
    if not chunk_size or chunk_size >= n:
        return [(0, n)]
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got chunk_size={chunk_size}")
    bounds = list(range(0, n, chunk_size)) + [n]
    spans = list(zip(bounds[:-1], bounds[1:]))
    while len(spans) > 1 and spans[-1][1] - spans[-1][0] < min_last:
        spans[-2:] = [(spans[-2][0], spans[-1][1])]
    return spans


def prefill(
    model,
    ids: torch.Tensor,
    cache: Cache,
    *,
    session: Session | None = None,
    chunk_size: int | None = None,
    on_chunk: Callable[[int, int, Any], None] | None = None,
    prompt_pads: torch.Tensor | None = None,
    **model_kwargs: Any,
) -> Any:
    """Forward the prompt `ids` `[batch, n]` into `cache`, in chunks of `chunk_size` tokens (None:
    one forward), each a `step` (positions continuing from `cache.get_seq_length()`,
    `use_cache=True`, `logits_to_keep=1`); `model_kwargs` go to every forward (e.g.
    `output_attentions=True`). Runs under the caller's grad mode. prompt_pads `[batch]`: a
    left-padded batch's pads (`step`; one forward, the hooks read the padding on a layer's first).

    session: the open compression `Session`; its phase is "prefill" for every chunk but the last
    and "final" for the last (compression right after it), and the last chunk holds at least
    `session.method.min_last_chunk` tokens (a shorter one merges into the one before); after the
    last chunk an `OwnPass` method's `after_prefill` runs on `ids` (`Session.after_prefill`; its
    wall time in `cache.scoring_s`).
    on_chunk(start, end, output): called after each chunk's forward (offsets into `ids`).
    Returns the last chunk's model output (logits `[batch, 1, vocab]`).
    """
    spans = _chunks(ids.shape[1], chunk_size, session.method.min_last_chunk if session is not None else 1)
    kw = cache_kwarg(model)
    for i, (a, b) in enumerate(spans):
        if session is not None:
            session.phase = "final" if i == len(spans) - 1 else "prefill"
        out = step(
            model, cache, ids[:, a:b], prompt_pads=prompt_pads, session=session, cache_arg=kw, **model_kwargs
        )
        if on_chunk is not None:
            on_chunk(a, b, out)
    if session is not None:
        session.after_prefill(ids)
    return out
