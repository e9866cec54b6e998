"""Fidelity numbers on tiny random models (CPU): padded row vs the row alone per method, H2O with
nothing evicted vs the full cache on soft-capped / attention-sink / bf16 models, and the
decode-eviction fields of a short prompt. `python scripts/fidelity_check.py [padded softcap decode]`
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import random_ids, tiny_model  # noqa: E402
from test_padding import LENGTHS, METHODS, NEW, generate, left_padded  # noqa: E402
from test_softcap import sinks_model, softcap_model  # noqa: E402

from snapkv import build_method, generate_ids  # noqa: E402


def padded() -> None:
    model = tiny_model("llama")
    rows = [random_ids(n, seed=i + 1)[0] for i, n in enumerate(LENGTHS)]
    ids, mask = left_padded(rows)
    for name, params in METHODS:
        method = build_method(name, **params)
        tokens, logits = generate(model, method, ids, mask)
        mismatches, diff = 0, 0.0
        for i, row in enumerate(rows):
            alone_tokens, alone_logits = generate(model, method, row[None])
            mismatches += int((alone_tokens[0] != tokens[i]).sum())
            diff = max(diff, float((alone_logits[0] - logits[i]).abs().max()))
        print(f"padded rows {LENGTHS} {name} {params}: token mismatches {mismatches}/{NEW * len(rows)}, "
              f"max |logit diff| {diff:.3g}")  # fmt: skip


def softcap() -> None:
    ids = random_ids(80)
    models = {
        "softcap 5": softcap_model,
        "sinks": sinks_model,
        "bf16": lambda: tiny_model().to(torch.bfloat16),
    }
    for kind, make in models.items():
        model = make()
        _, ref = generate_ids(model, ids, None, build_method("full"), max_new_tokens=6, keep_logits=True)
        for fused in (True, False):
            method = build_method("h2o", budget=100, fused=fused)
            _, res = generate_ids(model, ids, None, method, max_new_tokens=6, keep_logits=True)
            diff = max(float((a - b).abs().max()) for a, b in zip(res.logits, ref.logits))
            print(f"{kind}: h2o fused={fused}, nothing evicted: max |logit diff| vs full {diff:.3g}")


def decode() -> None:
    model = tiny_model("llama")
    for name, params in [("h2o", dict(budget=24)), ("streamingllm", dict(budget=24, n_sink=4))]:
        _, res = generate_ids(model, random_ids(20), None, build_method(name, **params), max_new_tokens=12)
        keys = (
            "input_tokens",
            "compressed",
            "kv_tokens",
            "evicted_during_decode",
            "decode_evicted",
            "kv_tokens_end",
        )
        print(name, {k: res.to_dict()[k] for k in keys})


if __name__ == "__main__":
    for which in sys.argv[1:] or ["padded", "softcap", "decode"]:
        {"padded": padded, "softcap": softcap, "decode": decode}[which]()
