"""Observation mode (snapkv/observe.py) and its analysis CLI (eval/analysis/observation.py, conf/observation.yaml,
scripts/observation.py), on tiny random models."""

from __future__ import annotations

import csv
import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import COMMON, random_ids, tiny_model
from reference import eager_attentions
from transformers import AutoModelForCausalLM, MistralConfig

import eval.analysis.observation
from snapkv import CompressedCache, prefill
from snapkv.cache import full_attention_layers
from snapkv.hooks import session
from snapkv.methods.base import Method, window_attention
from snapkv.observe import (
    Observation,
    attended,
    common_prefix,
    hit_rate,
    hit_rates,
    input_window_hit_rates,
    overlap,
    record,
    recording_bytes,
    sink_recent,
    top_fraction,
    voted,
)

ROOT = Path(__file__).resolve().parents[1]
L, W, T = 48, 8, 6


@pytest.fixture(scope="module")
def recorded():
    model = tiny_model("llama")
    ids = random_ids(L)
    obs = record(
        model, ids, window=W, new_tokens=T, input_windows=2, input_window=16, store_dtype=torch.float32
    )
    # Independent reference: one eager forward of prompt + generated tokens (teacher forcing).
    att = eager_attentions(model, torch.cat([ids[0], obs.generated_ids])[None])
    return model, ids, obs, att


def test_shapes_and_bookkeeping(recorded):
    model, ids, obs, _ = recorded
    p = L - W
    assert obs.layers == [0, 1, 2] and obs.prefix_len == p and obs.new_tokens == T
    assert obs.votes.shape == (3, 4, p) and obs.votes.dtype == torch.float32
    assert obs.gen_attention.shape == (3, 4, T, p)
    assert obs.input_votes.shape == (2, 3, 4, L - 32) and obs.input_region == L - 32
    assert torch.equal(obs.prompt_ids, ids[0])
    assert obs.nbytes() == 4 * (3 * 4 * p + 3 * 4 * T * p + 2 * 3 * 4 * (L - 32))
    assert recording_bytes(3, 4, T, p, torch.float32) == 3 * 4 * T * p * 4
    assert model.config._attn_implementation == "sdpa"


def test_votes_equal_eager_attention_of_the_window(recorded):
    _, _, obs, att = recorded
    for li in obs.layers:
        ref = att[li][0, :, L - W : L, : L - W].sum(1)  # [heads, P]: window rows over the prefix
        torch.testing.assert_close(obs.votes[li].double(), ref, atol=1e-5, rtol=1e-5)
        for j, (s, e) in enumerate([(16, 32), (32, 48)]):  # the two input windows over [:16]
            torch.testing.assert_close(obs.input_votes[j, li].double(), att[li][0, :, s:e, :16].sum(1),
                                       atol=1e-5, rtol=1e-5)  # fmt: skip


def test_votes_equal_snapkv_window_attention_summed_over_groups():
    """The votes are exactly what SnapKV scores: `window_attention` on the model's own post-RoPE
    queries/keys (captured through the hooks), per query head, prefix columns."""
    model = tiny_model("llama")
    ids = random_ids(L)
    captured = {}

    class Capture(Method):
        def observe(self, layer, query, key, module):
            captured[module.layer_idx] = window_attention(query, key, W, module.scaling)  # [b, kv, g, L]

    cache = CompressedCache(model.config)
    with session(model, Capture(), cache) as s, torch.no_grad():
        prefill(model, ids, cache, session=s)
    obs = record(model, ids, window=W, new_tokens=1)
    for li in obs.layers:
        ref = captured[li].flatten(1, 2)[0, :, : L - W]  # query head h = kv * group + g
        torch.testing.assert_close(obs.votes[li], ref, atol=1e-5, rtol=1e-5)


def test_generation_rows_equal_teacher_forcing_and_sum_to_at_most_one(recorded):
    _, ids, obs, att = recorded
    for li in obs.layers:
        rows = att[li][0, :, L : L + T, : L - W]  # queries of generated tokens 0..T-1 over the prefix
        torch.testing.assert_close(obs.gen_attention[li].double(), rows, atol=1e-5, rtol=1e-5)
    sums = obs.gen_attention.sum(-1)
    assert (sums <= 1 + 1e-5).all() and (sums > 0).all()


def test_generation_is_greedy_and_suppressed_ids_never_appear():
    model = tiny_model("llama")
    ids = random_ids(L)
    obs = record(model, ids, window=W, new_tokens=T, store_dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([ids[0], obs.generated_ids])[None]).logits[0]
    assert obs.generated_ids.tolist() == logits[L - 1 : L - 1 + T].argmax(-1).tolist()
    banned = set(obs.generated_ids.tolist())
    again = record(model, ids, window=W, new_tokens=T, suppress_ids=banned)
    assert not banned & set(again.generated_ids.tolist())
    assert again.gen_attention.dtype == torch.float16  # the default storage


