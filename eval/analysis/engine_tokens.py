"""Greedy-token parity of an engine's full cache with the harness' on a run's real prompts: per
prompt, the engine's greedy tokens against the transformers path's (`snapkv.generate_ids`, the
harness' own decoding), identical or the first new token where they differ with the harness' logit
margin there (`eval.engines.parity.first_divergence`: near 0 a tie float rounding may flip, large a
real difference). Both decode every `new_tokens` tokens (no stop), so a difference after an answer's
end counts too.

    python scripts/engine_tokens.py experiment=engine_parity model=qwen2.5-coder-0.5b-instruct \\
        engine.weights=f16 new_tokens=32 out=results/serving/parity/tokens_qwen.csv

The Hydra overrides pick the task, its prompts and the model as `run.py` does (any `engine.*` key
sets the engine's options; the method is the full cache on both sides).
"""

from __future__ import annotations

import csv
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml
from hydra import compose, initialize_config_dir

from eval.conf import CONF_DIR
from eval.engines import build_engine
from eval.engines.parity import Divergence, first_divergence
from eval.runner import get_model
from eval.spec import RunSpec
from snapkv import build_method, generate_ids
from snapkv.errors import first_line
from snapkv.prompts import prompt_token_ids

logger = logging.getLogger(__name__)

COLUMNS = [
    "model",
    "weights",
    "sample_id",
    "input_tokens",
    "new_tokens",
    "identical",
    "step",
    "reference",
    "engine",
    "margin",
]


def token_parity(model: Any, engine: Any, prompts: Sequence[list[int]], new_tokens: int) -> list[Divergence | None]:  # fmt: skip
    """For each prompt's ids, None when the engine's `new_tokens` greedy tokens equal the model's
    (transformers, full cache), else their first divergence. `engine`: a loaded full-cache engine."""
    out = []
    for ids in prompts:
        ref, result = generate_ids(
            model,
            torch.tensor([ids]),
            None,
            build_method("full"),
            max_new_tokens=new_tokens,
            keep_logits=True,
        )
        got = engine.generate(list(ids), new_tokens, set())
        out.append(first_divergence(ref[0].tolist(), got.ids, [x[0] for x in result.logits]))
    return out


def split(argv: Sequence[str]) -> tuple[list[str], dict[str, str], int, str | None]:
    """(Hydra overrides, engine options, new_tokens, out) from `key=value` arguments."""
    overrides, engine, new_tokens, out = [], {}, 32, None
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ValueError(f"arguments are key=value, got {arg!r}")
        if key == "new_tokens":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"new_tokens must be a positive integer, got new_tokens={value}")
            new_tokens = int(value)
        elif key == "out":
            out = value
        elif key.startswith("engine."):
            engine[key.removeprefix("engine.")] = value
        else:
            overrides.append(arg)
    return overrides, engine, new_tokens, out


def _value(text: str) -> Any:
    """An engine option's value as a Hydra override reads it (YAML: 1 an int, null None, f16 a string)."""
    return yaml.safe_load(text)


def main(argv: Sequence[str]) -> int:
    try:
        overrides, options, new_tokens, out = split(argv)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*overrides, "method=full", "engine=transformers"])
        spec = RunSpec.from_config(cfg)
        engine_node = {"name": "openvino", **{k: _value(v) for k, v in options.items()}}
        engine = build_engine(engine_node, build_method("full"))
        engine.check_model(spec.model.name)
    except ValueError as err:  # bad input: one line, before anything loads
        print(f"error: {first_line(err)}", file=sys.stderr)
        return 2
    model, tokenizer, _ = get_model(spec)
    engine.load(spec.model.name)
    samples = list(spec.task.samples(tokenizer))
    prompts = [prompt_token_ids(tokenizer, s.prompt, s.chat_template) for s in samples]
    rows = []
    for sample, ids in zip(samples, prompts):
        (div,) = token_parity(model, engine, [ids], new_tokens)
        row = dict(
            sample_id=sample.sample_id, input_tokens=len(ids), new_tokens=new_tokens, identical=div is None
        )
        if div is not None:
            row.update(step=div.step, reference=div.reference, engine=div.engine, margin=div.margin)
        rows.append(row)
        print(f"{sample.sample_id}: " + ("identical" if div is None else div.text()), flush=True)
    same = sum(r["identical"] for r in rows)
    print(f"\n{spec.model.key}, {engine.identity()['weights']} weights: greedy tokens identical on {same} of {len(rows)} prompts ({new_tokens} new tokens each)")  # fmt: skip
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(
                {**r, "model": spec.model.key, "weights": engine.identity()["weights"]} for r in rows
            )
        print(f"wrote {out}")
    return 0
