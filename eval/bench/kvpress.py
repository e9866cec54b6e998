"""Decode-step CPU time of this project's caches beside NVIDIA kvpress' on the same prompt, weights
and kept entries, interleaved in one process.

    python scripts/bench_kvpress.py [--model M] [--length 4096] [--budget 512] [--rounds 12]
                                    [--steps 8] [--out CSV]

Three pairs, each side prefilled once from the same token ids (a needle-in-a-haystack prompt built
by `eval.tasks.needle`), then decoded from a fresh copy of its cache in every timed block:

- snapkv: `compress_context(model, ids, build_method("snapkv", budget=B))`, decode steps through
  `snapkv.hooks.session` (phase "decode"), against kvpress' `SnapKVPress` pruned `DynamicCache`
  and plain decode steps (kvpress' own decode loop: explicit `position_ids`, no press);
- streamingllm: ours (`n_sink` sinks + the most recent entries) against `StreamingLLMPress`. Ours
  rolls (one entry evicted per decoded token: B entries attended at every step), kvpress compresses
  once (B + t entries at step t);
- full: ours with `build_method("full")` through the same session path, against a plain
  transformers `DynamicCache` prefilled without a press: the level of the two decode loops.

kvpress keeps `int(n * (1 - compression_ratio))` entries of an n-token prompt; `compression_ratio`
is chosen to keep exactly B and every layer's kept count is checked on both sides after the
prefill (a mismatch stops the run before any timing).

Timing (one thread, `time.process_time()`, so a step's CPU time is its work): each round runs, per
pair, four blocks of `steps` decode steps in the order ours, kvpress, kvpress, ours (A B B A: a
linear drift of the machine cancels); a side's time in a round is the median step over its two
blocks, and the round's ratio is ours / kvpress. Pairs are rotated by one per round. Every round
records the cores other processes kept busy meanwhile (`eval.machine.CpuNoise`). The summary is
the median [Q1, Q3] of the per-round ratios (`eval.stats.spread`). The fed tokens are the greedy
continuation of the prompt on the full cache, the same on both sides.

After the rounds, two blocks of `profile_steps` decode steps of each side (A B B A) run under
cProfile; per Python function, its own time plus that of the torch ops it calls directly (these add
up to the step), the largest differences between the sides are printed (and written beside the
CSV), per step and per decoder layer. cProfile's own per-call cost inflates Python-heavy paths: the
paired ratios are the measurement, the profile says where a difference comes from.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import csv
import gc
import importlib
import importlib.metadata
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.stats import Spread, spread

PAIRS = ("snapkv", "streamingllm", "full")
SKIP_EXIT = 2  # kvpress not importable (also argparse's and the other bench scripts' bad-argument code)
DEFAULT_OUT_DIR = Path("results/bench/kvpress")
# kvpress 0.5.5's SnapKVPress defaults (used on its side), and our SnapKV set to score the same way:
# its window, average pooling of kernel 5, per query head then averaged over the group. With these
# both sides keep the same entries (checked on SmolLM2 at 4096 tokens, budget 512: every layer's
# kept keys equal, first-step logits within 2e-5).
KVPRESS_SNAPKV = {"window_size": 64, "kernel_size": 5}
SNAPKV_AS_KVPRESS = {"window": 64, "kernel_size": 5, "pooling": "avg", "gqa_order": "pool_first"}
CSV_COLUMNS = [
    "round", "pair", "ours_ms", "kvpress_ms", "ratio", "ours_mean_ms", "kvpress_mean_ms", "ratio_mean",
    "steps", "other_cores", "load", "prompt_tokens", "budget", "ours_kept", "kvpress_kept",
    "ours_attended_last", "kvpress_attended_last", "ours_params", "model", "torch", "transformers", "kvpress", "threads",
]  # fmt: skip


# ---- arithmetic (no model, no kvpress) ------------------------------------------------------------


def kvpress_kept(prompt: int, compression_ratio: float) -> int:
    """Entries kvpress' ScorerPress keeps of a `prompt`-entry layer (`kvpress.utils.compute_n_kept`
    in 0.5.5: `int(prompt * (1 - ratio))`, at least 1, 0 at ratio >= 1)."""
    if compression_ratio >= 1.0:
        return 0
    return max(1, int(prompt * (1 - compression_ratio)))


def compression_ratio(prompt: int, budget: int) -> float:
    """The kvpress `compression_ratio` that keeps exactly `budget` of `prompt` entries: the half-entry
    margin keeps float rounding of `prompt * (1 - ratio)` away from the integer boundary."""
    if not isinstance(prompt, int) or not isinstance(budget, int) or not 0 < budget < prompt:
        raise ValueError(f"budget must be an integer in (0, prompt={prompt!r}), got budget={budget!r}")
    ratio = 1.0 - (budget + 0.5) / prompt
    if kvpress_kept(prompt, ratio) != budget:  # cannot happen for integers; kept as the contract
        raise ValueError(f"no compression_ratio keeps budget={budget} of prompt={prompt}")
    return ratio


def block_order(a: str, b: str) -> list[str]:
    """The A B B A order of one pair's blocks in a round."""
    return [a, b, b, a]