def test_attention_implementation_restored_even_on_error(monkeypatch):
    model = tiny_model("llama")
    original = model.forward

    @functools.wraps(original)  # keeps the signature (the cache kwarg seam inspects it)
    def failing(*args, **kwargs):
        if kwargs.get("output_attentions"):
            assert model.config._attn_implementation == "eager"
            raise RuntimeError("boom")
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", failing)
    with pytest.raises(RuntimeError, match="boom"):
        record(model, random_ids(L), window=W, new_tokens=2)
    assert model.config._attn_implementation == "sdpa"
    assert model.model.config._attn_implementation == "sdpa"


def test_hybrid_model_records_full_attention_layers_only():
    model = tiny_model("gemma3")
    obs = record(model, random_ids(40), window=W, new_tokens=2)
    assert obs.layers == [i for i, t in enumerate(model.config.layer_types) if t == "full_attention"]
    assert obs.votes.shape[0] == len(obs.layers) and len(obs.layers) < model.config.num_hidden_layers


@pytest.mark.parametrize(
    "kw",
    [
        dict(window=0),
        dict(window=L),
        dict(new_tokens=0),
        dict(input_windows=3, input_window=16),
        dict(input_windows=1, input_window=4),
    ],  # fmt: skip
)
def test_bad_arguments_raise_value_error(kw):
    args = dict(window=W, new_tokens=2) | kw
    with pytest.raises(ValueError):
        record(tiny_model("llama"), random_ids(L), **args)
    with pytest.raises(ValueError, match="batch"):
        record(tiny_model("llama"), random_ids(L, batch=2), window=W, new_tokens=1)


# ---- metrics on hand-made tensors ---------------------------------------------------------------


def test_top_fraction_takes_ceil_and_breaks_ties_to_the_earlier_position():
    scores = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    assert top_fraction(scores, 0.2).nonzero()[:, 1].tolist() == [1, 3]  # k = 2
    assert top_fraction(scores, 0.1).nonzero()[:, 1].tolist() == [1]  # tie 1 vs 3: earlier wins
    assert top_fraction(scores, 0.25).sum() == 3  # ceil(2.5)
    assert top_fraction(scores, 0.01).sum() == 1  # at least one
    with pytest.raises(ValueError):
        top_fraction(scores, 0.0)


def test_attended_windows_union_above_theta_and_drop_the_partial_window():
    g = torch.zeros(1, 1, 7, 6)  # [layers, heads, T=7, P=6]
    g[0, 0, 0, 1] = 0.5  # window 0 (tokens 0-2)
    g[0, 0, 2, 4] = 0.06
    g[0, 0, 1, 3] = 0.05  # == theta: not above
    g[0, 0, 4, 0] = 0.9  # window 1 (tokens 3-5)
    g[0, 0, 6, 5] = 0.9  # token 6: incomplete third window, dropped
    a = attended(g, theta=0.05, gen_window=3)
    assert a.shape == (1, 1, 2, 6)
    assert a[0, 0, 0].nonzero().flatten().tolist() == [1, 4]
    assert a[0, 0, 1].nonzero().flatten().tolist() == [0]
    with pytest.raises(ValueError, match="no complete generation window"):
        attended(g, gen_window=8)


def test_hit_rate_exact_values_per_window_and_layer():
    p = 20  # top 5% of 20 -> k = 1; top 10% -> k = 2
    votes = torch.zeros(2, 2, p)
    votes[0, 0, [3, 7]] = torch.tensor([2.0, 1.0])  # layer 0 head 0 votes 3 (then 7)
    votes[0, 1, [5, 6]] = torch.tensor([2.0, 1.0])  # head 1 votes 5 (then 6)
    votes[1, :, 0] = 1.0  # layer 1: both heads vote the sink
    gen = torch.zeros(2, 2, 256 + 10, p)  # two full windows of 128 (+10 tokens dropped)
    gen[0, 0, 5, [3, 9]] = 0.3  # window 0: head 0 attends {3, 9}
    gen[0, 0, 200, 7] = 0.2  # window 1: head 0 attends {7}
    gen[0, 1, 0, 5] = 0.6  # window 0: head 1 attends {5}; window 1 nothing (NaN, left out)
    gen[0, 1, 130, 5] = 0.04  # below theta
    gen[1, :, :256, 0] = 0.9  # layer 1: every token attends the sink
    gen[1, 0, 100, 2] = 0.9  # ... head 0 also attends 2 in window 0
    obs = Observation(torch.arange(p + 4), torch.arange(266), 4, [0, 1], votes, gen)
    rate, per_head = hit_rates(obs, p=0.05, theta=0.05, gen_window=128)
    assert rate.shape == (2, 2) and per_head.shape == (2, 2, 2)
    assert per_head[0, 0].tolist() == [0.5, 1.0] and per_head[1, 0, 0] == 0.0
    assert math.isnan(per_head[1, 0, 1])
    torch.testing.assert_close(rate, torch.tensor([[0.75, 0.75], [0.0, 1.0]]))
    rate10, _ = hit_rates(obs, p=0.10, theta=0.05, gen_window=128)  # k = 2: head 0 also votes 7
    torch.testing.assert_close(rate10[:, 0], torch.tensor([0.75, 1.0]))
    # Max-pooling (k=3) spreads the vote of 3 over 2..4: the earliest of the tie (2) is the top-1.
    assert voted(votes, 0.05, 3, "max")[0, 0].nonzero().flatten().tolist() == [2]


