"""`task=fidelity`: teacher forcing on a compressed cache, the metrics against an independent
formula, the full cache's log-probs shared across methods, rows, report and bad input."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from cache_paths import catalogue_cases
from conftest import random_ids, tiny_model
from reference import masked_reference_logits, record_visible

import eval.runner as runner
import eval.tasks.fidelity.task as fidelity
from eval.report import build_report, write_report
from eval.rescore import rescore_dir
from eval.store import ROW_FIELDS, fields_missing, read_rows
from eval.tasks import build_task
from snapkv import build_method, compress_context, teacher_force
from tests import test_runner
from tests.test_report import SNAP, base_row, write
from tests.test_runner import make_cfg, result_files, run_cli_in_process

tiny_dir = test_runner.tiny_dir  # the saved tiny model (session fixture)

FIDELITY = ["task.haystack=noise", "task.context_tokens=120", "task.continuation_tokens=12"]


def fidelity_cfg(tiny_dir, results, *overrides):
    return make_cfg(tiny_dir, results, *FIDELITY, *overrides, task="fidelity")


# ------------------------------------------------------------------------------------- library
@pytest.mark.parametrize("method", ["full", "snapkv"])
def test_teacher_force_gives_every_position_of_a_forward_over_the_kept_entries(method):
    """Full cache: the logits of one forward over context + continuation. SnapKV: the same
    continuation on the cache it compressed equals a fresh forward that feeds it on that cache."""
    model = tiny_model("llama")
    ids = random_ids(90)
    m = build_method(method, budget=40, window=8) if method == "snapkv" else build_method("full")
    cache = compress_context(model, ids[:, :70], m)
    got = teacher_force(model, cache, ids[:, 70:], m)
    assert got.shape == (1, 20, model.config.vocab_size) and got.dtype == torch.float32
    if method == "full":
        with torch.inference_mode():
            want = model(input_ids=ids).logits[:, 70:].float()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert cache.get_seq_length() == 70  # rolled back
    else:
        assert any(layer.compressed for _, layer in cache.compressible_layers())
        again = teacher_force(model, cache, ids[:, 70:], m)  # the rollback restored the cache exactly
        assert torch.equal(got, again)


# In the fast tier the first entry of each mechanism and the cache paths' representatives (teacher
# forcing feeds the continuation through the same forwards whichever entries a method's switches
# keep), the other switch settings in the slow tier (tests/cache_paths.py).
@pytest.mark.parametrize("name,params", catalogue_cases())
def test_teacher_forcing_equals_the_masked_full_cache_at_every_position(name, params):
    """Every method: each continuation position's logits equal a full-cache forward whose attention
    sees only the entries the compressed run's forward saw (`tests/reference.py`)."""
    model = tiny_model("llama")
    ids = random_ids(112)
    ctx, cont = ids[:, :96], ids[:, 96:]
    method = build_method(name, **params)

    def run():
        cache = compress_context(model, ctx, method)
        return teacher_force(model, cache, cont, method, rollback=False)

    got, records = record_visible(model, run)
    (ref,) = masked_reference_logits(model, [ctx], [cont], records, every_position=True)[1:]
    assert got.shape == ref.shape == (1, 16, model.config.vocab_size)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_the_metrics_match_an_independent_formula():
    g = torch.Generator().manual_seed(0)
    p = torch.log_softmax(torch.randn(7, 50, generator=g), dim=-1)
    q = torch.log_softmax(torch.randn(7, 50, generator=g), dim=-1)
    q[2] = p[2]  # one position where the method agrees exactly
    targets = torch.randint(0, 50, (7,), generator=g)
    got = fidelity.fidelity_metrics(p, q, targets)
    kl = F.kl_div(q.double(), p.double(), log_target=True, reduction="none").sum(-1)
    assert got["kl"] == pytest.approx(kl.mean().item(), rel=1e-9)
    assert got["kl_max"] == pytest.approx(kl.max().item(), rel=1e-9)
    agree = sum(int(p[i].argmax() == q[i].argmax()) for i in range(7)) / 7
    assert got["top1_agreement"] == pytest.approx(agree) and 1 / 7 <= agree < 1
    nll_p = F.nll_loss(p, targets).item()
    nll_q = F.nll_loss(q, targets).item()
    assert got["nll_full"] == pytest.approx(nll_p, rel=1e-6)
    assert got["ppl_method"] == pytest.approx(math.exp(nll_q), rel=1e-6)
    assert got["delta_log_ppl"] == pytest.approx(nll_q - nll_p, rel=1e-6)
    same = fidelity.fidelity_metrics(p, p, targets)
    assert same["kl"] == 0.0 and same["top1_agreement"] == 1.0 and same["delta_log_ppl"] == 0.0


