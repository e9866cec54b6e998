"""The reference clock: a fixed forward of the same model timed beside the measured work, so a
timing divided by its neighbour reference cancels the machine's speed at that moment."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from eval.machine import busy_s
from eval.stats import spread
from snapkv.hooks import suspended


class Reference:
    """A fixed workload timed right beside the measured work: a forward of `tokens` fixed random
    token ids through the same model, no cache, `logits_to_keep=1`, with no compression session
    current (`snapkv.hooks.suspended`), so it touches nothing the measured generation holds.

    Why: on a shared VM the same work's CPU time drifts 20-35% within seconds and between
    processes (memory bandwidth and cache other tenants take show in no counter of this guest).
    A forward of the same model timed next to it drifts with it; measured here on 2 vCPUs with a
    single-threaded job on the other core:
    - decode (16-token reference after each step): the same full@512 step's raw medians spanned
      65.7-88.1 ms over four processes, the step over its reference 0.635-0.668;
    - prefill (after each of the 30 layers of an 8K prefill, six processes, three of them with a
      bursty third process): raw 49.9-53.4 CPU-s; in units of a 16-token reference 377-391 (3.6%,
      the burst shifting it up), of a 128-token reference 134.1-136.9 (2.1%, the burst not) -- a
      prefill is compute-bound GEMMs, and a longer reference is the same kind of work.
    `PhaseProbe` runs one after every decode step and one after every decoder layer of a prefill;
    a time divided by its neighbour reference is in "reference units", and the ratio of two
    configurations in those units cancels the machine's speed at the moments each one ran.
    """

    def __init__(self, model, vocab: int, tokens: int = 16, seed: int = 0):
        if not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"reference tokens must be a positive integer, got tokens={tokens!r}")
        self.model, self.tokens = model, tokens
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(min(100, vocab - 1), vocab, (1, tokens), generator=gen).to(model.device)

    def run(self) -> tuple[float, float, float]:
        """Time one reference forward: (wall s, this process's CPU s, machine busy s)."""
        t0, c0, b0 = time.perf_counter(), time.process_time(), busy_s()
        with suspended(), torch.inference_mode():
            self.model(input_ids=self.ids, use_cache=False, logits_to_keep=1)
        return time.perf_counter() - t0, time.process_time() - c0, busy_s() - b0


@dataclass
class _Call:
    """One top-level forward as PhaseProbe saw it, the reference forwards it ran taken off."""

    tokens: int
    wall: float
    own: float
    other: float
    layers: list[tuple[float, float]] = field(default_factory=list)  # (layer CPU s, its reference's CPU s)
    ref_wall: float = 0.0  # wall time of the reference forwards run inside this call's span
    ref_cpu: float | None = None  # decode: CPU of the reference run right after it


class PhaseProbe:
    """Context manager: per-forward CPU time and noise of a model, split into prefill (forwards of
    more than one token per row) and decode (one token) with forward hooks.

    Fields: `prefill_cpu_s` (this process's CPU over the prefill forwards, all threads),
    `tpot_cpu_s` (median CPU per decode forward), `prefill_other_cores` / `decode_other_cores`
    (cores other processes kept busy during those forwards). With one thread a forward's CPU time is
    its work: other processes that take the core away lengthen the wall time, not this.

    With references (`Reference`): `prefill_reference` runs after every decoder layer of a prefill
    forward, `decode_reference` after every decode forward, and the fields add `prefill_ref` (the
    prefill in reference units: each layer's CPU over its own reference's, summed, plus the rest
    of the forward over the median reference), `tpot_ref` (median over decode steps of step CPU /
    the next reference's CPU), `ref_prefill_cpu_s` / `ref_decode_cpu_s` (median reference CPU) and
    `ref_prefill_tokens` / `ref_decode_tokens`. Every other field has the references' time taken
    off; `ref_wall(phase)` is their wall time inside the prefill, or inside each decode step, for
    the caller to take off its own clocks.
    """

    def __init__(
        self, model, prefill_reference: Reference | None = None, decode_reference: Reference | None = None
    ):
        self.model = model
        self.prefill_reference, self.decode_reference = prefill_reference, decode_reference
        self.calls: list[_Call] = []
        self._busy = False  # a reference forward is running: every hook stands aside

    def _pre(self, module, args, kwargs) -> None:
        if self._busy:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._tokens = ids.shape[-1] if ids is not None else 0
        self._layers: list[tuple[float, float]] = []
        self._taken = [0.0, 0.0, 0.0]  # reference (wall, cpu, busy) inside this call
        self._start = (time.perf_counter(), time.process_time(), busy_s())

    def _post(self, module, args, kwargs, output) -> None:
        if self._busy:
            return
        t0, c0, b0 = self._start
        tw, tc, tb = self._taken
        wall, own = time.perf_counter() - t0 - tw, time.process_time() - c0 - tc
        other = max(0.0, busy_s() - b0 - tb - own)
        call = _Call(self._tokens, wall, own, other, self._layers, ref_wall=tw)
        self.calls.append(call)
        if self.decode_reference is not None and call.tokens == 1:
            w, c, _ = self._run_reference(self.decode_reference)
            call.ref_wall, call.ref_cpu = w, c

    def _layer_pre(self, module, args, kwargs) -> None:
        if not self._busy and self._tokens > 1:
            self._layer_start = time.process_time()

    def _layer_post(self, module, args, kwargs, output) -> None:
        if self._busy or self._tokens <= 1:
            return
        cpu = time.process_time() - self._layer_start
        w, c, b = self._run_reference(self.prefill_reference)
        self._layers.append((cpu, c))
        self._taken = [self._taken[0] + w, self._taken[1] + c, self._taken[2] + b]

    def _run_reference(self, reference: Reference) -> tuple[float, float, float]:
        self._busy = True
        try:
            return reference.run()
        finally:
            self._busy = False

    def __enter__(self) -> PhaseProbe:
        self._handles = [
            self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.model.register_forward_hook(self._post, with_kwargs=True),
        ]
        if self.prefill_reference is not None:
            layers = getattr(self.model.get_decoder(), "layers", None)
            if layers is None:
                raise ValueError(
                    f"the reference clock needs the decoder's layers; {type(self.model).__name__} has none"
                )
            for layer in layers:
                self._handles.append(layer.register_forward_pre_hook(self._layer_pre, with_kwargs=True))
                self._handles.append(layer.register_forward_hook(self._layer_post, with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def ref_wall(self, phase: str) -> float | list[float]:
        """Reference wall seconds inside the prefill forwards (phase "prefill": one number) or inside
        each decode forward's step, in order (phase "decode": a list)."""
        if phase == "prefill":
            return sum(c.ref_wall for c in self.calls if c.tokens > 1)
        if phase == "decode":
            return [c.ref_wall for c in self.calls if c.tokens == 1]
        raise ValueError(f"phase must be 'prefill' or 'decode', got phase={phase!r}")

    def fields(self) -> dict[str, float | None]:
        pre = [c for c in self.calls if c.tokens > 1]
        dec = [c for c in self.calls if c.tokens == 1]

        def cores(calls) -> float | None:
            wall = sum(c.wall for c in calls)
            return sum(c.other for c in calls) / wall if wall > 0 else None

        tpot = spread(c.own for c in dec)
        out: dict[str, float | None] = {
            "prefill_cpu_s": sum(c.own for c in pre) if pre else None,
            "tpot_cpu_s": tpot.median if tpot else None,
            # The mean step: what a schedule that compresses every N steps costs amortised (the
            # median leaves its compression steps out).
            "tpot_mean_cpu_s": statistics.fmean(c.own for c in dec) if dec else None,
            "prefill_other_cores": cores(pre),
            "decode_other_cores": cores(dec),
        }
        if self.prefill_reference is not None:
            refs = spread(r for c in pre for _, r in c.layers)
            prefill_ref = None
            if pre and refs:
                prefill_ref = sum(
                    sum(cpu / r for cpu, r in c.layers if r > 0)
                    + (c.own - sum(cpu for cpu, _ in c.layers)) / refs.median
                    for c in pre
                )
            out.update(
                prefill_ref=prefill_ref,
                ref_prefill_cpu_s=refs.median if refs else None,
                ref_prefill_tokens=self.prefill_reference.tokens,
            )
        if self.decode_reference is not None:
            ratios = [c.own / c.ref_cpu for c in dec if c.ref_cpu]
            step = spread(ratios)
            refs = spread(c.ref_cpu for c in dec if c.ref_cpu)
            out.update(
                tpot_ref=step.median if step else None,
                tpot_mean_ref=statistics.fmean(ratios) if ratios else None,
                ref_decode_cpu_s=refs.median if refs else None,
                ref_decode_tokens=self.decode_reference.tokens,
            )
        return out
