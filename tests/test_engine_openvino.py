"""engine=openvino (eval/engines/): config mapping and refusals, hash neutrality of the default
engine, the GGUF rewrite, full-cache parity of OpenVINO GenAI against the transformers path on one
tiny random Llama GGUF both load, that a budget changes what the engine keeps, and the accuracy
agreement of eval/engines/parity.py on synthetic rows.

The tiny model carries a tiny byte-level BPE tokenizer of its own (tests/tiny_gguf.py), so the
engine tests need nothing cached or downloaded; they need openvino_genai (`pip install -e
'.[openvino]'`) and are skipped, saying so, without it."""

from __future__ import annotations

import json
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import in_child_process
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from tiny_gguf import SPECIAL, tiny_llama_gguf, tiny_text_gguf, tiny_tokenizer, toy_tokenizer

from eval.conf import CONF_DIR
from eval.engines import build_engine
from eval.engines import openvino as ov_engine
from eval.engines.gguf_files import field_value, rewrite_f16, tensor_types
from eval.engines.parity import agreement, closest, first_divergence, parity_table
from eval.spec import RunSpec
from snapkv import build_method

needs_engine = pytest.mark.skipif(
    not ov_engine.installed(), reason="openvino_genai is not installed (pip install -e '.[openvino]')"
)


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


# ------------------------------------------------------------------------------------ configuration
@pytest.mark.parametrize("overrides", [[], ["method=h2o", "budget=256"], ["task=ruler", "method=full"]])
def test_transformers_engine_keeps_every_config_hash(overrides):
    cfg = compose_cfg(overrides)
    assert cfg.engine.name == "transformers"
    spec = RunSpec.from_config(cfg)
    with open_dict(cfg):
        del cfg["engine"]  # a config from before the node existed
    assert spec.engine is None and spec.method_hash == RunSpec.from_config(cfg).method_hash


def test_unknown_engine_and_keys_are_refused():
    method = build_method("full")
    with pytest.raises(ValueError, match="unknown engine 'vllm'; known: transformers, openvino"):
        build_engine({"name": "vllm"}, method)
    with pytest.raises(ValueError, match="engine=transformers takes no options, got engine.device"):
        build_engine({"name": "transformers", "device": "CPU"}, method)


def test_missing_openvino_says_how_to_install(monkeypatch):
    monkeypatch.setattr(ov_engine, "installed", lambda: False)
    with pytest.raises(ValueError, match=r"pip install -e '\.\[openvino\]'"):
        RunSpec.from_config(compose_cfg(["engine=openvino"]))


@needs_engine
def test_snapkv_and_h2o_map_onto_the_eviction_config():
    snap = RunSpec.from_config(compose_cfg(["engine=openvino", "budget=256", "method.window=64"]))
    assert snap.engine.eviction == {
        "start_size": 32, "recent_size": 64, "max_cache_size": 256, "aggregation": "norm_sum",
        "snapkv_window_size": 64, "apply_rotation": False, "kvcrush": 0, "kvcrush_anchor": "random",
    }  # fmt: skip
    h2o = RunSpec.from_config(
        compose_cfg(
            ["engine=openvino", "method=h2o", "budget=256", "method.recent=96", "engine.start_size=64"]
        )
    )
    assert {k: h2o.engine.eviction[k] for k in ("start_size", "recent_size", "max_cache_size")} == {
        "start_size": 64, "recent_size": 96, "max_cache_size": 256,
    }  # fmt: skip
    assert (h2o.engine.eviction["aggregation"], h2o.engine.eviction["snapkv_window_size"]) == ("sum", 0)
    full = RunSpec.from_config(compose_cfg(["engine=openvino", "method=full"]))
    assert full.engine.eviction is None
    # Every part of the identity is in the hash: the eviction, the KV precision, the engine.
    hashes = {
        RunSpec.from_config(compose_cfg(o)).method_hash
        for o in (
            ["engine=openvino"],
            ["engine=openvino", "engine.aggregation=sum"],
            ["engine=openvino", "engine.kv_cache_precision=u8"],
            ["engine=openvino", "engine.kvcrush=2"],
            [],
        )
    }
    assert len(hashes) == 5


