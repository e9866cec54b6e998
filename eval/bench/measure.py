"""One benchmark configuration, measured in this process; also the worker entry point
(`python -m eval.bench.measure SPEC_JSON`) that `eval.bench.run` starts once per configuration on CPU,
so that peak RSS starts from a fresh process.

Inputs are random token ids (speed does not depend on content); EOS is disabled so every run
decodes `decode_tokens`. An out-of-memory configuration becomes a row with status=oom.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
from typing import Any

import torch

from eval.bench.clock import PhaseProbe, Reference
from eval.machine import CpuNoise, thread_settings
from snapkv import build_method, generate_ids
from snapkv.errors import first_line
from snapkv.kv_quant import KVQuant
from snapkv_models.loading import load_model

log = logging.getLogger(__name__)


def load(model_cfg: dict[str, Any], seed: int):
    """(model, vocab size) from a conf/model node."""
    model, _, _ = load_model(
        model_cfg["name"], model_cfg["dtype"], model_cfg["device"], model_cfg["attn_implementation"], seed
    )
    return model, model.config.get_text_config(decoder=True).vocab_size


def measure(model, vocab: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration `spec` (method, params, input_tokens, batch_size, decode_tokens,
    chunk_size, seed, model, and optionally reference_tokens {prefill: N, decode: M}) on a loaded
    model; returns the result row (timings, memory, KV bytes, noise, thread settings).

    `reference_tokens`: the reference clock (`eval.bench.clock.Reference`, an N-token forward after
    each prefill layer, an M-token one after each decode step; 0 or absent: none), and the row adds
    prefill_ref / tpot_ref and the references' CPU; their wall time is taken off prefill_s, ttft_s
    and each step of tpot_s, so those stay the generation's (what a reference leaves behind, e.g.
    colder caches, is not)."""
    method = build_method(spec["method"], **spec["params"])
    length, batch = spec["input_tokens"], spec["batch_size"]
    gen = torch.Generator().manual_seed(spec["seed"] + length)
    ids = torch.randint(100, vocab, (batch, length), generator=gen)
    # Quantized storage (spec["kv_quant"]: {kind, bits, ...}, the fields of a `KVQuant`) reaches the
    # cache through generation's `kv_quant` option; the plain cache passes nothing, as before the
    # option existed.
    storage = {"kv_quant": KVQuant(**spec["kv_quant"])} if spec.get("kv_quant") else {}
    row: dict[str, Any] = dict(
        method=spec.get("label", spec["method"]),
        budget=method.params().get("budget"),
        batch_size=batch,
        input_tokens=length,
        method_params=json.dumps(method.params(), sort_keys=True),
        kv_quant=json.dumps(spec["kv_quant"], sort_keys=True) if spec.get("kv_quant") else None,
        model=spec["model"]["name"],
        dtype=spec["model"]["dtype"],
        device=str(model.device),
        **thread_settings(),
    )
    ref_tokens = spec.get("reference_tokens") or {}
    refs: dict[str, Reference | None] = {}
    for i, phase in enumerate(("prefill", "decode")):
        n = ref_tokens.get(phase) or 0
        refs[phase] = Reference(model, vocab, n, spec["seed"] + i) if n else None
    try:
        with CpuNoise() as noise, PhaseProbe(model, refs["prefill"], refs["decode"]) as phases:
            _, res = generate_ids(
                model, ids, None, method, max_new_tokens=spec["decode_tokens"], stop_ids=set(),
                chunk_size=spec["chunk_size"], **storage,
            )  # fmt: skip
        row.update(**phases.fields())
        prefill_s, ttft_s, tpot_s = res.prefill_s, res.ttft_s, res.tpot_s
        if refs["prefill"] is not None:
            taken = phases.ref_wall("prefill")
            prefill_s, ttft_s = prefill_s - taken, ttft_s - taken
        if refs["decode"] is not None:
            steps = [s - w for s, w in zip(res.decode_s, phases.ref_wall("decode"), strict=True)]
            tpot_s = statistics.median(steps) if steps else None
        row.update(
            prefill_s=prefill_s,
            ttft_s=ttft_s,
            tpot_s=tpot_s,
            peak_mem_bytes=res.peak_mem_bytes,
            decode_peak_mem_bytes=res.decode_peak_mem_bytes,
            kv_bytes=res.kv_bytes,
            kv_index_bytes=res.kv_index_bytes,
            kv_bytes_full=res.kv_bytes_full,
            kv_tokens=res.kv_tokens,
            attn_impl=res.attn_impl,
            status="ok",
            error=None,
            **noise.fields(),
        )
    except torch.OutOfMemoryError as e:
        row.update(status="oom", error=_first_line(e))
    except RuntimeError as e:
        if "out of memory" not in str(e).lower():
            raise
        row.update(status="oom", error=_first_line(e))
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def _first_line(err: BaseException) -> str:
    return first_line(err)


def worker(spec: dict[str, Any]) -> None:
    """Load the model, measure `spec`, print the row as one `ROW {json}` line on stdout."""
    model, vocab = load(spec["model"], spec["seed"])
    print("ROW " + json.dumps(measure(model, vocab, spec)), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    worker(json.loads(sys.argv[1]))