def round_ratio(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, float]:
    """One round of a pair from its step times (seconds, both blocks of each side): the median and
    mean step of each side in ms and ours / kvpress of each. ValueError on an empty or non-positive
    side (a ratio would be meaningless)."""
    for name, xs in (("ours", ours), ("kvpress", theirs)):
        if not xs or min(xs) <= 0:
            raise ValueError(f"{name} step times must be non-empty and positive, got {list(xs)!r}")
    om, km = statistics.median(ours), statistics.median(theirs)
    oa, ka = statistics.fmean(ours), statistics.fmean(theirs)
    return dict(
        ours_ms=1000 * om, kvpress_ms=1000 * km, ratio=om / km,
        ours_mean_ms=1000 * oa, kvpress_mean_ms=1000 * ka, ratio_mean=oa / ka,
    )  # fmt: skip


def summarise(rows: Sequence[dict[str, Any]], column: str = "ratio") -> dict[str, Spread]:
    """Per pair, the median [Q1, Q3] of `column` over the rounds (pairs without rows left out)."""
    out = {}
    for pair in dict.fromkeys(r["pair"] for r in rows):
        s = spread(r[column] for r in rows if r["pair"] == pair)
        if s is not None:
            out[pair] = s
    return out


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """The printed table: per pair the median step of each side, the ratio's median [Q1, Q3] (from
    the median steps, and from the mean steps beside it) and the rounds."""
    ratio, mean = summarise(rows, "ratio"), summarise(rows, "ratio_mean")
    lines = [
        f"{'pair':<13} {'ours ms/step':>12} {'kvpress ms/step':>15}  {'ours/kvpress median [Q1, Q3]':<30}"
        f"{'(from means)':<24} {'n':>3}"
    ]
    for pair, s in ratio.items():
        ours = statistics.median(r["ours_ms"] for r in rows if r["pair"] == pair)
        theirs = statistics.median(r["kvpress_ms"] for r in rows if r["pair"] == pair)
        m = mean[pair]
        lines.append(f"{pair:<13} {ours:>12.2f} {theirs:>15.2f}  {_fmt(s):<30}{_fmt(m):<24} {s.n:>3}")
    return "\n".join(lines)


def _fmt(s: Spread) -> str:
    return f"{s.median:.3f} [{s.q1:.3f}, {s.q3:.3f}]"