@needs_engine
@pytest.mark.parametrize(
    "overrides, named",
    [
        (["method=streamingllm"], "method=streamingllm"),
        (["method.kernel_size=5"], "kernel_size=5"),
        (["method.window=16"], "method.window=16"),
        (["budget=500"], "budget=500"),
        (["budget=64"], "budget=64"),
        (["method=full", "engine.kvcrush=2"], "engine.kvcrush=2"),
        (["engine.aggregation=mean"], "engine.aggregation='mean'"),
        (["engine.aggregation=adaptive_rkv", "engine.kvcrush=2"], "engine.kvcrush=2"),
        (["engine.aggregation=adaptive_rkv"], "engine.aggregation=adaptive_rkv"),
        (["method.protect=question"], "protect='question'"),
        (["task=fidelity"], "task 'fidelity'"),
        (["protocol=context_only"], "protocol=context_only"),
        (["model.name=some/hub-id"], "model.name='some/hub-id'"),
    ],
)
def test_what_the_engine_cannot_express_exits_2_before_anything_loads(
    overrides, named, monkeypatch, tmp_path, capsys
):
    import eval.runner as runner
    import run as run_module

    def no_load(*a, **k):
        raise AssertionError("a model was loaded although the config is refused")

    monkeypatch.setattr(runner, "load_model", no_load)
    monkeypatch.setattr(ov_engine.OpenVINOEngine, "load", no_load)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "run.py", f"hydra.run.dir={tmp_path}/hydra", "hydra.output_subdir=null",
            "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
            f"results_dir={tmp_path}/results", "engine=openvino", "compare=[]", *overrides,
        ],
    )  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        run_module.cli()
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and named in err[0], err
    assert not (tmp_path / "results").exists()


# ------------------------------------------------------------------------------------------ GGUF files
def test_f16_rewrite_keeps_metadata_and_dequantized_weights(tmp_path):
    src = tiny_llama_gguf(tmp_path / "q.gguf", toy_tokenizer(), GGMLQuantizationType.Q5_0)
    assert "Q5_0" in tensor_types(src)  # a type the engine's reader refuses
    dst = rewrite_f16(src, tmp_path / "out" / "q.f16.gguf")
    assert tensor_types(dst) == {"F16", "F32"} and not list(dst.parent.glob(".*.tmp"))
    a, b = GGUFReader(str(src)), GGUFReader(str(dst))
    meta = {k: field_value(f)[:2] for k, f in a.fields.items() if not k.startswith("GGUF.")}
    meta_b = {k: field_value(f)[:2] for k, f in b.fields.items() if not k.startswith("GGUF.")}
    assert meta_b.pop("general.file_type")[0] == 1 and meta.pop("general.file_type")[0] == 1
    assert meta_b == meta
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        assert ta.name == tb.name and list(ta.shape) == list(tb.shape)
        want = dequantize(ta.data, ta.tensor_type).reshape(-1)
        got = np.asarray(tb.data, np.float32).reshape(-1)
        np.testing.assert_array_equal(
            got, want.astype(np.float16 if tb.tensor_type.name == "F16" else np.float32)
        )


def test_models_the_engine_cannot_read_are_named(tmp_path):
    with pytest.raises(ValueError, match="model.name='meta-llama/Llama-3.1-8B'"):
        ov_engine.check_model("meta-llama/Llama-3.1-8B")
    with pytest.raises(ValueError, match="OpenVINO IR folder"):
        ov_engine.check_model(str(tmp_path))  # a folder without openvino_model.xml


def test_a_local_gguf_of_another_quantization_is_converted_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path / "cache"))
    src = tiny_llama_gguf(tmp_path / "q.gguf", toy_tokenizer(), GGMLQuantizationType.Q5_0)
    path = ov_engine.model_path(str(src))
    assert path.parent.parent == tmp_path / "cache" / "openvino" and path.name == "q.f16.gguf"
    mtime = path.stat().st_mtime_ns
    assert ov_engine.model_path(str(src)) == path and path.stat().st_mtime_ns == mtime
    readable = tiny_llama_gguf(tmp_path / "f16.gguf", toy_tokenizer())
    assert ov_engine.model_path(str(readable)) == readable.resolve()