# ------------------------------------------------------------------------------------- passages
def test_passages_are_consecutive_stretches_of_the_stream_and_grow_stably(tiny_dir):
    tokenizer = runner.load_tokenizer(tiny_dir)
    few = list(build_task("fidelity", haystack="noise", context_tokens=30, continuation_tokens=5,
                          num_samples=2).samples(tokenizer))  # fmt: skip
    more = list(build_task("fidelity", haystack="noise", context_tokens=30, continuation_tokens=5,
                           num_samples=3).samples(tokenizer))  # fmt: skip
    assert [p.ids for p in few] == [p.ids for p in more[:2]]
    prefix = fidelity.special_prefix(tokenizer)
    stream = fidelity.token_stream(tokenizer, "noise", 3 * 36)
    for i, p in enumerate(more):
        assert p.ids == prefix + stream[i * 36 : (i + 1) * 36]
        assert p.context_len == len(prefix) + 30 and len(p.ids) - p.context_len == 6
        assert p.extra["passage_offset"] == i * 36


def test_a_dir_haystack_is_read(tiny_dir, tmp_path):
    (tmp_path / "a.txt").write_text("The grass is green. " * 40)
    (tmp_path / "b.txt").write_text("The sky is blue. " * 40)
    tokenizer = runner.load_tokenizer(tiny_dir)
    task = build_task("fidelity", haystack=f"dir:{tmp_path}", context_tokens=50, continuation_tokens=4,
                      num_samples=2)  # fmt: skip
    passages = list(task.samples(tokenizer))
    assert len(passages) == 2 and "grass" in passages[0].context


# ------------------------------------------------------------------------------------------ runs
def test_the_full_cache_has_kl_0_and_agrees_everywhere(tiny_dir, tmp_path):
    results = tmp_path / "results"
    runner.run(fidelity_cfg(tiny_dir, results, "method=full", "task.num_samples=2"))
    (path,) = result_files(results)
    rows = read_rows(path)
    assert len(rows) == 2 and all(r["status"] == "ok" for r in rows), rows[0]["error"]
    for r in rows:
        assert r["kl"] == 0.0 and r["kl_max"] == 0.0
        assert r["top1_agreement"] == 1.0 and r["score"] == 1.0
        assert r["ppl_method"] == r["ppl_full"] and r["delta_log_ppl"] == 0.0
        assert r["compressed"] is False and r["kv_tokens"] == r["input_tokens"]
    # Rescoring has no stored text to score again: the rows stay as they are.
    before = path.read_bytes()
    assert rescore_dir(results, []) == {path: (2, 0)} and path.read_bytes() == before


# The task's own row columns (FidelityTask's docstring).
FIDELITY_COLUMNS = {
    "passage_index", "passage_offset", "context_tokens", "continuation_tokens", "haystack", "kl", "kl_max",
    "top1_agreement", "nll_full", "nll_method", "ppl_full", "ppl_method", "delta_log_ppl", "teacher_force_s",
}  # fmt: skip


def test_a_compressing_method_moves_away_and_rows_carry_the_metrics(tiny_dir, tmp_path):
    results = tmp_path / "results"
    runner.run(
        fidelity_cfg(tiny_dir, results, "method=snapkv", "budget=32", "method.window=8", "task.num_samples=2")
    )
    (path,) = result_files(results)
    rows = read_rows(path)
    assert all(r["status"] == "ok" for r in rows), rows[0]["error"]
    for r in rows:
        assert not fields_missing(r, ROW_FIELDS)
        # The documented columns, and no per-layer sizes: the committed rows' columns.
        assert FIDELITY_COLUMNS <= set(r) and "kv_tokens_per_layer" not in r
        assert r["task"] == "fidelity" and r["compressed"] is True and r["kv_tokens"] == 32
        assert r["kl"] > 0 and r["kl_max"] >= r["kl"]
        assert 0 <= r["score"] == r["top1_agreement"] == r["scores"]["top1_agreement"] <= 1
        assert r["delta_log_ppl"] == pytest.approx(math.log(r["ppl_method"]) - math.log(r["ppl_full"]))
        assert r["context_tokens"] == 120 and r["continuation_tokens"] == 12
        assert r["input_tokens"] >= 120 and r["prefill_s"] > 0 and r["teacher_force_s"] > 0
        assert isinstance(r["prediction"], str) and r["prompt_sha"] and r["target_sha"]
    assert rows[0]["prompt_sha"] != rows[1]["prompt_sha"]


