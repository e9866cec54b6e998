"""Which prompt positions SnapKV keeps around the needle, per layer, for one real needle prompt.

    python scripts/kept_positions.py [length=2000] [depth=50] [budget=512] [out=results/digits]

One needle prompt (the default magic-number needle, Paul Graham haystack, chat template, the task's
own sizing) is prefilled once per SnapKV configuration (`CONFIGS`: the raw votes without pooling,
the paper's kernel 7 max-pool, wider kernels, OUR `span` variant) with snapkv's public API
(`CompressedCache`, `session`); after prefill every compressible layer's `positions`
`[1, kv_heads, kept]` says which original positions each KV head kept. Written to `out`:

- `kept_positions.csv`: one row per (config, layer, position) for the positions of the needle
  sentence +- `margin` tokens and the last `window + margin` prompt positions; `fraction` = the
  share of the layer's KV heads that kept the position; `digit` (0-6: which digit of the number,
  -1: not a digit), `offset` = position - first digit's position, `region` (needle | end).
- `kept_positions.json`: the prompt (sample id, number, length, digit / needle / window
  positions), the model and every config's method parameters.

Only this analysis locates the needle's digits (character offsets of the number in the prompt,
mapped to tokens by the tokenizer's offsets); the methods never see them. The figure is drawn from
these files by `scripts/make_figures.py` (`eval.analysis.digits`), which never runs a model.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from omegaconf import OmegaConf

from eval.tasks.needle.task import NeedleTask
from snapkv import CompressedCache, build_method
from snapkv.forward import prefill
from snapkv.hooks import session
from snapkv.prompts import encode_prompt
from snapkv_models.loading import load_model

log = logging.getLogger(__name__)

# label -> SnapKV overrides on top of the paper's LongBench setting (window 32, kernel 7, max-pool).
CONFIGS: dict[str, dict[str, Any]] = {
    "votes (no pooling)": dict(pooling="none"),
    "paper: k=7 max": {},
    "k=15": dict(kernel_size=15),
    "k=31": dict(kernel_size=31),
    "ours: k=7 span=8": dict(span=8),
}
DEFAULTS = dict(
    model="smollm2-135m-instruct",
    length=2000,
    depth=50,
    budget=512,
    window=32,
    margin=24,
    seed=42,
    haystack="paul_graham",
    out="results/digits",
)


def digit_token_positions(tokenizer: Any, head_text: str, head_ids: list[int], number: str) -> list[int]:
    """Token positions (in `head_ids`) covering the characters of `number` in `head_text`."""
    enc = tokenizer(head_text, add_special_tokens=False, return_offsets_mapping=True)
    if enc.input_ids != head_ids:
        raise ValueError("re-tokenizing the prompt with offsets gave different ids")
    start = head_text.rfind(number)
    if start < 0:
        raise ValueError(f"number {number!r} not found in the prompt")
    end = start + len(number)
    return [i for i, (a, b) in enumerate(enc.offset_mapping) if a < end and b > start]


def kept_fractions(model: Any, ids: torch.Tensor, method: Any) -> torch.Tensor:
    """Prefill `ids` `[1, L]` with `method`; returns `[layers, L]`: the share of each compressible
    layer's KV heads that kept each position."""
    cache = CompressedCache(model.config, layer_factory=method.cache_layer)
    with torch.no_grad(), session(model, method, cache) as s:
        prefill(model, ids, cache, session=s)
    rows = []
    for _, layer in cache.compressible_layers():
        pos = layer.positions[0]  # [kv_heads, kept]
        mask = torch.zeros(pos.shape[0], ids.shape[1], dtype=torch.bool).scatter_(1, pos.cpu(), True)
        rows.append(mask.float().mean(0))
    return torch.stack(rows)


def compute(cfg: Any, model: Any, tokenizer: Any) -> tuple[pd.DataFrame, dict]:
    task = NeedleTask(
        haystack=cfg.haystack, lengths=[int(cfg.length)], depths=[float(cfg.depth)], seed=int(cfg.seed)
    )
    sample = next(iter(task.samples(tokenizer)))
    head, tail = encode_prompt(tokenizer, sample.context, sample.question, sample.chat_template)
    number = task.cell_number(int(cfg.length), float(cfg.depth))
    head_text = tokenizer.decode(head)
    digits = digit_token_positions(tokenizer, head_text, head, number)
    sentence = tokenizer(sample.extra["needle"], add_special_tokens=False).input_ids
    # The needle sentence: from the tokens before the first digit that the sentence's prefix takes.
    lead = len(tokenizer(sample.extra["needle"].split(number)[0], add_special_tokens=False).input_ids)
    needle = list(range(digits[0] - lead, digits[0] - lead + len(sentence)))
    ids = torch.tensor([head + tail])
    length, window, margin = ids.shape[1], int(cfg.window), int(cfg.margin)
    shown = {
        "needle": range(max(0, needle[0] - margin), min(length, needle[-1] + margin + 1)),
        "end": range(length - window - margin, length),
    }
    frames, params = [], {}
    for label, overrides in CONFIGS.items():
        method = build_method(
            "snapkv", **{"budget": int(cfg.budget), "window": window, "kernel_size": 7, **overrides}
        )
        params[label] = method.params()
        log.info("kept positions: %s", label)
        frac = kept_fractions(model, ids, method)
        for region, cols in shown.items():
            cols = list(cols)
            for layer in range(frac.shape[0]):
                frames.append(
                    pd.DataFrame(
                        {
                            "config": label,
                            "layer": layer,
                            "region": region,
                            "position": cols,
                            "offset": [c - digits[0] for c in cols],
                            "digit": [digits.index(c) if c in digits else -1 for c in cols],
                            "fraction": frac[layer, cols].tolist(),
                        }
                    )
                )
    meta = {
        "model": cfg.model,
        "sample_id": sample.sample_id,
        "number": number,
        "prompt_tokens": length,
        "digit_positions": digits,
        "needle_positions": needle,
        "window_positions": [length - window, length - 1],
        "budget": int(cfg.budget),
        "configs": params,
    }
    return pd.concat(frames, ignore_index=True), meta


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = OmegaConf.from_dotlist(argv)
    unknown = sorted(set(args) - set(DEFAULTS))
    if unknown:
        print(f"error: unknown key {unknown[0]!r}; known: {', '.join(DEFAULTS)}", file=sys.stderr)
        return 2
    cfg = OmegaConf.merge(OmegaConf.create(DEFAULTS), args)

    model, tokenizer, _ = load_model(cfg.model)
    df, meta = compute(cfg, model, tokenizer)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "kept_positions.csv", index=False, float_format="%.4g")
    (out / "kept_positions.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    log.info("wrote %s and %s", out / "kept_positions.csv", out / "kept_positions.json")
    return 0
