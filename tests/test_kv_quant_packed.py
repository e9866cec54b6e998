"""Packed quantized storage (`KVQuant.packed`, the default) against the storage of the values read
back (`packed=False`): the same tokens, every key and value attention reads equal bit for bit (the
tensors each compressible layer's `update` returns, prefill and every decode step, across residual
flushes and group boundaries), the same state at the end, on MHA and GQA, with decode-time eviction
(order=dequant_prune_requant) and around a checkpoint / rollback; and the bytes held are the packed
codes, scales, zero points and the residual."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from eval.bench import measure
from eval.bench import run as bench
from eval.bench.report import summary_text
from eval.report import equal_bytes as eb
from eval.store import ResultStore
from snapkv import answer, build_method, compress_context, generate_ids
from snapkv.cache import CompressibleLayer
from snapkv.kv_quant import KiviPack, KVQuant, kivi_bytes, pack_codes, unpack_codes
from tests.conftest import random_ids, tiny_config, tiny_model

ROOT = Path(__file__).resolve().parents[1]


def mha_model():
    """The tiny Llama with as many KV heads as query heads (4)."""
    torch.manual_seed(0)
    config = tiny_config("llama")
    config.num_key_value_heads = config.num_attention_heads
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


MODELS = {
    "gqa": lambda: tiny_model("llama"),
    "mha": mha_model,
    "bf16": lambda: tiny_model("qwen2").bfloat16(),
}


def needs(package: str):
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package} is not installed")


QUANTS = {
    "kivi2": KVQuant(kind="kivi", bits=2, group_size=4, residual=8),
    "kivi4": KVQuant(kind="kivi", bits=4, group_size=4, residual=8),
    "kivi8": KVQuant(kind="kivi", bits=8, group_size=8, residual=16),
    "quanto": KVQuant(kind="quanto", bits=4, group_size=16, residual=8),
    "hqq": KVQuant(kind="hqq", bits=2, group_size=16, residual=8),
}
BACKEND_MARKS = {"quanto": [needs("optimum")], "hqq": [needs("hqq")]}


def quant_params():
    return [pytest.param(name, marks=BACKEND_MARKS.get(name, [])) for name in QUANTS]


def run(model, ids, method, quant: KVQuant, packed: bool, new_tokens: int = 21):
    """Greedy generation; returns the tokens, the (index, keys, values) each compressible layer's
    `update` returned, and the cache."""
    reads, caches = [], {}
    update = CompressibleLayer.update

    def spy(layer, key_states, value_states, *args, **kwargs):
        keys, values = update(layer, key_states, value_states, *args, **kwargs)
        reads.append((layer.index, keys.clone(), values.clone()))
        return keys, values

    CompressibleLayer.update = spy
    try:
        out, _ = generate_ids(
            model,
            ids,
            method=method(),
            max_new_tokens=new_tokens,
            kv_quant=dataclasses.replace(quant, packed=packed),
            on_compressed=lambda cache: caches.setdefault("cache", cache),
        )
    finally:
        CompressibleLayer.update = update
    return out, reads, caches["cache"]


def assert_same_reads_and_state(a, b):
    (ids_a, reads_a, cache_a), (ids_b, reads_b, cache_b) = a, b
    assert torch.equal(ids_a, ids_b)
    assert len(reads_a) == len(reads_b) > 0
    for (i, ka, va), (j, kb, vb) in zip(reads_a, reads_b):
        assert i == j and ka.dtype == kb.dtype
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    for (_, la), (_, lb) in zip(cache_a.compressible_layers(), cache_b.compressible_layers()):
        la.quantize_residual(), lb.quantize_residual()
        assert (la.quant_keys, la.quant_values, la.stored) == (lb.quant_keys, lb.quant_values, lb.stored)
        assert torch.equal(la.positions, lb.positions)
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("quant_name", quant_params())
def test_packed_reads_what_the_read_back_storage_reads(model_name, quant_name):
    """SnapKV keeps 30 of 45 (KIVI: 24 keys packed, 6 in the residual, 22 values packed), then 21
    decode steps flush the residual several times (keys in whole runs of 8 = 2 groups)."""
    model, ids = MODELS[model_name](), random_ids(45)
    quant = QUANTS[quant_name]
    method = lambda: build_method("snapkv", budget=30, window=4)  # noqa: E731
    packed, plain = (run(model, ids, method, quant, p) for p in (True, False))
    assert_same_reads_and_state(packed, plain)
    for _, layer in packed[2].compressible_layers():
        assert layer.kpack is not None and layer.vpack is not None
        # the layer's own tensors are the residual only
        assert layer._k.shape[-2] == layer.stored - layer.quant_keys
        assert layer._v.shape[-2] == layer.stored - layer.quant_values


@pytest.mark.parametrize("quant_name", quant_params())
def test_packed_with_decode_time_eviction(quant_name):
    """order=dequant_prune_requant with H2O evicting at every step: each eviction unpacks the layer,
    prunes it and quantizes the kept entries again, as the read-back storage does."""
    model, ids = tiny_model("llama"), random_ids(40)
    quant = dataclasses.replace(QUANTS[quant_name], order="dequant_prune_requant")
    method = lambda: build_method("h2o", budget=20, evict_during_decode=True)  # noqa: E731
    packed, plain = (run(model, ids, method, quant, p, new_tokens=12) for p in (True, False))
    assert_same_reads_and_state(packed, plain)
    assert all(layer.decode_evicted > 0 for _, layer in packed[2].compressible_layers())


@pytest.mark.parametrize("prompt", [5, 8, 37])
def test_packed_full_cache_below_at_and_above_the_residual(prompt):
    """method=full: a prompt shorter than the residual (nothing packed until the decode steps fill
    it), one residual exactly, and several."""
    model, ids = tiny_model("qwen2"), random_ids(prompt)
    method = lambda: build_method("full")  # noqa: E731
    packed, plain = (run(model, ids, method, QUANTS["kivi2"], p, new_tokens=19) for p in (True, False))
    assert_same_reads_and_state(packed, plain)


@pytest.mark.parametrize("quant_name", ["kivi4", pytest.param("quanto", marks=BACKEND_MARKS["quanto"])])
def test_packed_checkpoint_and_rollback(quant_name):
    """A question after the checkpoint flushes the residual into new packs; the rollback restores
    the marked packs and residual (held by reference: the mark keeps alive exactly the layer's
    stored bytes and positions at the mark), and both storages answer with the same logits."""
    model, ids = tiny_model("qwen2"), random_ids(50)
    question = random_ids(12, seed=5)
    answers = {}
    for packed in (True, False):
        quant = dataclasses.replace(QUANTS[quant_name], packed=packed)
        method = build_method("snapkv", budget=30, window=4)
        cache = compress_context(model, ids, method, kv_quant=quant)
        cache.checkpoint()
        layers = [layer for _, layer in cache.compressible_layers()]
        marked = [(layer.keys, layer.values, layer.positions, layer.stored_bytes()) for layer in layers]
        first = answer(model, cache, question, method, max_new_tokens=12, keep_logits=True)
        for layer, (k, v, pos, _) in zip(layers, marked):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
            assert torch.equal(layer.positions, pos)
        again = answer(model, cache, question, method, max_new_tokens=12, keep_logits=True)
        assert torch.equal(first.ids, again.ids)
        if packed:
            assert first.rollback_bytes == sum(b + p.nbytes for _, _, p, b in marked)
        answers[packed] = first
    assert torch.equal(answers[True].ids, answers[False].ids)
    for a, b in zip(answers[True].logits, answers[False].logits):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_pack_into_bytes_and_back(bits):
    codes = torch.randint(0, 2**bits, (2, 3, 5, 13))  # 13: a last byte half filled
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == -(-13 * bits // 8)
    assert torch.equal(unpack_codes(packed, bits, 13).long(), codes)
    if bits == 4:  # the first code in the low bits
        assert packed[0, 0, 0, 0] == codes[0, 0, 0, 0] + 16 * codes[0, 0, 0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_layer_holds_codes_scales_zero_points_and_the_residual(dtype):
    """What a packed layer holds (each storage once, the full allocation: no view keeps a freed
    full-precision tensor alive) is the counted `stored_bytes`, KIVI's layout, below what the
    read-back storage holds."""
    model, ids = tiny_model("llama").to(dtype), random_ids(50)
    quant = KVQuant(kind="kivi", bits=4, group_size=4, residual=8)
    caches = {
        p: compress_context(
            model,
            ids,
            build_method("snapkv", budget=30, window=4),
            kv_quant=dataclasses.replace(quant, packed=p),
        )
        for p in (True, False)
    }
    es = torch.finfo(dtype).bits // 8
    for (_, layer), (_, ref) in zip(caches[True].compressible_layers(), caches[False].compressible_layers()):
        layer.quantize_residual(), ref.quantize_residual()
        assert isinstance(layer.kpack, KiviPack) and layer.kpack.codes.dtype == torch.uint8
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [
            layer._k, layer._v, *layer.kpack.tensors(), *layer.vpack.tensors()]}  # fmt: skip
        # 24 keys and 22 values packed; 6 keys and 8 values in the residual; 1 row, 2 KV heads, d 16
        want = kivi_bytes((1, 2, 16), 24, 22, quant, es) + (6 + 8) * 2 * 16 * es
        assert sum(held.values()) == layer.stored_bytes() == want
        ref_held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (ref._k, ref._v)}
        assert sum(ref_held.values()) == 2 * 30 * 2 * 16 * es > want
    assert caches[True].kv_bytes() == caches[False].kv_bytes()  # the read-back storage's count


def test_kept_index_bookkeeping_is_counted_beside_the_storage():
    """`kv_index_bytes`: the int64 positions of each compressed layer's kept entries, apart from
    `kv_bytes`; none for a cache nothing was evicted from."""
    model, ids = tiny_model("gemma3"), random_ids(50)  # 1 full-attention layer of 6 (sliding: none)
    quant = QUANTS["kivi4"]
    snap = compress_context(model, ids, build_method("snapkv", budget=30, window=4), kv_quant=quant)
    full = compress_context(model, ids, build_method("full"), kv_quant=quant)
    n = len(snap.compressible_layers())
    assert n >= 1 and snap.kv_index_bytes() == n * 1 * 2 * 30 * 8
    assert full.kv_index_bytes() == 0
    plain = compress_context(model, ids, build_method("snapkv", budget=30, window=4))
    assert plain.kv_index_bytes() == snap.kv_index_bytes()


def test_the_speed_bench_records_memory_beside_the_kv_bytes_of_quantized_storage():
    """`eval.bench.measure` on a quantized configuration (the storage's fields, as `spec_of` gives
    them): the row has the measured peak beside the bytes stored (below the plain cache's) and the
    kept-index bytes, and the summary prints them side by side."""
    model = tiny_model("llama")
    cfg = bench.compose(["clock=cpu", "decode_tokens=4"])
    rows = []
    for storage, fields in ((None, ()), ("kivi4", tuple(dataclasses.asdict(QUANTS["kivi4"]).items()))):
        config = bench.Config("snapkv", (("budget", 24), ("window", 4)), 60, 1, storage, fields)
        spec = bench.spec_of(cfg, config)
        spec["model"] = {"name": "tiny", "dtype": "float32"}
        row = measure.measure(model, 128, spec)
        assert row["status"] == "ok", row["error"]
        rows.append(dict(row, round=0, order=len(rows), noisy=False))
    plain, quant = rows
    assert quant["method"] == "snapkv+kivi4" and quant["peak_mem_bytes"] >= quant["decode_peak_mem_bytes"] > 0
    assert 0 < quant["kv_bytes"] < plain["kv_bytes"] == 3 * 2 * 24 * 2 * 16 * 4
    assert quant["kv_index_bytes"] == plain["kv_index_bytes"] == 3 * 24 * 2 * 8
    text = summary_text(rows, cfg)
    header = next(line for line in text.splitlines() if "peak GiB" in line)
    assert "KV MiB" in header and "idx MiB" in header and "decode GiB" in header
    assert any(line.strip().startswith("snapkv+kivi4") for line in text.splitlines())


@pytest.mark.parametrize("quant_name", ["kivi2", pytest.param("hqq", marks=BACKEND_MARKS["hqq"])])
def test_packed_rollback_after_decode_time_eviction(quant_name, monkeypatch):
    """order=dequant_prune_requant, H2O evicting while a question is answered after the checkpoint:
    each eviction unpacks the layer into new tensors, so the rollback finds the marked packs,
    residual and positions as they were; both storages answer twice with the same logits."""
    model, ids = tiny_model("llama"), random_ids(40)
    question = random_ids(10, seed=3)
    logits, evictions = {}, []
    evict = CompressibleLayer.evict_in_place
    monkeypatch.setattr(
        CompressibleLayer,
        "evict_in_place",
        lambda layer, v: (evictions.append(layer.packed), evict(layer, v)),
    )
    for packed in (True, False):
        quant = dataclasses.replace(QUANTS[quant_name], order="dequant_prune_requant", packed=packed)
        method = build_method("h2o", budget=20, evict_during_decode=True)
        cache = compress_context(model, ids, method, kv_quant=quant)
        cache.checkpoint()
        layers = [layer for _, layer in cache.compressible_layers()]
        marked = [(layer.keys, layer.values, layer.positions) for layer in layers]
        runs = [answer(model, cache, question, method, max_new_tokens=8, keep_logits=True) for _ in range(2)]
        assert torch.equal(runs[0].ids, runs[1].ids)
        for a, b in zip(runs[0].logits, runs[1].logits):
            assert torch.equal(a, b)
        for layer, (k, v, pos) in zip(layers, marked):
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
            assert torch.equal(layer.positions, pos)
        logits[packed] = runs[0].logits
    for a, b in zip(logits[True], logits[False]):
        assert torch.equal(a, b)
    assert True in evictions and False in evictions  # (the rollback resets decode_evicted)


def test_committed_rows_without_kv_index_bytes_still_load(tmp_path):
    """Rows written before `kv_index_bytes` was recorded load with it null, and the equal-bytes
    report counts their storage alone."""
    committed = ROOT / "results/needle_budget/needle/smollm2-135m-instruct/snapkv-d69f199c.jsonl"
    folder = tmp_path / "needle" / "smollm2-135m-instruct"
    folder.mkdir(parents=True)
    shutil.copy(committed, folder / committed.name)
    df = ResultStore.load_dir(tmp_path)
    assert len(df) > 0 and "kv_index_bytes" in df.columns and df["kv_index_bytes"].isna().all()
    assert (eb.paid_bytes(df) == df["kv_bytes"]).all()


@pytest.mark.parametrize("packed", [True, False])
def test_value_groups_must_divide_head_dim(packed):
    """KIVI groups values along channels: head_dim 16 takes no group of 32, in either storage."""
    model, ids = tiny_model("llama"), random_ids(40)
    quant = KVQuant(kind="kivi", bits=4, group_size=32, residual=32, packed=packed)
    with pytest.raises(ValueError, match="head_dim=16, group_size=32"):
        compress_context(model, ids, build_method("full"), kv_quant=quant).kv_bytes()
    with pytest.raises(ValueError, match="head_dim=16, group_size=32"):
        KiviPack.quantize(torch.zeros(1, 2, 4, 16), 4, 32, keys=False)


@pytest.mark.parametrize("method", ["full", "snapkv"])
def test_a_decode_step_dequantizes_each_pack_once(method, monkeypatch):
    """Reading `keys` / `values` of packed storage builds a new tensor: a decode step reads each
    layer's key pack and value pack once (what the layer's `update` returns), never a second time."""
    model, steps = tiny_model("llama"), collections.Counter()
    step = {"layer0": 0}
    dequantize, update = KiviPack.dequantize, CompressibleLayer.update

    def counted_dequantize(pack):
        steps[step["layer0"]] += 1
        return dequantize(pack)

    def counted_update(layer, *args, **kwargs):
        step["layer0"] += layer.index == 0
        return update(layer, *args, **kwargs)

    monkeypatch.setattr(KiviPack, "dequantize", counted_dequantize)
    monkeypatch.setattr(CompressibleLayer, "update", counted_update)
    kwargs = {"budget": 64} if method == "snapkv" else {}
    generate_ids(model, random_ids(200), method=build_method(method, **kwargs), max_new_tokens=12,
                 kv_quant=QUANTS["kivi4"])  # fmt: skip
    layers = model.config.num_hidden_layers
    decode = {s: n for s, n in steps.items() if s > 1}  # step 1: the prefill, nothing packed yet
    assert len(decode) == 11 and set(decode.values()) == {2 * layers}, steps