def test_the_full_cache_log_probs_are_computed_once_for_several_methods(tiny_dir, tmp_path, monkeypatch):
    calls = []
    real = fidelity.continuation_logprobs

    def counting(model, ids, context_len, method, chunk_size):
        calls.append(method.name)
        return real(model, ids, context_len, method, chunk_size)

    monkeypatch.setattr(fidelity, "continuation_logprobs", counting)
    results = tmp_path / "results"
    for method in ("snapkv", "streamingllm"):
        runner.run(fidelity_cfg(tiny_dir, results, f"method={method}", "budget=48", "task.num_samples=2"))
    assert calls.count("full") == 2  # one per passage, not per passage and method
    assert calls.count("snapkv") == 2 and calls.count("streamingllm") == 2
    assert len(list((results / ".cache" / "fidelity").rglob("*.pt"))) == 2
    # The same passages' full-cache rows agree with the stored log-probs: a run of `full` itself
    # computes its own and finds KL exactly 0 against the shared ones.
    runner.run(fidelity_cfg(tiny_dir, results, "method=full", "task.num_samples=2"))
    assert calls.count("full") == 4  # the full method's own two passages, the reference read from disk
    rows = [r for p in result_files(results) for r in read_rows(p) if r["method"] == "full"]
    assert [r["kl"] for r in rows] == [0.0, 0.0]
    # Another prefill chunking is another reference (its forwards differ in rounding).
    runner.run(fidelity_cfg(tiny_dir, results, "method=snapkv", "budget=48", "task.num_samples=1",
                            "prefill.chunk_size=64"))  # fmt: skip
    assert calls.count("full") == 5

    write_report(results)
    report = (results / "report.md").read_text()
    assert "## Fidelity to the full cache" in report and "top-1 %" in report
    # summary.csv (what a leaderboard reads): score = top-1 agreement x100, per config.
    summary = pd.read_csv(results / "summary.csv").set_index("label")
    assert summary.loc["full", "score"] == 100.0
    snap = [r for p in result_files(results) for r in read_rows(p) if r["method"] == "snapkv"]
    one_pass = [r for r in snap if r["prefill_chunk_size"] is None]
    label = "snapkv b=48 w=32 k=7 max chunk=none"
    assert summary.loc[label, "score"] == pytest.approx(
        100 * sum(r["score"] for r in one_pass) / len(one_pass)
    )


def test_the_report_lists_no_flips_for_top1_agreement_and_still_pairs_it_with_the_full_cache(tmp_path):
    """Top-1 agreement is a fraction, not a right-or-wrong grade: a passage where SnapKV agrees on
    30% of positions is no "broke" sample. The paired difference from the full cache stays; a
    needle run in the same folder keeps its flips."""
    rows = []
    agreement = [0.3, 0.9, 0.4, 0.95, 0.2, 0.85]
    for i, top1 in enumerate(agreement):
        extra = dict(passage_index=i, context_tokens=120, continuation_tokens=12, kl=0.0, kl_max=0.0,
                     nll_full=1.0, nll_method=1.0, ppl_full=math.e, ppl_method=math.e, delta_log_ppl=0.0)  # fmt: skip
        rows.append(
            base_row(f"fidelity-{i}", "fidelity", "noise", "full", {}, 1.0, top1_agreement=1.0, **extra)
        )
        rows.append(base_row(f"fidelity-{i}", "fidelity", "noise", "snapkv", SNAP, top1, top1_agreement=top1,
                             **dict(extra, kl=1 - top1)))  # fmt: skip
    for i, score in enumerate([1.0, 0.0]):  # a needle sample SnapKV broke
        rows.append(base_row(f"needle-{i}", "needle", "needle", "full", {}, 1.0, context_length=1000,
                             depth_percent=10 * i))  # fmt: skip
        rows.append(base_row(f"needle-{i}", "needle", "needle", "snapkv", SNAP, score, context_length=1000,
                             depth_percent=10 * i))  # fmt: skip
    write(tmp_path, rows)
    report = build_report(tmp_path, plots=False)
    assert "### fidelity — tiny/model: paired differences" in report.markdown
    assert "fidelity — tiny/model: flips" not in report.markdown
    assert "### needle — tiny/model: flips against the full cache" in report.markdown
    paired = pd.read_csv(report.paired_csv).set_index("task")
    assert paired.loc["fidelity", "diff"] == pytest.approx(100 * (sum(agreement) / 6 - 1))
    flips = pd.read_csv(report.flips_csv)
    assert flips["task"].tolist() == ["needle"] and flips["change"].tolist() == ["broke"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["task.context_tokens=0"], "context_tokens=0"),
        (["task.continuation_tokens=-3"], "continuation_tokens=-3"),
        (["task.num_samples=0"], "num_samples=0"),
        (["task.haystack=bogus"], "unknown haystack 'bogus'"),
        (["task.haystack=dir:/no/such/dir"], "/no/such/dir"),
        (["generation.do_sample=true"], "generates none"),
    ],
)
def test_bad_fidelity_config_is_one_line_and_exit_2(args, expected, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(runner, "load_model", test_runner._no_model_load)
    code = run_cli_in_process(
        monkeypatch, tmp_path, f"results_dir={tmp_path}/results", "task=fidelity", *args
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not (tmp_path / "results").exists()