def write_csv(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """The per-round rows, one per (round, pair)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow(
                {k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items() if k in CSV_COLUMNS}
            )


def kvpress_version() -> str | None:
    """kvpress' version when it imports, else None."""
    try:
        importlib.import_module("kvpress")
    except ImportError:
        return None
    try:
        return importlib.metadata.version("kvpress")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---- the two sides --------------------------------------------------------------------------------


@dataclass
class Side:
    """One side of a pair: its prefilled cache (copied for every block, never decoded itself), the
    entries it kept per KV head in each layer, and how it runs decode steps."""

    pair: str
    who: str  # "ours" | "kvpress"
    cache: Any
    kept: list[int]
    # (cache, tokens) -> (CPU s per step, the last step's logits)
    steps: Callable[[Any, Sequence[int]], tuple[list[float], Any]]
    params: str = ""  # ours: the method's parameters (JSON); kvpress: the press

    def block(self, tokens: Sequence[int]) -> tuple[list[float], Any, Any]:
        """Decode `tokens` from a fresh copy of the prefilled cache (copy and gc off the clock):
        (CPU s per step, last step's logits, the cache after)."""
        cache = copy.deepcopy(self.cache)
        gc.collect()
        times, logits = self.steps(cache, tokens)
        return times, logits, cache


def _ours(model, method):
    import torch

    from snapkv.hooks import session

    def steps(cache, tokens):
        times, out = [], None
        with torch.inference_mode(), session(model, method, cache) as s:
            s.phase = "decode"
            for t in tokens:
                c0 = time.process_time()
                pos = torch.tensor([[cache.get_seq_length()]])
                out = model(input_ids=torch.tensor([[t]]), position_ids=pos, use_cache=True,
                            logits_to_keep=1, past_key_values=cache)  # fmt: skip
                times.append(time.process_time() - c0)
        return times, out.logits[0, -1]

    return steps


def _theirs(model, prompt: int):
    import torch

    def steps(cache, tokens):
        # kvpress' own decode loop (KVPressTextGenerationPipeline.generate_answer): no press,
        # positions continuing from the prompt's length.
        times, out = [], None
        with torch.inference_mode():
            for i, t in enumerate(tokens):
                c0 = time.process_time()
                pos = torch.tensor([[prompt + i]])
                out = model(input_ids=torch.tensor([[t]]), position_ids=pos, use_cache=True,
                            logits_to_keep=1, past_key_values=cache)  # fmt: skip
                times.append(time.process_time() - c0)
        return times, out.logits[0, -1]

    return steps


def prepare(
    model, ids, budget: int, n_sink: int, snapkv_params: dict[str, Any] | None = None
) -> tuple[dict[str, tuple[Side, Side]], Any]:
    """Prefill every side (untimed) and check the kept counts; returns the pairs and the plain full
    cache's last hidden state (for the greedy tokens). `snapkv_params`: our SnapKV's parameters
    beyond the budget (None: its defaults; `SNAPKV_AS_KVPRESS`: kvpress' scoring). RuntimeError when
    a side keeps other than `budget` entries per KV head (the prompt's length for full) in any layer."""
    import torch
    from kvpress import SnapKVPress, StreamingLLMPress
    from transformers import DynamicCache

    from snapkv import build_method, compress_context

    prompt = ids.shape[1]
    n_layers = model.config.num_hidden_layers
    ratio = compression_ratio(prompt, budget)
    methods = {
        "snapkv": (
            build_method("snapkv", budget=budget, **(snapkv_params or {})),
            SnapKVPress(
                compression_ratio=ratio,
                window_size=KVPRESS_SNAPKV["window_size"],
                kernel_size=KVPRESS_SNAPKV["kernel_size"],
            ),
        ),  # fmt: skip
        "streamingllm": (
            build_method("streamingllm", budget=budget, n_sink=n_sink),
            StreamingLLMPress(compression_ratio=ratio, n_sink=n_sink),
        ),
        "full": (build_method("full"), None),
    }
    pairs, hidden = {}, None
    with torch.inference_mode():
        for pair, (method, press) in methods.items():
            ours = compress_context(model, ids, method)
            ours_kept = [int(k) for k in ours.kept_tokens()]
            theirs = DynamicCache()
            if press is None:
                out = model.model(input_ids=ids, past_key_values=theirs)
                hidden = out.last_hidden_state[:, -1]
            else:
                with press(model):  # what KVPressTextGenerationPipeline does for the context
                    model.model(input_ids=ids, past_key_values=theirs)
            theirs_kept = [int(layer.keys.shape[-2]) for layer in theirs.layers]
            want = prompt if press is None else budget
            for who, kept in (("ours", ours_kept), ("kvpress", theirs_kept)):
                if len(kept) != n_layers or any(k != want for k in kept):
                    raise RuntimeError(
                        f"{pair}: {who} kept {sorted(set(kept))} entries per KV head over {len(kept)} "
                        f"layers, not {want} in each of {n_layers}: the sides are not comparable"
                    )
            pairs[pair] = (
                Side(
                    pair,
                    "ours",
                    ours,
                    ours_kept,
                    _ours(model, method),
                    json.dumps(method.params(), sort_keys=True),
                ),
                Side(pair, "kvpress", theirs, theirs_kept, _theirs(model, prompt), repr(press)),
            )
    return pairs, hidden


def greedy_tokens(model, full: Side, hidden, n: int) -> list[int]:
    """The greedy continuation of the prompt, `n` tokens, on the plain full cache (untimed)."""
    import torch

    with torch.inference_mode():
        tokens = [int(model.lm_head(hidden).argmax(-1)[0])]
        cache = copy.deepcopy(full.cache)
        prompt = cache.get_seq_length()
        while len(tokens) < n:
            pos = torch.tensor([[prompt + len(tokens) - 1]])
            out = model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=pos, use_cache=True,
                        logits_to_keep=1, past_key_values=cache)  # fmt: skip
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def agreement(pairs: dict[str, tuple[Side, Side]], tokens: Sequence[int]) -> list[str]:
    """Per pair, one decode step of each side from the prefilled cache: top-1 agreement and the largest
    logit difference, and the entries each attended at the last step of a block."""
    lines = []
    for pair, (ours, theirs) in pairs.items():
        _, lo, _ = ours.block(tokens[:1])
        _, lk, _ = theirs.block(tokens[:1])
        same = int(lo.argmax()) == int(lk.argmax())
        diff = float((lo - lk).abs().max())
        lines.append(
            f"{pair}: first step top-1 {'agrees' if same else 'DIFFERS'}, max |logit diff| {diff:.2e}"
        )
    return lines