def test_a_quantized_gguf_the_engine_reads_is_rewritten_unless_weights_file(tmp_path, monkeypatch):
    """weights=f16 (the default) gives the engine the harness' de-quantized weights; weights=file a
    Q8_0 / Q4_0 / Q4_1 file as it is (the engine's own kernels)."""
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path / "cache"))
    src = tiny_llama_gguf(tmp_path / "q8.gguf", toy_tokenizer(), GGMLQuantizationType.Q8_0)
    assert "Q8_0" in tensor_types(src)
    assert ov_engine.model_path(str(src), "file") == src.resolve()
    f16 = ov_engine.model_path(str(src))
    assert f16.name == "q8.f16.gguf" and tensor_types(f16) <= {"F16", "F32"}
    with pytest.raises(ValueError, match="weights='q4'"):
        ov_engine.model_path(str(src), "q4")
    with pytest.raises(ValueError, match="engine.weights='q4'"):
        ov_engine.OpenVINOEngine(weights="q4")
    assert ov_engine.OpenVINOEngine().identity()["weights"] == "f16"


# ------------------------------------------------------------------------------------------ parity
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path of the tiny GGUF, the transformers model loaded from it in float32)."""
    from transformers import AutoModelForCausalLM

    path = tiny_text_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return path, model.eval()


def engine_for(path, method: str, **params):
    engine = build_engine({"name": "openvino", "threads": 1}, build_method(method, **params))
    engine.load(str(path))
    return engine


def prompt_ids(n: int, seed: int = 1) -> list[int]:
    """`n` random ids of the tiny vocabulary's ordinary tokens (no special token: no EOS inside)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(len(SPECIAL), len(tiny_tokenizer()), (n,), generator=g).tolist()


