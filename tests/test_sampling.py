"""Sampling with seeds: `snapkv.Sampling` / `TokenPicker`, k samples per prompt from one compressed
cache (`sample_ids`), the `generation` config node and the runner's sampled rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import random_ids, tiny_model
from omegaconf import OmegaConf
from test_runner import make_cfg
from test_runner import tiny_dir as tiny_dir  # the saved tiny model (session fixture)

import eval.runner as runner
from eval.spec import RunSpec, sample_seed
from eval.store import SAMPLED_ROW_SCHEMA, read_rows
from snapkv import Sampling, build_method, generate_ids, sample_ids

NEW = 12
SAMPLING = Sampling(temperature=1.3, top_p=0.9)
# Methods whose decode after a rollback must replay exactly: compress-once, evict-while-decoding
# (copy-on-write at the mark), a sink + window cache.
METHODS = [
    ("full", {}),
    ("snapkv", dict(budget=40, window=8, kernel_size=5)),
    ("h2o", dict(budget=40, evict_during_decode=True)),
    ("streamingllm", dict(budget=40, n_sink=4)),
]


def sampled(model, ids, seed, method=("full", {}), **kw):
    out, _ = generate_ids(
        model, ids, None, build_method(method[0], **method[1]), max_new_tokens=NEW, stop_ids=set(),
        sampling=SAMPLING, seed=seed, **kw,
    )  # fmt: skip
    return out


def test_same_seed_same_tokens_other_seed_other_tokens():
    model, ids = tiny_model(), random_ids(96)
    a, b = sampled(model, ids, 7), sampled(model, ids, 7)
    assert torch.equal(a, b)
    assert not torch.equal(a, sampled(model, ids, 8))


def test_sampling_uses_its_own_generator_not_the_global_rng():
    model, ids = tiny_model(), random_ids(96)
    torch.manual_seed(0)
    a = sampled(model, ids, 7)
    state = torch.get_rng_state()
    torch.manual_seed(12345)
    b = sampled(model, ids, 7)
    assert torch.equal(a, b)
    torch.manual_seed(0)
    sampled(model, ids, 7)
    assert torch.equal(torch.get_rng_state(), state)  # nothing drawn from the global generator


def test_full_cache_sampling_equals_transformers_generate():
    """Independent reference: `model.generate(do_sample=True)` with transformers' own warpers,
    drawing from the global CPU generator seeded with the same seed (the same Mersenne stream as a
    fresh `torch.Generator` with that seed)."""
    model, ids = tiny_model(), random_ids(96)
    for seed in (3, 11):
        ours = sampled(model, ids, seed)
        torch.manual_seed(seed)
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=SAMPLING.temperature,
            top_p=SAMPLING.top_p, top_k=0, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0,
        )  # fmt: skip
        assert torch.equal(ours, ref[:, ids.shape[1] :])


@pytest.mark.parametrize("name,params", METHODS, ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("query_aware", [True, False])
def test_k_samples_from_one_checkpoint_equal_k_fresh_runs(name, params, query_aware):
    model = tiny_model()
    context, question = random_ids(84), random_ids(12, seed=2)
    seeds = [sample_seed(42, "p", i) for i in range(3)]
    outs = sample_ids(
        model, context, question, build_method(name, **params), sampling=SAMPLING, seeds=seeds,
        query_aware=query_aware, max_new_tokens=NEW, stop_ids=set(), keep_logits=True,
    )  # fmt: skip
    assert len(outs) == 3
    for seed, (ids, res) in zip(seeds, outs):
        fresh, ref = generate_ids(
            model, context, question, build_method(name, **params), query_aware=query_aware,
            max_new_tokens=NEW, stop_ids=set(), keep_logits=True, sampling=SAMPLING, seed=seed,
        )  # fmt: skip
        assert torch.equal(ids, fresh)
        assert all(torch.equal(a, b) for a, b in zip(res.logits, ref.logits))
        assert res.kv_tokens_end == ref.kv_tokens_end and res.decode_evicted == ref.decode_evicted
        assert res.e2e_s == pytest.approx(res.ttft_s + sum(res.decode_s))
    assert len({tuple(ids[0].tolist()) for ids, _ in outs}) > 1  # the seeds really differ


def test_budget_at_least_length_samples_as_full_with_the_same_seed():
    model, ids = tiny_model(), random_ids(96)
    for seed in (1, 2):
        assert torch.equal(sampled(model, ids, seed), sampled(model, ids, seed, ("snapkv", dict(budget=200))))


def test_greedy_tokens_unchanged_and_need_no_seed():
    model, ids = tiny_model(), random_ids(96)
    ours, res = generate_ids(model, ids, None, build_method("full"), max_new_tokens=NEW, stop_ids=set())
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
    assert torch.equal(ours, ref[:, ids.shape[1] :])
    assert res.e2e_s == pytest.approx(res.ttft_s + sum(res.decode_s))


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(temperature=0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
    ],
)
def test_bad_sampling_settings_raise_naming_them(kw, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kw)


def test_sampling_needs_a_seed():
    with pytest.raises(ValueError, match="seed"):
        sampled(tiny_model(), random_ids(20), None)


def test_sample_seed_depends_on_run_seed_prompt_and_index_only():
    s = sample_seed(42, "a", 0)
    assert s == sample_seed(42, "a", 0) and 0 <= s < 2**63
    assert len({s, sample_seed(43, "a", 0), sample_seed(42, "b", 0), sample_seed(42, "a", 1)}) == 4


# ----------------------------------------------------------------------------------------- config
def test_greedy_config_hash_is_the_hash_without_the_generation_node(tiny_dir, tmp_path):
    cfg = make_cfg(tiny_dir, tmp_path)
    with_node = RunSpec.from_config(cfg).method_hash
    bare = OmegaConf.to_container(cfg, resolve=True)
    del bare["generation"]
    assert RunSpec.from_config(bare).method_hash == with_node
    sampled_cfg = make_cfg(tiny_dir, tmp_path, "generation.do_sample=true")
    assert RunSpec.from_config(sampled_cfg).method_hash != with_node
    k3 = make_cfg(tiny_dir, tmp_path, "generation.do_sample=true", "generation.samples_per_prompt=3")
    assert RunSpec.from_config(k3).method_hash == RunSpec.from_config(sampled_cfg).method_hash
    other_seed = make_cfg(tiny_dir, tmp_path, "generation.do_sample=true", "seed=1")
    assert RunSpec.from_config(other_seed).method_hash != RunSpec.from_config(sampled_cfg).method_hash


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["generation.samples_per_prompt=2"], "do_sample"),
        (["generation.do_sample=true", "generation.temperature=0"], "generation.temperature"),
        (["generation.do_sample=true", "generation.top_p=2"], "generation.top_p"),
        (["generation.do_sample=true", "generation.samples_per_prompt=0"], "samples_per_prompt"),
        (["generation.do_sample=yes"], "do_sample"),
        (["+generation.top_k=5"], "top_k"),
    ],
)
def test_bad_generation_config_is_refused_before_the_model_loads(tiny_dir, tmp_path, overrides, match):
    cfg = make_cfg(tiny_dir, tmp_path, *overrides)
    with pytest.raises(ValueError, match=match):
        RunSpec.from_config(cfg)


def test_sampling_is_refused_under_the_shared_protocols(tiny_dir, tmp_path):
    cfg = make_cfg(
        tiny_dir, tmp_path, "generation.do_sample=true", "protocol=multi_request", task="kv_retrieval"
    )
    with pytest.raises(ValueError, match="protocol=multi_request"):
        RunSpec.from_config(cfg)


# ----------------------------------------------------------------------------------------- runner
def _rows(results: Path) -> list[dict]:
    return [r for p in sorted(results.rglob("*.jsonl")) for r in read_rows(p)]


SAMPLE_CFG = ("generation.do_sample=true", "generation.temperature=1.2", "generation.top_p=0.95")


def test_runner_writes_one_row_per_sample_with_paired_seeds_and_resumes(tiny_dir, tmp_path, monkeypatch):
    calls = []
    real = runner.generate_samples

    def counting(model, tokenizer, **kw):
        calls.append(list(kw["seeds"]))
        return real(model, tokenizer, **kw)

    monkeypatch.setattr(runner, "generate_samples", counting)
    one = ("task.lengths=[150]", "task.depths=[0]")
    by_method = {}
    for method in ("full", "streamingllm"):
        cfg = make_cfg(
            tiny_dir, tmp_path, f"method={method}", "generation.samples_per_prompt=2", *SAMPLE_CFG, *one
        )
        runner.run(cfg, write_report=False)
        by_method[method] = {r["sample_id"]: r for r in _rows(tmp_path) if r["method"] == method}
    assert len(calls) == 2  # one prefill per prompt per method, k seeds each
    full, stream = by_method["full"], by_method["streamingllm"]
    assert len(full) == 2 and full.keys() == stream.keys()
    for sid, row in full.items():
        assert row["status"] == "ok" and set(SAMPLED_ROW_SCHEMA) <= set(row)
        assert sid == f"{row['prompt_id']}#{row['sample_index']}"
        assert row["sample_seed"] == sample_seed(42, row["prompt_id"], row["sample_index"])
        assert row["sample_seed"] == stream[sid]["sample_seed"]
        assert (row["temperature"], row["top_p"]) == (1.2, 0.95)
        assert row["e2e_s"] >= row["ttft_s"] > 0
    assert calls[0] == calls[1]

    # Growing k runs only the new index, into the same file (k is not in the hash).
    calls.clear()
    cfg = make_cfg(tiny_dir, tmp_path, "method=full", "generation.samples_per_prompt=3", *SAMPLE_CFG, *one)
    runner.run(cfg, write_report=False)
    prompt = next(iter(full.values()))["prompt_id"]
    assert calls == [[sample_seed(42, prompt, 2)]]
    assert len(list((tmp_path).rglob("full-*.jsonl"))) == 1
    rows = [r for r in _rows(tmp_path) if r["method"] == "full"]
    assert sorted(r["sample_index"] for r in rows) == [0, 1, 2]


def test_greedy_rows_carry_no_sampling_columns(tiny_dir, tmp_path):
    cfg = make_cfg(tiny_dir, tmp_path, "method=full", "task.lengths=[150]", "task.depths=[0]")
    runner.run(cfg, write_report=False)
    (row,) = _rows(tmp_path)
    assert not set(SAMPLED_ROW_SCHEMA) & set(row)
    assert "#" not in row["sample_id"] and row["e2e_s"] >= row["ttft_s"]


def test_every_entry_point_runs_the_model_without_autograd(tiny_dir):
    """The weights of a loaded model require grad; every generation entry point runs its forwards
    without recording autograd graphs (a cached key or value would otherwise keep every forward's
    activations alive for the rest of the sample), and hands back tensors with no graph."""
    from snapkv import answer, compress_context, generate, generate_samples
    from snapkv_models.loading import load_model

    model, tokenizer, _ = load_model(tiny_dir)
    assert any(p.requires_grad for p in model.parameters())
    recording = []
    handle = model.register_forward_hook(lambda m, a, o: recording.append(torch.is_grad_enabled()))
    try:
        for method in (None, build_method("snapkv", budget=4, window=2), build_method("h2o", budget=4)):
            assert isinstance(
                generate(model, tokenizer, "a b c d e f g h", method=method, max_new_tokens=3).text, str
            )
        generate_samples(
            model, tokenizer, "a b c d", sampling=Sampling(temperature=0.7), seeds=[1, 2], max_new_tokens=3
        )
        ids, _ = generate_ids(model, random_ids(12), None, None, max_new_tokens=3)
        sample_ids(model, random_ids(12), None, None, sampling=Sampling(), seeds=[3], max_new_tokens=3)
        cache = compress_context(model, random_ids(12), build_method("snapkv", budget=6, window=2))
        answer(model, cache, random_ids(3), max_new_tokens=2)
    finally:
        handle.remove()
    assert recording and not any(recording)
    assert not ids.requires_grad