def attended_after(side: Side, tokens: Sequence[int]) -> int:
    """Entries per KV head the side's first layer holds after a block of `tokens` (what the next step
    attends to)."""
    _, _, cache = side.block(tokens)
    layer = cache.layers[0]
    return int(layer.keys.shape[-2])


def run_rounds(
    pairs: dict[str, tuple[Side, Side]], tokens: Sequence[int], rounds: int, log: Callable[[str], None]
) -> list[dict[str, Any]]:
    """The interleaved rounds (module doc); one row per (round, pair)."""
    from eval.machine import CpuNoise

    names = list(pairs)
    rows = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for pair in order:
            sides = dict(zip(("ours", "kvpress"), pairs[pair]))
            times: dict[str, list[float]] = {"ours": [], "kvpress": []}
            with CpuNoise() as noise:
                for who in block_order("ours", "kvpress"):
                    times[who] += sides[who].block(tokens)[0]
            row = dict(round=r + 1, pair=pair, steps=len(tokens), other_cores=noise.other_cores,
                       load=noise.load_end, **round_ratio(times["ours"], times["kvpress"]))  # fmt: skip
            rows.append(row)
            log(f"round {r + 1:>2} {pair:<12} ours {row['ours_ms']:7.2f} ms  kvpress {row['kvpress_ms']:7.2f} ms"
                f"  ratio {row['ratio']:.3f}  other cores {noise.other_cores:.2f}")  # fmt: skip
    return rows


# ---- profile ----------------------------------------------------------------------------------------


def _profile(
    side: Side, tokens: Sequence[int]
) -> tuple[float, dict[tuple[str, int, str], tuple[float, int]]]:
    """One block of `tokens` under cProfile: (CPU s of the block, per Python function (short file,
    line, name): (its own time plus that of the builtins it called directly, calls)). The per-function
    times add up to the block's: a difference between two sides is where it is spent, counted once."""
    cache = copy.deepcopy(side.cache)
    gc.collect()
    prof = cProfile.Profile(time.process_time)
    prof.enable()
    side.steps(cache, tokens)
    prof.disable()
    stats = pstats.Stats(prof).stats
    own: dict[tuple[str, int, str], tuple[float, int]] = {}

    def add(func, t: float, calls: int) -> None:
        key = (_short(func[0]), func[1], func[2])
        s, n = own.get(key, (0.0, 0))
        own[key] = (s + t, n + calls)

    for func, (_cc, nc, tt, _ct, callers) in stats.items():
        if func[0] == "~" and callers:  # a builtin (torch op): its time goes to the Python caller
            for caller, (_ccc, _ncc, ctt, _cct) in callers.items():
                add(caller, ctt, 0)
        else:
            add(func, tt, nc)
    return sum(tt for _cc, _nc, tt, _ct, _callers in stats.values()), own


def _short(file: str) -> str:
    for root in ("snapkv", "transformers", "kvpress", "torch", "eval"):
        marker = f"{os.sep}{root}{os.sep}"
        if marker in file:
            return root + os.sep + file.split(marker, 1)[1]
    return file if file.startswith("<") or file == "~" else Path(file).name


