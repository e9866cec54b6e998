"""Quantized storage (`snapkv.kv_quant`) through the compressed cache: transformers' own
`QuantizedCache` as the reference for quanto / hqq, checkpoint / rollback, bytes, and the
combinations refused."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from transformers import DynamicCache, QuantizedCache

from eval import runner
from eval.compare import compare_configs
from eval.conf import options
from eval.report.build import prepare
from eval.spec import RunSpec
from eval.store import read_rows
from snapkv import answer, build_method, compress_context, generate_ids
from snapkv.cache import CompressedCache
from snapkv.kv_quant import KVQuant, kivi_bytes, quantized_nbytes
from tests.conftest import random_ids, tiny_model
from tests.methods.test_kivi import naive_kcache, naive_vcache
from tests.reference import naive_snapkv_selection
from tests.test_configs import compose_cfg
from tests.test_runner import _no_model_load, make_cfg, result_files, run_cli_in_process, save_tiny_model

ROOT = Path(__file__).resolve().parents[1]

BACKENDS = [
    pytest.param(
        "quanto",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("optimum") is None, reason="optimum-quanto is not installed"
        ),
    ),
    pytest.param(
        "hqq",
        marks=pytest.mark.skipif(importlib.util.find_spec("hqq") is None, reason="hqq is not installed"),
    ),
]


def grab(store: dict, name: str):
    return lambda cache: store.__setitem__(name, cache)


@pytest.mark.parametrize("kind", BACKENDS)
def test_full_cache_equals_transformers_quantized_cache(kind):
    """method=full with kv_quant=quanto|hqq: the greedy tokens of transformers' `generate` on its
    own `QuantizedCache`, and the same keys / values read back at the end (residual 4 with 11 new
    tokens: several re-quantizations)."""
    model, ids = tiny_model("llama"), random_ids(40)
    quant = KVQuant(kind=kind, bits=4, group_size=16, residual=4)
    ref_cache = QuantizedCache(kind, model.config, nbits=4, q_group_size=16, residual_length=4)
    with torch.inference_mode():
        want = model.generate(
            ids, past_key_values=ref_cache, max_new_tokens=12, do_sample=False, min_new_tokens=12
        )[:, ids.shape[1] :]
    caches = {}
    got, res = generate_ids(
        model,
        ids,
        method=build_method("full"),
        max_new_tokens=12,
        kv_quant=quant,
        on_compressed=grab(caches, "q"),
    )
    assert torch.equal(got, want)
    for (_, layer), ref in zip(caches["q"].compressible_layers(), ref_cache.layers):
        layer.quantize_residual()
        keys = torch.cat([ref._dequantize(ref._quantized_keys), ref.keys], dim=-2)
        values = torch.cat([ref._dequantize(ref._quantized_values), ref.values], dim=-2)
        # ours holds the last generated token too (fed by no forward in either): compare the rest
        n = keys.shape[-2]
        torch.testing.assert_close(layer.keys[:, :, :n], keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(layer.values[:, :, :n], values, rtol=0, atol=1e-6)
    # after the prefill: the prompt quantized whole, as transformers' prefill stores it (codes,
    # scales and zero points of its own quantized tensors), no residual
    prompt_cache = QuantizedCache(kind, model.config, nbits=4, q_group_size=16, residual_length=4)
    with torch.inference_mode():
        model(ids, past_key_values=prompt_cache)
    stored = [
        quantized_nbytes(t) for r in prompt_cache.layers for t in (r._quantized_keys, r._quantized_values)
    ]
    assert res.kv_bytes == sum(stored) == res.kv_bytes_full / 4  # 4-bit codes + fp32 scale, zero per 16


@pytest.mark.parametrize("packed", [True, False])
def test_rollback_restores_the_quantized_storage(packed):
    """A question fed after the checkpoint flushes the residual (packed: into new packs; else
    entries rewritten in place); the rollback returns keys, values and the quantized counts to the
    mark, and the same question then gives the same logits."""
    model, ids = tiny_model("qwen2"), random_ids(50)
    method = build_method("snapkv", budget=30, window=4)
    quant = KVQuant(bits=2, group_size=4, residual=8, packed=packed)
    cache = compress_context(model, ids, method, kv_quant=quant)
    cache.checkpoint()
    layers = [layer for _, layer in cache.compressible_layers()]
    marked = [
        (layer.keys.clone(), layer.values.clone(), layer.quant_keys, layer.quant_values) for layer in layers
    ]
    stored = sum(layer.stored_bytes() for layer in layers)
    assert all(m[2] == 24 and m[3] == 22 for m in marked)
    question = random_ids(12, seed=5)
    first = answer(model, cache, question, method, max_new_tokens=12, keep_logits=True)
    assert all(layer.quant_keys == 24 for layer in layers)
    for layer, (k, v, qk, qv) in zip(layers, marked):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        assert (layer.quant_keys, layer.quant_values) == (qk, qv)
    again = answer(model, cache, question, method, max_new_tokens=12, keep_logits=True)
    assert torch.equal(first.ids, again.ids)
    if packed:  # the flush built new packs and residuals: the mark holds the marked ones, positions
        assert first.rollback_bytes == again.rollback_bytes == stored + 3 * 30 * 2 * 8
    else:  # quantizing the residual rewrote marked entries: the mark copied keys, values, positions
        assert first.rollback_bytes == again.rollback_bytes == 3 * (2 * 30 * 32 * 4 + 30 * 2 * 8)
    for a, b in zip(first.logits, again.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kv_bytes_count_codes_scales_zero_points_and_residual():
    model, ids = tiny_model("llama"), random_ids(50)
    quant = KVQuant(kind="kivi", bits=4, group_size=4, residual=8)
    cache = compress_context(model, ids, build_method("snapkv", budget=30, window=4), kv_quant=quant)
    b, h, d = 1, 2, 16
    per_layer = kivi_bytes((b, h, d), 24, 22, quant, 4) + (30 - 24 + 30 - 22) * b * h * d * 4
    # codes: 46 entries x 32 values x 4 bits; scale + min: 6 key groups x 32 channels, 22 values x 8
    assert per_layer == 46 * 32 // 2 + 2 * (6 * 32 + 22 * 8) * 4 + 14 * 32 * 4
    assert cache.kv_bytes() == cache.kv_bytes_logical() == 3 * per_layer
    assert cache.kv_bytes_full() == 3 * 2 * 50 * 32 * 4


@pytest.mark.parametrize(
    "name, params, says",
    [
        ("h2o", {"budget": 20, "evict_during_decode": True}, "method=h2o evicts while decoding"),
        ("streamingllm", {"budget": 20}, "method=streamingllm evicts while decoding"),
        ("snapkv", {"budget": 20, "window": 4, "decode_schedule": {"interval": 8}}, "evicts while decoding"),
        ("kvzip", {"budget": 20}, "per-head storage, which method=kvzip"),
        ("adakv", {"budget": 20, "window": 4}, "per-head storage, which method=adakv"),
    ],
)
def test_unsupported_methods_are_refused_before_the_model_runs(name, params, says):
    model, ids = tiny_model("llama"), random_ids(40)
    quant = KVQuant(group_size=4, residual=8)
    with pytest.raises(ValueError, match=says):
        generate_ids(model, ids, method=build_method(name, **params), max_new_tokens=4, kv_quant=quant)
    with pytest.raises(ValueError, match=says):
        compress_context(model, ids, build_method(name, **params), kv_quant=quant)


def test_pruning_quantized_entries_is_refused():
    """The layer itself refuses to prune entries it already quantized (what `check_method` keeps
    every method from reaching)."""
    model, ids = tiny_model("llama"), random_ids(40)
    cache = compress_context(
        model, ids, build_method("snapkv", budget=30, window=4), kv_quant=KVQuant(group_size=4, residual=8)
    )
    _, layer = cache.compressible_layers()[0]
    layer.quantize_residual()
    with pytest.raises(ValueError, match="prunes before quantizing"):
        layer.keep(torch.arange(20).expand(1, 2, 20))


def test_padded_batch_is_refused():
    """Refused when the prefill ends (before any token is generated from it)."""
    model = tiny_model("llama")
    ids = random_ids(30, batch=2)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with pytest.raises(ValueError, match="left-padded"):
        compress_context(
            model,
            ids,
            build_method("snapkv", budget=20, window=4),
            attention_mask=mask,
            kv_quant=KVQuant(group_size=4, residual=8),
        )


@pytest.mark.parametrize(
    "field, value",
    [
        ("kind", "int3"),
        ("bits", 3),
        ("group_size", 0),
        ("residual", -1),
        ("residual", 6),
        ("order", "x"),
        ("packed", "yes"),
    ],  # fmt: skip
)
def test_bad_values_name_themselves(field, value):
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        KVQuant(**{"group_size": 4, "residual": 8, field: value})


# ---- the harness: config group, hash, rows, refusals before the model loads -----------------------
COMMITTED = ROOT / "results/needle_budget/needle/smollm2-135m-instruct/snapkv-d69f199c.jsonl"


def test_committed_rows_keep_their_hash_without_kv_quant():
    """kv_quant=none (the default, or named) leaves the config hash of an existing committed row."""
    row = json.loads(COMMITTED.read_text().splitlines()[0])
    for overrides in ([], ["kv_quant=none"]):
        assert RunSpec.from_config(compose_cfg(overrides)).method_hash == row["method_hash"]
    assert "kv_quant" not in row


def test_kv_quant_enters_the_hash_and_the_label():
    specs = {
        ov: RunSpec.from_config(compose_cfg(["kv_quant=kivi", *ov]))
        for ov in ((), ("kv_quant.bits=2",), ("kv_quant.residual=64",))
    }
    plain = RunSpec.from_config(compose_cfg([]))
    hashes = {s.method_hash for s in specs.values()} | {plain.method_hash}
    assert len(hashes) == 4
    assert specs[()].kv_quant == KVQuant(kind="kivi", bits=4, group_size=32, residual=128)
    # packed storage (the default) is not part of the hash: configs hash as before it existed; the
    # reference storage of read-back values is a config of its own
    assert list(specs[()].kv_quant.to_dict()) == ["kind", "bits", "group_size", "residual", "order"]
    reference = RunSpec.from_config(compose_cfg(["kv_quant=kivi", "+kv_quant.packed=false"]))
    assert reference.kv_quant.packed is False and reference.kv_quant.to_dict()["packed"] is False
    assert reference.method_hash not in hashes
    assert runner._label(specs[()]) == "snapkv b=512 w=32 k=7 max kivi4"
    assert runner._label(specs[("kv_quant.residual=64",)]).endswith(" kivi4 r=64")
    assert runner._label(plain) == "snapkv b=512 w=32 k=7 max"


def test_compare_baselines_run_unquantized():
    configs = compare_configs(compose_cfg(["kv_quant=kivi"]))
    specs = [RunSpec.from_config(c) for c in configs]
    assert [s.method.name for s in specs] == ["snapkv", "full", "streamingllm"]
    assert specs[0].kv_quant is not None and all(s.kv_quant is None for s in specs[1:])


REFUSED = {
    "decode-time eviction": (["method=h2o", "kv_quant=kivi"], "method=h2o evicts while decoding"),
    "rolling window": (["method=streamingllm", "kv_quant=kivi"], "method=streamingllm evicts while decoding"),
    "per-head storage": (["method=adakv", "kv_quant=quanto"], "per-head storage, which method=adakv"),
    "non-generating task": (["task=fidelity", "kv_quant=kivi"], "kv_quant=kivi is not supported with task"),
    "bad bits": (["kv_quant=quanto", "kv_quant.bits=8"], "bits=8"),
    "unknown kind": (["kv_quant=kivi", "kv_quant.kind=int4"], "kind='int4'"),
    "options without a kind": (["+kv_quant.bits=2"], "kv_quant.bits needs a quantized storage"),
    "unknown option": (["kv_quant=int4"], "unknown kv_quant 'int4'; known: hqq, kivi, none, quanto"),
    "unknown key": (
        ["kv_quant=kivi", "kv_quant.bitz=2"],
        "unknown config key 'kv_quant.bitz'; known keys of",
    ),
    "key of none": (["kv_quant.bits=2"], "unknown config key 'kv_quant.bits'; known keys of kv_quant: kind"),
}


@pytest.mark.parametrize("name", options("kv_quant"))
def test_every_kv_quant_config_builds(name):
    spec = RunSpec.from_config(compose_cfg([f"kv_quant={name}"]))
    assert (spec.kv_quant is None) == (name == "none")
    if spec.kv_quant is not None:
        assert spec.kv_quant.kind == name and spec.kv_quant.order == "score_then_quantize"


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_combinations_exit_2_before_the_model_loads(case, monkeypatch, tmp_path, capsys):
    args, expected = REFUSED[case]
    monkeypatch.setattr(runner, "load_model", _no_model_load)
    code = run_cli_in_process(monkeypatch, tmp_path, f"results_dir={tmp_path}/results", *args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert expected in err[0]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


def test_run_rows_carry_kv_quant_and_its_bytes(tiny_dir, tmp_path):
    """A needle run with snapkv + KIVI: the rows name the storage, count its bytes (below the same
    run's at the model's dtype) and are in a file of their own."""
    results = tmp_path / "results"
    quant = ["kv_quant=kivi", "kv_quant.group_size=4", "kv_quant.residual=8", "compare=[]"]
    runner.run(make_cfg(tiny_dir, results, *quant))
    runner.run(make_cfg(tiny_dir, results, "compare=[]"))
    rows = {}
    for path in result_files(results):
        for row in read_rows(path):
            rows.setdefault("kv_quant" in row, []).append(row)
    (q, *_), (plain, *_) = (
        sorted(rows[True], key=lambda r: r["sample_id"]),
        sorted(rows[False], key=lambda r: r["sample_id"]),
    )
    assert q["kv_quant"] == {
        "kind": "kivi",
        "bits": 4,
        "group_size": 4,
        "residual": 8,
        "order": "score_then_quantize",
    }
    assert q["status"] == "ok" and q["method_hash"] != plain["method_hash"]
    assert q["kv_tokens"] == plain["kv_tokens"] and q["kv_bytes_full"] == plain["kv_bytes_full"]
    # 2 layers of 64 entries (1 row, 2 KV heads, head_dim 16, fp32): keys all quantized, values but
    # the newest 8
    assert q["kv_tokens"] == 64
    quantized = kivi_bytes((1, 2, 16), 64, 56, KVQuant(group_size=4, residual=8), 4) + 8 * 32 * 4
    assert q["kv_bytes"] == q["kv_bytes_logical"] == 2 * quantized < plain["kv_bytes"]
    # beside them, the kept entries' positions (int64 per entry and KV head), either storage
    assert q["kv_index_bytes"] == plain["kv_index_bytes"] == 2 * 2 * 64 * 8
    # the report names the storage: its rows are not the unquantized config's
    df = prepare(pd.DataFrame(rows[True] + rows[False]))
    assert set(df["label"]) == {"snapkv b=64 w=32 k=7 max kivi4 g=4 r=8", "snapkv b=64 w=32 k=7 max"}


@pytest.mark.parametrize(
    "overrides",
    [
        ["protocol=context_only"],
        ["protocol=multi_request", "task.needles=2"],
        ["protocol=first_question", "task.needles=2"],
        ["protocol=multi_turn", "task.needles=2"],
        ["generation.do_sample=true", "generation.samples_per_prompt=2"],
    ],
    ids=lambda o: o[0].split("=")[1] if o[0].startswith("protocol") else "sampling",
)
def test_every_protocol_runs_with_kv_quant(tiny_dir, tmp_path, overrides):
    results = tmp_path / "results"
    quant = ["kv_quant=kivi", "kv_quant.group_size=4", "kv_quant.residual=8", "compare=[]"]
    grid = ["task.lengths=[300]", "task.depths=[50]"]
    runner.run(make_cfg(tiny_dir, results, *quant, *grid, *overrides))
    rows = [row for path in result_files(results) for row in read_rows(path)]
    assert rows and all(r["status"] == "ok" and r["kv_quant"]["kind"] == "kivi" for r in rows), rows
    assert all(r["kv_bytes"] < r["kv_bytes_full"] for r in rows)


# ---- order=dequant_prune_requant: kvpress' order on transformers' QuantizedCache -----------------
def _kivi_read_back(x: torch.Tensor, quant: KVQuant, keys: bool) -> torch.Tensor:
    """The prompt as KIVI stores it (the naive transcription): keys but the last `n % residual`,
    values but the last `residual`."""
    n, r = x.shape[2], quant.residual
    out = x.clone()
    if keys and n >= r:
        out[:, :, : n - n % r] = naive_kcache(x[:, :, : n - n % r], quant.group_size, quant.bits)
    if not keys and n > r:
        out[:, :, : n - r] = naive_vcache(x[:, :, : n - r], quant.group_size, quant.bits)
    return out


@pytest.mark.parametrize("kind", ["kivi", *BACKENDS])
def test_dequant_prune_requant_equals_its_reference(kind):
    """The prompt stored quantized (transformers' `QuantizedCache` prefill, or KIVI's rule), SnapKV
    scoring the values read back (the naive selection over eager weights from those keys), and the
    kept entries quantized again as one prompt."""
    model, ids = tiny_model("llama"), random_ids(48)
    group = 4 if kind == "kivi" else 16
    quant = KVQuant(kind=kind, bits=2, group_size=group, residual=8, order="dequant_prune_requant")
    method = build_method("snapkv", budget=24, window=8, kernel_size=5)
    seen, score = {}, method.score

    def spy(layer, query, key, module):
        seen[layer.index] = (query.clone(), key.clone())
        return score(layer, query, key, module)

    method.score = spy
    cache = compress_context(model, ids, method, kv_quant=quant)
    with torch.inference_mode():
        if kind == "kivi":
            ref = DynamicCache()
            model(ids, past_key_values=ref)
            read_back = [
                (_kivi_read_back(r.keys, quant, True), _kivi_read_back(r.values, quant, False))
                for r in ref.layers
            ]
        else:
            ref = QuantizedCache(kind, model.config, nbits=2, q_group_size=group, residual_length=8)
            model(ids, past_key_values=ref)
            read_back = [
                (r._dequantize(r._quantized_keys), r._dequantize(r._quantized_values)) for r in ref.layers
            ]
    for i, layer in cache.compressible_layers():
        query, key = seen[i]
        keys, values = read_back[i]
        torch.testing.assert_close(key, keys, rtol=0, atol=1e-6)  # dequantize
        logits = query @ keys.repeat_interleave(2, dim=1).transpose(-1, -2) / 4.0
        logits = logits.masked_fill(torch.ones(48, 48, dtype=torch.bool).triu(1), float("-inf"))
        kept = naive_snapkv_selection(logits.softmax(-1), 2, 24, 8, 5, "max", "mean")
        assert layer.positions[0].tolist() == kept  # prune
        layer.quantize_residual()
        idx = torch.tensor(kept).unsqueeze(0).unsqueeze(-1).expand(1, 2, 24, 16)
        k, v = keys.gather(2, idx), values.gather(2, idx)
        if kind == "kivi":
            want = _kivi_read_back(k, quant, True), _kivi_read_back(v, quant, False)
        else:
            backend = quant.backend(k)
            want = tuple(backend._dequantize(backend._quantize(t.contiguous(), axis=0)) for t in (k, v))
        torch.testing.assert_close(layer.keys, want[0], rtol=0, atol=1e-6)  # re-quantize
        torch.testing.assert_close(layer.values, want[1], rtol=0, atol=1e-6)


def test_dequant_prune_requant_takes_decode_time_eviction():
    """Pruning after quantizing is this order's own: H2O evicting at every step runs, and after the
    last eviction the kept entries are quantized again by KIVI's prompt rule (keys but the last
    20 % 8, values but the last 8)."""
    model, ids = tiny_model("llama"), random_ids(40)
    quant = KVQuant(kind="kivi", bits=4, group_size=4, residual=8, order="dequant_prune_requant")
    caches = {}
    generate_ids(
        model,
        ids,
        method=build_method("h2o", budget=20, evict_during_decode=True),
        max_new_tokens=10,
        kv_quant=quant,
        on_compressed=grab(caches, "q"),
    )
    for _, layer in caches["q"].compressible_layers():
        assert layer.stored == 20 and layer.decode_evicted > 0
        layer.quantize_residual()
        assert layer.quant_keys == 16 and layer.quant_values == 12


def test_dequant_prune_requant_builds_with_decode_time_eviction():
    spec = RunSpec.from_config(
        compose_cfg(["method=h2o", "kv_quant=kivi", "kv_quant.order=dequant_prune_requant"])
    )
    assert spec.kv_quant.order == "dequant_prune_requant" and spec.method.decode_schedule.on


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_chunked_prefill_stores_what_one_pass_stores(arch):
    """The prompt is quantized after its compression, so a chunked prefill (same selection) stores
    the same values; on Gemma 3 only the full-attention layers are quantized."""
    model, ids = tiny_model(arch), random_ids(70)
    quant = KVQuant(kind="kivi", bits=2, group_size=4, residual=8)
    method = build_method("snapkv", budget=32, window=4)
    one, chunked = (compress_context(model, ids, method, chunk_size=c, kv_quant=quant) for c in (None, 24))
    for c in (one, chunked):
        c.kv_bytes()  # quantizes what is due
    for (_, a), (_, b) in zip(one.compressible_layers(), chunked.compressible_layers()):
        assert a.quant_keys == 32 and a.quant_values == 24
        # (chunked attention rounds differently in earlier layers: fp32 noise, no code flips)
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=1e-5)
    # the other layers (Gemma 3's sliding windows) hold their tensors at the model's dtype
    plain = compress_context(model, ids, method)
    others = [plain.kv_bytes() - sum(layer.stored_bytes() for _, layer in plain.compressible_layers())]
    others.append(one.kv_bytes() - sum(layer.stored_bytes() for _, layer in one.compressible_layers()))
    assert others[0] == others[1] and (others[0] > 0) == (arch == "gemma3")


def test_a_missing_backend_package_is_named_before_the_model_loads(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "hqq" else real(name, *a)
    )
    with pytest.raises(ValueError, match="kv_quant=hqq needs the package hqq"):
        RunSpec.from_config(compose_cfg(["kv_quant=hqq"]))
    KVQuant(kind="kivi").check_available()  # KIVI needs no package


ONCE = [
    ("full", {}),
    ("snapkv", {"window": 4}),
    ("pyramidkv", {"window": 4}),
    ("chunkkv", {"window": 4, "chunk_length": 4}),
    ("criticalkv", {"window": 4}),
    ("knorm", {}),
    ("expected_attention", {}),
    ("tova", {"evict_during_decode": False}),
    ("h2o", {"evict_during_decode": False}),
]


@pytest.mark.parametrize("name, params", ONCE, ids=[n for n, _ in ONCE])
def test_methods_that_prune_once_keep_their_selection_and_store_it_quantized(name, params):
    """score_then_quantize on every method that prunes once: the same entries as without
    quantization, stored as KIVI's formulas quantize them (per layer: PyramidKV's lengths differ)."""
    model, ids = tiny_model("llama"), random_ids(60)
    quant = KVQuant(kind="kivi", bits=2, group_size=4, residual=8)
    caches = {}
    for key, q in (("plain", None), ("kivi", quant)):
        generate_ids(
            model,
            ids,
            method=build_method(name, **({} if name == "full" else {"budget": 24}), **params),
            max_new_tokens=1,
            kv_quant=q,
            on_compressed=grab(caches, key),
        )
    for (_, plain), (_, layer) in zip(
        caches["plain"].compressible_layers(), caches["kivi"].compressible_layers()
    ):
        assert torch.equal(plain.positions, layer.positions)
        n = layer.stored
        assert (layer.quant_keys, layer.quant_values) == (n - n % 8, max(n - 8, 0))
        torch.testing.assert_close(layer.keys, _kivi_read_back(plain.keys, quant, True), rtol=0, atol=1e-6)
        torch.testing.assert_close(
            layer.values, _kivi_read_back(plain.values, quant, False), rtol=0, atol=1e-6
        )


def test_the_cache_refuses_per_head_layers():
    """`CompressedCache` itself refuses per-head storage, for callers that build it directly."""
    method = build_method("adakv", budget=20, window=4)
    with pytest.raises(ValueError, match="kv_quant=kivi does not support per-head storage \\(HeadwiseLayer"):
        CompressedCache(tiny_model("llama").config, layer_factory=method.cache_layer, kv_quant=KVQuant())