def test_hit_rate_broadcasts_and_is_nan_when_nothing_is_attended():
    v = torch.tensor([True, True, False, False])
    a = torch.tensor([[True, False, True, False], [False, False, False, False]])
    r = hit_rate(v, a)
    assert r[0] == 0.5 and math.isnan(r[1])


def test_input_window_hit_rates_use_the_shared_region():
    p, s = 12, 8
    gen = torch.zeros(1, 1, 4, p)
    gen[0, 0, :, 2] = 0.5
    gen[0, 0, :, 10] = 0.5  # outside the region [:8]: ignored
    iv = torch.zeros(2, 1, 1, s)
    iv[0, 0, 0, 2] = 1.0  # the older input window votes 2: hit
    iv[1, 0, 0, 5] = 1.0  # the last one votes 5: miss
    obs = Observation(torch.arange(16), torch.arange(4), 4, [0], torch.zeros(1, 1, p), gen, 4, iv)
    r = input_window_hit_rates(obs, p=0.1, theta=0.05, gen_window=2)  # k = ceil(0.8) = 1
    assert r.shape == (2, 2, 1)
    assert r[0].flatten().tolist() == [1.0, 1.0] and r[1].flatten().tolist() == [0.0, 0.0]


def test_overlap_and_jaccard_on_hand_made_sets():
    a = torch.zeros(2, 10, dtype=torch.bool)
    b = torch.zeros(2, 10, dtype=torch.bool)
    a[0, [0, 1, 2, 3]] = True
    b[0, [2, 3, 4, 5]] = True  # |a∩b| = 2, k = 4, union 6
    a[1, [0, 1]] = True
    b[1, [0, 1, 2, 3]] = True  # subset: overlap 1 (by the smaller set), Jaccard 0.5
    ov, jac = overlap(a, b)
    torch.testing.assert_close(ov, torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(jac, torch.tensor([2 / 6, 0.5]))
    ov, jac = overlap(torch.zeros(3, dtype=torch.bool), torch.zeros(3, dtype=torch.bool))
    assert math.isnan(ov) and math.isnan(jac)


def test_sink_recent_baseline_has_the_same_size_as_the_top_fraction():
    m = sink_recent(100, 0.05)  # k = 5: 4 sinks + the last one
    assert m.nonzero().flatten().tolist() == [0, 1, 2, 3, 99]
    assert sink_recent(100, 0.10).sum() == 10 and sink_recent(10, 0.05).nonzero().flatten().tolist() == [0]


def test_repetition_of_a_generation():
    cli = _cli()
    assert cli.repetition([1, 2, 3, 4, 5, 6]) == 0.0
    assert cli.repetition([1, 2, 3, 4] * 4) == pytest.approx(1 - 4 / 13)
    assert cli.repetition([1, 2]) == 0.0


def test_common_prefix():
    assert common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert common_prefix([[1, 2], [1, 2, 3]]) == 2
    assert common_prefix([[7], [8]]) == 0


# ---- the CLI ----------------------------------------------------------------------------------


def _cli():
    return eval.analysis.observation


def test_cli_end_to_end_on_a_random_tiny_model(tmp_path):
    out = tmp_path / "obs"
    # theta=0: every prefix position is attended (softmax > 0), so the hit rate is exactly k / P.
    args = ["model.name=random:llama-tiny", "context_tokens=96", "new_tokens=16", "gen_window=8", "window=8",
            "input_windows=2", "input_window=16", "documents=1", "theta=0.0", f"out_dir={out}"]  # fmt: skip
    assert _cli().main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["source"] == "random" and summary["recordings"] == 8  # 4 instructions x 2 placements
    hit = list(csv.DictReader((out / "hit_rate.csv").open()))
    # 8 recordings x 4 selections x 2 generation windows x 2 layers
    assert len(hit) == 8 * 4 * 2 * 2
    names = {"top5%", "top5%+maxpool7", "sink4+recent (baseline)", "top5% (sinks excluded)"}
    assert {r["selection"] for r in hit} == names
    prefix = 96 + 12 - 8
    for r in hit:  # every selection holds k = ceil(5% of P) = 5 positions; all P are attended
        assert int(r["heads"]) == 4 and int(r["voted"]) == 5
        if r["selection"] != "top5% (sinks excluded)":
            assert float(r["hit_rate"]) == pytest.approx(5 / prefix, abs=1e-6)
        else:  # the top-5 positions that are not among the first 4, over the P - 4 others
            assert float(r["hit_rate"]) <= 5 / (prefix - 4) + 1e-6
    assert {r["gen_tokens"] for r in hit} == {"0-7", "8-15"}
    over = list(csv.DictReader((out / "overlap.csv").open()))
    assert len(over) == 2 * 6 * 2  # (window, generation) x 6 instruction pairs x 2 layers
    assert all(int(r["shared_tokens"]) == 96 for r in over)
    inp = list(csv.DictReader((out / "input_windows.csv").open()))
    assert {r["input_window"] for r in inp} == {"-2", "-1"}
    assert len((out / "generations.jsonl").read_text().splitlines()) == 8
    toks = list(csv.DictReader((out / "attended_tokens.csv").open()))
    assert len(toks) == 8 * 2 * 5  # top-5 positions per layer and recording
    assert all(
        int(r["attended"]) == 4 * 2 and 0 <= int(r["voted_heads"]) <= 4 for r in toks
    )  # heads x windows
    rec = list(csv.DictReader((out / "recordings.csv").open()))
    assert len(rec) == 8 and all(0 <= float(r["voted_median_pos"]) <= 1 for r in rec)
    figures = ["fig2_input_windows", "fig3_hit_rate", "fig4_instruction_overlap", "fig5_question_position"]
    assert summary["figures"] == [f"{f}.png" for f in ["fig3_hit_rate", "fig4_instruction_overlap",
                                                        "fig5_question_position", "fig2_input_windows"]]  # fmt: skip
    for name in figures:
        path = out / f"{name}.png"
        assert path.read_bytes()[:4] == b"\x89PNG"
        path.unlink()
    # Figures are rebuilt from the stored CSVs alone.
    assert _cli().main(["replot=true", f"out_dir={out}"]) == 0
    assert all((out / f"{name}.png").exists() for name in figures)


def test_cli_rejects_unknown_options_and_bad_values(tmp_path, capsys):
    cli = _cli()
    assert cli.main(["no_such_option=1"]) == 2
    assert "no_such_option" in capsys.readouterr().err
    assert cli.main(["model=no-such-model"]) == 2
    assert "no-such-model" in capsys.readouterr().err
    tiny = ["model.name=random:llama-tiny", f"out_dir={tmp_path}"]
    assert cli.main([*tiny, "new_tokens=4", "gen_window=8"]) == 2
    assert cli.main([*tiny, "source=paul_graham"]) == 2
    assert "needs a tokenizer" in capsys.readouterr().err


def test_observation_is_configured_from_conf_like_run_py():
    """The model group and its defaults come from conf/model/ (not re-declared), the analysis keys
    from conf/observation.yaml; scripts/observation.py is a thin entry point."""
    cfg = _cli().compose(["model=qwen2.5-coder-0.5b-instruct", "window=16"])
    assert cfg.model.name == "qwen2.5-coder-0.5b-instruct" and cfg.window == 16
    assert cfg.chat_template is True and cfg.top_p == 0.05
    assert "DEFAULTS" not in vars(_cli())
    script = (ROOT / "scripts" / "observation.py").read_text()
    assert len(script.splitlines()) < 25 and "from eval.analysis.observation import main" in script
    old = {"model": "smollm2-135m-instruct", "dtype": "float32", "window": 8, "top_p": 0.1}
    analysis = _cli().analysis_config(old)  # a summary.json written before the move still replots
    assert analysis.window == 8 and analysis.top_p == 0.1 and "model" not in analysis


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_observation_script_runs_as_a_file(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "observation.py"), "no_such_option=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "no_such_option" in proc.stderr


def test_a_sliding_window_config_without_layer_types_has_no_layer_to_record():
    # No `layer_types` and a `sliding_window`: transformers types every layer as sliding attention.
    config = MistralConfig(num_hidden_layers=2, sliding_window=16, **COMMON)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert full_attention_layers(model.config) == []
    with pytest.raises(ValueError, match="no full-attention layer.*sliding_attention"):
        record(model, random_ids(40), window=W, new_tokens=2)