def profile_diff(ours: Side, theirs: Side, tokens: Sequence[int], n_layers: int, top: int = 12) -> str:
    """Where the two sides' decode steps differ (cProfile, blocks of `tokens` in the order ours,
    kvpress, kvpress, ours): per Python function, its own CPU time plus that of the torch ops it
    calls directly, in µs per step and per decoder layer, the largest differences first."""
    totals: dict[str, float] = {"ours": 0.0, "kvpress": 0.0}
    funcs: dict[str, dict[tuple[str, int, str], tuple[float, int]]] = {"ours": {}, "kvpress": {}}
    sides = {"ours": ours, "kvpress": theirs}
    for who in block_order("ours", "kvpress"):
        total, own = _profile(sides[who], tokens)
        totals[who] += total
        for key, (t, c) in own.items():
            s, k = funcs[who].get(key, (0.0, 0))
            funcs[who][key] = (s + t, k + c)
    (ta, a), (tb, b) = (totals["ours"], funcs["ours"]), (totals["kvpress"], funcs["kvpress"])
    n = 2 * len(tokens)
    rows = []
    for key in a.keys() | b.keys():
        sa, ca = a.get(key, (0.0, 0))
        sb, cb = b.get(key, (0.0, 0))
        rows.append((sa - sb, key, sa, sb, ca, cb))
    rows.sort(key=lambda x: -abs(x[0]))
    us = 1e6 / n
    lines = [
        f"{ours.pair}: a step under cProfile: ours {ta * us:.0f} µs, kvpress {tb * us:.0f} µs "
        f"(diff {(ta - tb) * us:+.0f} µs/step, {(ta - tb) * us / n_layers:+.1f} µs/layer)",
        f"  {'function (own time + torch ops it calls)':<58} {'ours µs/step':>12} {'kvpress':>9} {'diff':>7} "
        f"{'diff/layer':>10} {'calls/step o|k':>15}",
    ]
    for d, (file, line, name), sa, sb, ca, cb in rows[:top]:
        label = f"{file}:{line}:{name}"[-58:]
        lines.append(f"  {label:<58} {sa * us:>12.0f} {sb * us:>9.0f} {d * us:>+7.0f} "
                     f"{d * us / n_layers:>+10.1f} {ca / n:>7.0f}|{cb / n:<7.0f}")  # fmt: skip
    shown = sum(r[0] for r in rows[:top])
    lines.append(f"  (the {top} rows above: {shown * us:+.0f} µs/step of the {(ta - tb) * us:+.0f})")
    return "\n".join(lines)