@needs_engine
@in_child_process
def test_full_cache_greedy_tokens_match_transformers(tiny):
    from snapkv import generate_ids

    path, model = tiny
    engine = engine_for(path, "full")
    for n, seed in ((300, 1), (77, 2)):
        ids = prompt_ids(n, seed)
        ref, result = generate_ids(
            model, torch.tensor([ids]), None, build_method("full"), max_new_tokens=24, keep_logits=True
        )
        out = engine.generate(ids, 24, set())
        div = first_divergence(ref[0].tolist(), out.ids, [x[0] for x in result.logits])
        # Identical, or a near-tie that float rounding can flip: the report names the step and margin.
        assert div is None or div.margin < 1e-3, div.text()
        assert out.stop_reason == "length" and out.fields["new_tokens"] == 24
        assert out.fields["engine_kv_blocks_end"] == -(-(n + 23) // 32)  # nothing evicted


@needs_engine
@in_child_process
def test_token_parity_on_prompts_reports_identical_or_a_near_tie(tiny):
    """The token-parity tool (scripts/engine_tokens.py) on the tiny model: both sides decode every
    token (no stop), so a prompt is identical or names where it diverged."""
    from eval.analysis.engine_tokens import token_parity

    path, model = tiny
    divs = token_parity(model, engine_for(path, "full"), [prompt_ids(120, 4), prompt_ids(33, 5)], 16)
    assert len(divs) == 2 and all(d is None or d.margin < 1e-3 for d in divs)


def test_token_parity_tool_reads_engine_options_as_hydra_does():
    from eval.analysis.engine_tokens import _value, split

    overrides, options, new_tokens, out = split(
        ["model=m", "engine.threads=1", "engine.weights=file", "new_tokens=8"]
    )
    assert overrides == ["model=m"] and new_tokens == 8 and out is None
    assert {k: _value(v) for k, v in options.items()} == {"threads": 1, "weights": "file"}
    assert _value("null") is None and _value("true") is True


@pytest.mark.parametrize(
    "argv, named",
    [(["new_tokens=0"], "new_tokens=0"), (["engine.weights=q4"], "engine.weights='q4'"),
     (["model"], "key=value"),
     pytest.param(["model.name=meta-llama/Llama-3.1-8B"], "meta-llama/Llama-3.1-8B", marks=needs_engine)],
)  # fmt: skip
def test_token_parity_tool_refuses_bad_input_before_loading(argv, named, capsys, monkeypatch):
    from eval.analysis import engine_tokens

    monkeypatch.setattr(engine_tokens, "get_model", lambda spec: pytest.fail("loaded a model"))
    assert engine_tokens.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err


@needs_engine
@in_child_process
def test_budget_changes_what_the_engine_keeps_and_outputs(tiny):
    path, _ = tiny
    ids = prompt_ids(400, 3)
    outs = {b: engine_for(path, "snapkv", budget=b, window=32).generate(ids, 40, set()) for b in (96, 192)}
    full = engine_for(path, "full").generate(ids, 40, set())
    for budget, out in outs.items():
        # The prompt's 13 blocks are all there after the prefill, then cut to the budget's blocks
        # (+ the block being filled, which evicts once full).
        assert out.fields["engine_kv_blocks_peak"] == 13 and out.fields["compressed"]
        assert out.fields["engine_kv_blocks_end"] <= budget // 32 + 1
    assert outs[96].fields["engine_kv_blocks_end"] < outs[192].fields["engine_kv_blocks_end"]
    assert full.fields["engine_kv_blocks_end"] == -(-(400 + 39) // 32) and not full.fields["compressed"]
    assert outs[96].ids != full.ids and outs[96].ids != outs[192].ids


@pytest.mark.slow  # a Hydra run through the engine in a fresh interpreter: the e2e tier (the two parity tests above stay fast)
@needs_engine
@in_child_process
def test_a_run_through_the_harness_writes_engine_rows(tiny, tmp_path):
    """The runner's engine path on the tiny model: prompts rendered by the harness, answers scored,
    rows naming the engine; the same prompts as the transformers path (`prompt_sha`)."""
    import eval.runner as runner
    from eval.runner import prompt_sha, run

    path, _ = tiny
    common = [
        f"model.name={path}", "model.tokenizer=null", "task.haystack=noise", "task.lengths=[400]",
        "task.depths=[50]", "task.max_new_tokens=8", f"results_dir={tmp_path}", "progress=false",
        "report=false", "budget=128",
    ]  # fmt: skip
    spec = RunSpec.from_config(compose_cfg(["engine=openvino", "engine.threads=1", *common]))
    run(spec)
    (row,) = [json.loads(x) for x in spec.result_path.read_text().splitlines()]
    assert row["status"] == "ok", row["error"]
    assert row["engine"] == "openvino" and row["engine_version"] == ov_engine.version()
    assert row["engine_config"]["kv_block_size"] == 32 and row["engine_config"]["kv_cache_precision"] == "f32"
    assert row["engine_config"]["eviction"]["max_cache_size"] == 128
    assert row["method_hash"] == spec.method_hash and row["new_tokens"] <= 8
    harness = RunSpec.from_config(compose_cfg(["engine=transformers", *common]))
    assert harness.method_hash != spec.method_hash
    ((_, tok, _),) = runner._LOADED.values()  # the tokenizer the run rendered its prompts with
    (sample,) = list(spec.task.samples(tok))
    assert row["prompt_sha"] == prompt_sha(tok, sample, True)
    # The report's labels name the engine.
    from eval.report.build import prepare
    from eval.store import ResultStore

    assert list(prepare(ResultStore.load_dir(tmp_path))["config_label"]) == [
        "snapkv b=128 w=32 k=7 max [openvino]"
    ]


# ------------------------------------------------------------------------------ accuracy agreement
def synthetic_rows(scores, *, engine=None, method_hash="h", params=None, dataset="d", texts=None):
    return pd.DataFrame(
        [
            {
                "sample_id": f"s{i}", "prompt_sha": f"p{i}", "status": "ok", "score": s, "dataset": dataset,
                "task": "needle", "model": "m", "method": "snapkv", "method_hash": method_hash,
                "method_params": params or {"budget": 512, "window": 32}, "engine": engine,
                "prediction": texts[i] if texts else f"answer {s}",
            }
            for i, s in enumerate(scores)
        ]
    )  # fmt: skip


def test_first_divergence_reports_the_step_and_margin():
    logits = [np.array([0.0, 2.0, 1.0]), np.array([[3.0, 0.5, 2.5]])]
    assert first_divergence([1, 0], [1, 0], logits) is None
    d = first_divergence([1, 0], [1, 2], logits)
    assert (d.step, d.reference, d.engine, d.margin) == (1, 0, 2, 0.5)
    assert first_divergence([1], [1, 0], logits).step == 1


def test_agreement_pairs_samples_and_gives_a_paired_interval():
    rng = np.random.default_rng(0)
    harness = rng.integers(0, 2, 40).astype(float)
    engine = harness.copy()
    engine[:6] = 1 - engine[:6]  # 6 flips
    a = agreement(synthetic_rows(engine, engine="openvino"), synthetic_rows(harness), margin=5)
    flips_up = int(((engine == 1) & (harness == 0)).sum())
    assert a.n == 40 and a.same == pytest.approx(34 / 40) and a.identical == pytest.approx(34 / 40)
    assert (a.engine_better, a.harness_better) == (flips_up, 6 - flips_up)
    assert a.comparison.diff == pytest.approx(100 * (engine.mean() - harness.mean()))
    assert a.comparison.lo <= a.comparison.diff <= a.comparison.hi and a.comparison.test == "mcnemar"
    assert a.equivalence is not None and a.equivalence.margin == 5
    # Rows of other prompts (another prompt hash) do not pair.
    other = synthetic_rows(harness).assign(prompt_sha="other")
    with pytest.raises(ValueError, match="no sample is in both"):
        agreement(synthetic_rows(engine, engine="openvino"), other)


def test_parity_table_holds_each_engine_config_against_the_matching_harness_config():
    e = synthetic_rows([1, 1, 0, 1, 0, 1], engine="openvino", method_hash="eng")
    same = synthetic_rows([1, 0, 0, 1, 0, 1], method_hash="base")
    kernel = synthetic_rows([0] * 6, method_hash="k5", params={"budget": 512, "window": 32, "kernel_size": 5})
    other_budget = synthetic_rows([0] * 6, method_hash="b256", params={"budget": 256, "window": 32})
    df = pd.concat([e, kernel, same, other_budget], ignore_index=True)
    assert set(closest(df, "eng")["method_hash"]) == {"base"}
    table = parity_table(df)
    (line,) = [x for x in table.splitlines() if "#eng" in x]
    assert "#base" in line and "| 6 | 83% | 83% | 1 | 0 | 66.7 | 50.0 |" in line
    # the same score with another text: the texts' share says so
    texts = [f"t{i}" for i in range(6)]
    e2 = synthetic_rows(
        [1, 0, 0, 1, 0, 1], engine="openvino", method_hash="eng", texts=[*texts[:3], "x", "y", "z"]
    )
    b2 = synthetic_rows([1, 0, 0, 1, 0, 1], method_hash="base", texts=texts)
    (line,) = [x for x in parity_table(pd.concat([e2, b2], ignore_index=True)).splitlines() if "#eng" in x]
    assert "| 6 | 100% | 50% | 0 | 0 |" in line
    lone = synthetic_rows(
        [1] * 3, engine="openvino", method_hash="lone", params={"budget": 1024, "window": 32}
    )
    assert "| none |" in parity_table(pd.concat([lone, same], ignore_index=True))
    # the same configs on a second model: a line per model, each against its own harness rows
    other = [x.assign(model="m2", score=1 - x["score"]) for x in (e, same)]
    lines = [
        x for x in parity_table(pd.concat([e, same, *other], ignore_index=True)).splitlines() if "#eng" in x
    ]
    assert len(lines) == 2 and "| m | " in lines[0] and "| m2 | " in lines[1]
    assert (
        "| 6 | 83% | 83% | 1 | 0 | 66.7 | 50.0 |" in lines[0]
        and "| 6 | 83% | 83% | 0 | 1 | 33.3 | 50.0 |" in lines[1]
    )