# ---- the script ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_kvpress.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--length", type=int, default=4096, help="prompt tokens (needle task, noise haystack)")
    p.add_argument("--budget", type=int, default=512, help="entries kept per KV head")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=8, help="decode steps per block")
    p.add_argument("--n-sink", type=int, default=4, help="StreamingLLM's sink tokens (both sides)")
    p.add_argument(
        "--snapkv-as-kvpress",
        action="store_true",
        help="our SnapKV scores like kvpress' (window 64, avg-pool 5, pooled per query head)",
    )
    p.add_argument("--haystack", default="noise", help="the needle task's haystack (noise: offline)")
    p.add_argument("--profile-steps", type=int, default=8, help="decode steps profiled per side (0: none)")
    p.add_argument(
        "--out", type=Path, default=None, help=f"CSV of per-round rows (default under {DEFAULT_OUT_DIR}/)"
    )
    args = p.parse_args(list(argv))
    for name in ("length", "budget", "rounds", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be a positive integer, got {name}={getattr(args, name)}")
    if args.budget >= args.length:
        raise ValueError(f"--budget must be below --length={args.length}, got budget={args.budget}")
    if not 0 <= args.n_sink < args.budget:
        raise ValueError(f"--n-sink must be in [0, budget={args.budget}), got n_sink={args.n_sink}")
    if args.profile_steps < 0:
        raise ValueError(f"--profile-steps must be >= 0, got profile_steps={args.profile_steps}")
    if args.out is None:
        args.out = DEFAULT_OUT_DIR / f"{args.model}_{args.length}_b{args.budget}.csv"
    return args


def needle_ids(tokenizer, length: int, haystack: str):
    """Token ids `[1, n]` of a needle-in-a-haystack prompt of about `length` tokens (depth 50%), as
    the needle task builds and the runner tokenizes it."""
    import torch

    from eval.tasks.needle.task import NeedleTask
    from snapkv.prompts import prompt_token_ids

    sample = next(iter(NeedleTask(haystack=haystack, lengths=[length], depths=[50.0]).samples(tokenizer)))
    return torch.tensor([prompt_token_ids(tokenizer, sample.prompt, sample.chat_template)])


def main(argv: Sequence[str] | None = None) -> int:
    """The benchmark: 0 after a run, 2 when kvpress is not importable or an argument is bad, 1 when
    the two sides do not keep the same entries (nothing is reported then)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    version = kvpress_version()
    if version is None:
        print("skipped: kvpress is not importable (pip install kvpress==0.5.5 in an environment with a "
              "transformers it supports)", file=sys.stderr)  # fmt: skip
        return SKIP_EXIT

    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    from snapkv import build_method
    from snapkv_models.loading import load_model

    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    model, tokenizer, _ = load_model(args.model, dtype="float32", device="cpu", attn_implementation="sdpa")
    ids = needle_ids(tokenizer, args.length, args.haystack)
    prompt = ids.shape[1]
    n_layers = model.config.num_hidden_layers
    say = lambda s="": print(s, flush=True)  # noqa: E731
    say(f"kvpress {version} | torch {torch.__version__} | transformers {transformers.__version__} | "
        f"python {platform.python_version()} | {args.model} fp32 sdpa, {n_layers} layers | 1 thread")  # fmt: skip
    say(f"prompt: needle task ({args.haystack} haystack, depth 50%), {prompt} tokens, the same ids on both "
        f"sides; budget {args.budget} entries per KV head; kvpress compression_ratio "
        f"{compression_ratio(prompt, args.budget):.6f}")  # fmt: skip
    snapkv_params = SNAPKV_AS_KVPRESS if args.snapkv_as_kvpress else {}
    say(f"ours snapkv: {build_method('snapkv', budget=args.budget, **snapkv_params).params()}; kvpress "
        f"SnapKVPress: {KVPRESS_SNAPKV}; streamingllm n_sink {args.n_sink} both sides")  # fmt: skip
    try:
        pairs, hidden = prepare(model, ids, args.budget, args.n_sink, snapkv_params)
    except RuntimeError as err:
        print(f"refused: {err}", file=sys.stderr)
        return 1
    tokens = greedy_tokens(model, pairs["full"][1], hidden, args.steps)
    say("kept after prefill (per KV head, every layer): "
        + "; ".join(f"{p} ours {o.kept[0]} kvpress {k.kept[0]}" for p, (o, k) in pairs.items()))  # fmt: skip
    attended = {p: (attended_after(o, tokens), attended_after(k, tokens)) for p, (o, k) in pairs.items()}
    say(f"entries after a block of {args.steps} steps: "
        + "; ".join(f"{p} ours {a} kvpress {b}" for p, (a, b) in attended.items()))  # fmt: skip
    say("note: ours streamingllm rolls (evicts one entry per decoded token), kvpress' compresses once "
        "and its cache grows while decoding")  # fmt: skip
    for line in agreement(pairs, tokens):
        say(line)
    say(f"fed tokens (greedy on the full cache): {tokenizer.decode(tokens)!r}")
    say(f"\n{args.rounds} rounds, per pair blocks ours kvpress kvpress ours of {args.steps} steps, "
        "CPU time (process_time), pairs rotated per round")  # fmt: skip
    rows = run_rounds(pairs, tokens, args.rounds, say)
    meta = dict(prompt_tokens=prompt, budget=args.budget, model=args.model, torch=torch.__version__,
                transformers=transformers.__version__, kvpress=version, threads=torch.get_num_threads())  # fmt: skip
    for r in rows:
        o, k = pairs[r["pair"]]
        r.update(meta, ours_kept=o.kept[0], kvpress_kept=k.kept[0], ours_params=o.params,
                 ours_attended_last=attended[r["pair"]][0], kvpress_attended_last=attended[r["pair"]][1])  # fmt: skip
    write_csv(rows, args.out)
    say(f"\nwrote {args.out}\n")
    say(summary_table(rows))
    others = spread(r["other_cores"] for r in rows)
    if others is not None:
        say(f"other processes kept {_fmt(others)} cores busy (median [Q1, Q3] over the pairs' rounds)")
    if args.profile_steps:
        text = io.StringIO()
        prof_tokens = greedy_tokens(model, pairs["full"][1], hidden, args.profile_steps)
        for ours, theirs in pairs.values():
            text.write(profile_diff(ours, theirs, prof_tokens, n_layers) + "\n\n")
        path = args.out.with_suffix(".profile.txt")
        path.write_text(text.getvalue())
        say(f"\ncProfile, 2 x {args.profile_steps} decode steps a side (per step; per layer = / {n_layers}); "
            f"wrote {path}\n")  # fmt: skip
        say(text.getvalue().rstrip())
    return 0
