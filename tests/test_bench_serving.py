"""The serving benchmark (`eval.bench.serving`): arrivals and scheduling against a fake paged-KV
pipeline on a fake clock, preemption counting, the concurrency search, aggregation, per-round
ratios, the CLI's one-line errors, the pipeline settings handed to the engine's builder; one real
run on a tiny random GGUF (slow, needs openvino_genai).

The fake pipeline schedules like OpenVINO GenAI's continuous batching does, in small: requests in
arrival priority, a prompt admitted whole when its blocks are free, one token per generating
request per step, a generating request short of a block preempting the lowest-priority request
that holds blocks (by recompute: its blocks freed, its prompt run again), or stalling when none can
give way.
"""

from __future__ import annotations

import csv
import math
import statistics

import pytest
from conftest import CHATML, byte_level_bpe, in_child_process

from eval.bench import serving
from eval.bench.serving import Config, Request
from eval.engines.openvino import KV_BLOCK_SIZE
from eval.tasks import haystack as hs
from eval.tasks.needle.task import NEEDLES


class Clock:
    """A fake clock: a step costs `step_s`; sleeping advances it."""

    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.slept.append(dt)
        self.t += dt


class _Req:
    def __init__(self, request: Request, out: list[int]):
        self.request, self.out = request, out
        self.emitted: list[int] = []
        self.unread: list[int] = []
        self.blocks = 0
        self.prefilled = False
        self.finished = False


class FakeHandle:
    def __init__(self, req: _Req):
        self.req = req

    def new_tokens(self) -> list[int]:
        out, self.req.unread = self.req.unread, []
        return out

    def done(self) -> bool:
        return self.req.finished and not self.req.unread

    def status(self) -> str:
        return "finished" if self.req.finished else "running"


class FakePipeline:
    """A paged pool of `pool_blocks` blocks of `block` tokens; with `budget`, a request's cache
    stops growing at `budget` tokens (eviction). Emits each request's `answer(request)` tokens."""

    def __init__(self, clock: Clock, pool_blocks: int, block: int = 4, budget: int | None = None,
                 step_s: float = 1.0, answer=None):  # fmt: skip
        self.clock, self.pool, self.block, self.budget, self.step_s = (
            clock,
            pool_blocks,
            block,
            budget,
            step_s,
        )
        self.answer = answer or (lambda r: [7] * r.max_new_tokens)
        self.reqs: list[_Req] = []
        self.max_in_flight = 0
        self.added_at: list[float] = []

    def _need(self, tokens: int) -> int:
        if self.budget is not None:
            tokens = min(tokens, self.budget)
        return math.ceil(tokens / self.block)

    def free(self) -> int:
        return self.pool - sum(r.blocks for r in self.reqs)

    def add(self, request: Request) -> FakeHandle:
        req = _Req(request, list(self.answer(request))[: request.max_new_tokens])
        self.reqs.append(req)
        self.added_at.append(self.clock())
        self.max_in_flight = max(self.max_in_flight, sum(not r.finished for r in self.reqs))
        return FakeHandle(req)

    def _emit(self, r: _Req) -> None:
        tok = r.out[len(r.emitted)] if len(r.emitted) < len(r.out) else 0
        r.emitted.append(tok)
        r.unread.append(tok)
        if len(r.emitted) == r.request.max_new_tokens:
            r.finished, r.blocks = True, 0

    def step(self) -> None:
        self.clock.t += self.step_s
        active = [r for r in self.reqs if not r.finished]
        for i, r in enumerate(active):
            if r.finished:
                continue
            size = len(r.request.ids) + len(r.emitted)
            if not r.prefilled:
                need = self._need(size)
                if self.free() >= need:
                    r.blocks, r.prefilled = need, True
                    self._emit(r)
                continue
            need = self._need(size + 1)
            while need > r.blocks and self.free() < need - r.blocks:
                victims = [v for v in active[i + 1 :] if v.blocks and not v.finished]
                if not victims:
                    break
                victim = victims[-1]  # the lowest priority, by recompute
                victim.blocks, victim.prefilled = 0, False
            if need > r.blocks and self.free() < need - r.blocks:
                continue  # stalled: no block
            r.blocks = max(r.blocks, need)
            self._emit(r)

    def cache_usage(self) -> float:
        return 100.0 * (self.pool - self.free()) / self.pool


def _requests(n: int, prompt: int = 8, new: int = 4) -> list[Request]:
    class S:
        def __init__(self, i):
            self.sample_id = f"s{i}"

    return [Request(i, [1] * prompt, S(i), new) for i in range(n)]


# ---- arrivals and scheduling


def test_closed_loop_keeps_concurrency_in_flight():
    clock = Clock()
    pipe = FakePipeline(clock, pool_blocks=100)
    records, point = serving.drive(pipe, _requests(6), 2, None, clock, clock.sleep)
    assert pipe.max_in_flight == 2
    assert [r["request_id"] for r in records] == list(range(6))
    assert all(r["status"] == "finished" and r["output_tokens"] == 4 for r in records)
    # two at a time, 4 steps each: the next pair goes in as soon as the last pair finishes
    assert pipe.added_at == [0.0, 0.0, 4.0, 4.0, 8.0, 8.0]
    assert point["wall_s"] == 12.0 and point["steps"] == 12
    assert all(r["ttft_s"] == 1.0 and r["tpot_s"] == 1.0 for r in records)
    assert not clock.slept


def test_poisson_arrivals_are_seeded():
    a = serving.poisson_arrivals(2000, 4.0, seed=3)
    assert a == serving.poisson_arrivals(2000, 4.0, seed=3)
    assert a != serving.poisson_arrivals(2000, 4.0, seed=4)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.1)


def test_arrivals_wait_for_their_time_and_ttft_counts_the_queue():
    clock = Clock()
    pipe = FakePipeline(clock, pool_blocks=100)
    # request 1 arrives with request 0 but waits for the one slot; request 2 arrives after an idle gap
    records, _ = serving.drive(pipe, _requests(3), 1, [0.0, 0.0, 20.0], clock, clock.sleep)
    assert pipe.added_at == [0.0, 4.0, 20.0]
    assert clock.slept == [12.0]  # 8 s of serving, then nothing in flight until 20 s
    r0, r1, r2 = records
    assert (r0["ttft_s"], r1["ttft_s"], r2["ttft_s"]) == (1.0, 5.0, 1.0)
    assert r1["arrival_s"] == 0.0 and r1["e2e_s"] == 8.0


def test_preemption_is_counted_as_a_stall_episode():
    clock = Clock()
    # 3 requests of 8 prompt tokens + 8 new (4 blocks each at the end); 9 blocks: the third
    # request's growth preempts nobody below it, so the lowest-priority one stalls or is preempted
    pipe = FakePipeline(clock, pool_blocks=9)
    records, point = serving.drive(pipe, _requests(3, prompt=8, new=8), 3, None, clock, clock.sleep)
    row = serving.summarize([dict(r, exact=1.0, partial=1.0) for r in records], point)
    assert row["completed"] == 3 and row["preemptions"] >= 1 and row["stalled_requests"] >= 1
    assert row["preemptions"] == sum(r["stalls"] for r in records)
    assert all(r["stall_steps"] >= r["stalls"] for r in records)
    assert row["max_cache_usage"] == 100.0
    # the same requests with room for all: no stall
    clock = Clock()
    records, point = serving.drive(FakePipeline(clock, 12), _requests(3, 8, 8), 3, None, clock, clock.sleep)
    assert sum(r["stalls"] for r in records) == 0


def test_eviction_budget_relieves_the_pool():
    clock = Clock()
    full = serving.drive(FakePipeline(clock, 9), _requests(3, 8, 8), 3, None, clock, clock.sleep)
    clock = Clock()
    evict = serving.drive(FakePipeline(clock, 9, budget=12), _requests(3, 8, 8), 3, None, clock, clock.sleep)
    assert sum(r["stalls"] for r in full[0]) > 0
    assert sum(r["stalls"] for r in evict[0]) == 0
    assert evict[1]["wall_s"] < full[1]["wall_s"]


def test_drive_rejects_bad_arguments():
    clock = Clock()
    with pytest.raises(ValueError, match="concurrency=0"):
        serving.drive(FakePipeline(clock, 10), _requests(2), 0, None, clock, clock.sleep)
    with pytest.raises(ValueError, match="1 times for 2 requests"):
        serving.drive(FakePipeline(clock, 10), _requests(2), 1, [0.0], clock, clock.sleep)


# ---- the concurrency search


@pytest.mark.parametrize("limit", [0, 1, 5, 16])
def test_search_finds_the_largest_clean_concurrency(limit):
    calls = []

    def run(c):
        calls.append(c)
        return {"preemptions": int(c > limit), "ignored": 0}

    best, tried = serving.search_concurrency(run, 16)
    assert best == limit
    assert set(tried) == set(calls) and len(calls) <= 5  # log2(16) + 1
    assert all(serving.clean(tried[c]) == (c <= limit) for c in tried)


def test_search_on_the_fake_pool():
    def run(c):
        clock = Clock()
        records, point = serving.drive(
            FakePipeline(clock, 12), _requests(8, 8, 8), c, None, clock, clock.sleep
        )
        return serving.summarize([dict(r, exact=0.0, partial=0.0) for r in records], point)

    best, _ = serving.search_concurrency(run, 8)
    assert best == 3  # 4 blocks per request at its longest, 12 blocks
    assert serving.clean(run(3)) and not serving.clean(run(4))


# ---- aggregation and ratios


def test_percentile_is_linear_between_order_statistics():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0, None, math.nan]
    assert serving.percentile(xs, 50) == 3.0
    assert serving.percentile(xs, 99) == pytest.approx(4.96)
    assert serving.percentile(xs, 0) == 1.0 and serving.percentile(xs, 100) == 5.0
    assert serving.percentile([None], 50) is None
    assert serving.percentile([2.0], 99) == 2.0


def test_summarize_counts_finished_tokens_and_scores_unfinished_as_zero():
    def rec(status, tokens, ttft, tpot, stalls=0, exact=1.0):
        return dict(status=status, output_tokens=tokens, ttft_s=ttft, tpot_s=tpot, stalls=stalls,
                    exact=exact, partial=exact)  # fmt: skip

    records = [
        rec("finished", 10, 1.0, 0.1),
        rec("finished", 10, 3.0, 0.3, stalls=2),
        rec("ignored", 0, None, None),
    ]
    row = serving.summarize(records, {"wall_s": 4.0, "steps": 7, "usage": [50.0, 100.0, 75.0]})
    assert row["tokens_per_s"] == 5.0 and row["completed"] == 2 and row["ignored"] == 1
    assert row["ttft_p50_s"] == 2.0 and row["ttft_p99_s"] == pytest.approx(2.98)
    assert row["tpot_p50_s"] == pytest.approx(0.2)
    assert row["preemptions"] == 2 and row["stalled_requests"] == 1
    assert row["max_cache_usage"] == 100.0 and row["avg_cache_usage"] == 75.0
    assert row["exact"] == pytest.approx(2 / 3)
    assert not serving.clean(row)


def _point(r, c, cfg, tps, arrival="closed"):
    return dict(
        round=r, arrival=arrival, concurrency=c, config=cfg, tokens_per_s=tps, preemptions=0, exact=1.0
    )


def test_ratios_pair_points_of_the_same_round():
    points = [
        _point(0, 1, "full", 10.0), _point(0, 1, "snapkv@256", 12.0),
        _point(1, 1, "snapkv@256", 9.0), _point(1, 1, "full", 6.0),  # a slow round: both slower
        _point(2, 1, "full", 10.0),  # the eviction point of round 2 is missing: no ratio
        _point(0, 2, "full", 20.0), _point(0, 2, "snapkv@256", 30.0),
        _point(0, 2, "snapkv@256", 50.0, arrival="poisson"),  # no full point to pair with
    ]  # fmt: skip
    got = serving.ratios(points)
    assert got == {("closed", 1, "snapkv@256"): {0: 1.2, 1: 1.5}, ("closed", 2, "snapkv@256"): {0: 1.5}}
    lines = serving.summary_lines(points)
    assert any("snapkv@256" in line and "1.350 [1.275, 1.425] n=2" in line for line in lines)


def test_rotation_and_default_concurrency():
    assert serving.rotated([1, 2, 3], 0) == [1, 2, 3] and serving.rotated([1, 2, 3], 4) == [2, 3, 1]
    # 1024 + 32 tokens = 33 blocks: 96 blocks hold 2 whole; budget 256 -> 9 blocks: 10 requests
    assert serving.default_concurrency(96, 1024, 32, [256, 512], cap=16) == [1, 2, 4, 8, 10]
    assert serving.default_concurrency(96, 1024, 32, [256], cap=6) == [1, 2, 4]
    assert serving.default_concurrency(10, 1024, 32, [], cap=16) == [1]


# ---- the CLI


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pool-blocks", "0"], "pool_blocks=0"),
        (["--modes", "snapkv,h2o"], "unknown name(s) ['h2o']"),
        (["--arrivals", "bursty"], "unknown name(s) ['bursty']"),
        (["--budgets", "96"], "budgets must exceed start_size + recent_size = 96"),
        (
            ["--budgets", "256,200"],
            "budgets must be multiples of the KV block (32 tokens on CPU), got budgets=200",
        ),
        (["--start-size", "16"], "start_size must be multiples of the KV block"),
        (["--budgets", "256,x"], "comma-separated integers"),
        (["--concurrency", "1,32"], "concurrency 32 exceeds requests=16"),
        (["--rate", "0"], "rate=0.0"),
        (["--rate", "nan"], "rate=nan"),
        (["--modes", "snapkv", "--snapkv-window", "0"], "snapkv_window=0"),
        (["--threads", "0"], "threads=0"),
        (["--model-path", "/no/such/model.gguf"], "model path not found"),
        (["--model", "llama-7b"], "model='llama-7b'"),
        (["--haystack", "dir:/no/such/dir"], "haystack directory not found"),
        (["--poolblocks", "4"], "unrecognized arguments"),
        (["--rounds"], "expected one argument"),
    ],
)
def test_bad_input_exits_2_with_one_line_before_loading(argv, message, capsys, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("nothing may load on bad input")

    monkeypatch.setattr(serving, "model_path", no_load)
    monkeypatch.setattr(serving, "openvino_missing", no_load)
    assert serving.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_model_path_must_be_gguf_or_a_folder(tmp_path, capsys):
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"")
    assert serving.main(["--model-path", str(bad)]) == 2
    assert "a .gguf file or an OpenVINO IR folder" in capsys.readouterr().err
    assert serving.main(["--model-path", str(tmp_path)]) == 2  # a folder without openvino_model.xml
    assert "OpenVINO IR folder (openvino_model.xml)" in capsys.readouterr().err


# ---- the pipeline: the engine's builder


@in_child_process
def test_pipelines_are_built_by_the_engines_builder(monkeypatch):
    """Every configuration's pipeline comes from `eval.engines.openvino.build_pipeline` (the one
    place a SchedulerConfig / CacheEvictionConfig is written), with the bench's fixed pool. In a
    child process: openvino_genai imported under pytest's capture breaks later in-process Hydra
    runs."""
    ov_genai = pytest.importorskip("openvino_genai")
    from eval.engines import openvino as ov_engine

    calls = []
    monkeypatch.setattr(ov_engine, "build_pipeline", lambda model, **kw: calls.append((model, kw)))
    settings = serving.parse([
        "--pool-blocks", "40", "--batched-tokens", "128", "--start-size", "32", "--recent-size", "64",
        "--snapkv-window", "8", "--threads", "2", "--budgets", "128,256", "--modes", "snapkv,sum",
    ])  # fmt: skip
    for cfg in settings.configs():
        serving.OvPipeline("m.gguf", settings, cfg, max_num_seqs=3)
    assert [m for m, _ in calls] == ["m.gguf"] * 5
    assert all(
        {k: kw[k] for k in kw if k != "eviction"}
        == dict(
            kv_cache_precision=None,
            inference_precision=None,
            num_kv_blocks=40,
            max_num_seqs=3,
            max_num_batched_tokens=128,
            threads=2,
            weights="file",
        )  # fmt: skip
        for _, kw in calls
    )
    evictions = [kw["eviction"] for _, kw in calls]
    assert evictions[0] is None  # the full cache
    got = {
        (c.label, e["aggregation"], e["snapkv_window_size"], e["max_cache_size"])
        for c, e in zip(settings.configs()[1:], evictions[1:])
    }
    assert got == {
        ("snapkv@128", "norm_sum", 8, 128), ("snapkv@256", "norm_sum", 8, 256),
        ("sum@128", "sum", 0, 128), ("sum@256", "sum", 0, 256),
    }  # fmt: skip
    # Each dict is what the engine's eviction_config turns into the pipeline's CacheEvictionConfig.
    for mode in serving.MODES:
        if mode == "full":
            continue
        ev = ov_engine.eviction_config(serving.eviction(settings, serving.Config(mode, 256)))
        assert (ev.get_start_size(), ev.get_recent_size(), ev.get_max_cache_size()) == (32, 64, 256)
        assert ev.aggregation_mode == getattr(ov_genai.AggregationMode, serving.MODES[mode][0].upper())
        assert ev.snapkv_window_size == (8 if mode == "snapkv" else 0) and not ev.apply_rotation
        assert ev.kvcrush_config is None or ev.kvcrush_config.budget == 0


def test_an_embedded_model_reaches_the_engine_by_name(tmp_path):
    """An embedded model is built by name (the engine rewrites a GGUF its reader refuses into that
    model's cache); a --model-path as the path."""
    assert serving.engine_model(serving.parse(["--model", "qwen2.5-coder-0.5b-instruct"])) == (
        "qwen2.5-coder-0.5b-instruct"
    )
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert serving.engine_model(serving.parse(["--model-path", str(model)])) == str(model)


def test_missing_openvino_genai_says_how_to_install(capsys, monkeypatch):
    real = serving.importlib.util.find_spec
    monkeypatch.setattr(
        serving.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "openvino_genai" else real(name, *a),
    )
    monkeypatch.setattr(serving, "model_path", lambda s: pytest.fail("loaded a model"))
    assert serving.main(["--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install .[openvino]" in err


# ---- a whole run on the fake pipeline


@pytest.fixture(scope="module")
def tokenizer():
    spec = NEEDLES["magic_number"]
    corpus = [hs.NOISE_TEXT] * 10 + [spec.instruction + spec.needle + spec.question, "0123456789 " * 5]
    return byte_level_bpe(corpus, 600, ["<|im_start|>", "<|im_end|>"], chat_template=CHATML)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path / "cache_root"))


def test_run_interleaves_configurations_and_scores_the_same_requests(tokenizer, tmp_path):
    out = tmp_path / "serving"
    settings = serving.parse([
        "--haystack", "noise", "--length", "160", "--requests", "4", "--concurrency", "1,2",
        "--max-new-tokens", "12", "--modes", "snapkv,sum", "--budgets", "128", "--start-size", "32",
        "--recent-size", "32", "--rounds", "2", "--arrivals", "closed,poisson", "--rate", "0.5",
        "--reference-tokens", "2", "--pool-blocks", "200", "--out", str(out), "--search",
    ])  # fmt: skip
    clock = Clock()
    built = []

    def answer(request):  # the right number, as the model would say it
        return tokenizer(f" {request.sample.answers[0]}.", add_special_tokens=False)["input_ids"]

    def make(cfg: Config, max_seqs: int):
        built.append((cfg.label, max_seqs))
        return FakePipeline(clock, settings.pool_blocks, block=16, budget=cfg.budget, answer=answer)

    ident = {"engine": "fake 1.0", "kv_cache_precision": "u8", "cpu": "fake CPU", "length": 160}
    res = serving.run(
        settings, tokenizer, make, model="fake", clock=clock, sleep=clock.sleep, log=lambda s: None,
        ident=ident,
    )  # fmt: skip
    # one pipeline per configuration (+ the reference's), sized for the largest concurrency
    assert built == [("full", 1), ("full", 4), ("snapkv@128", 4), ("sum@128", 4)]
    assert len(res.points) == 2 * 2 * 2 * 3
    assert len(res.requests) == 4 * len(res.points)
    # within each (round, arrival, concurrency) every configuration once, rotated per round
    for r in range(2):
        firsts = [p["config"] for p in res.points if p["round"] == r][::3]
        assert set(firsts) == {["full", "snapkv@128", "sum@128"][r]}
    # the same requests everywhere, answered right, scored by the needle's metrics
    ids = {p: sorted(x["sample_id"] for x in res.requests if x["config"] == p) for p in ("full", "sum@128")}
    assert ids["full"] == ids["sum@128"]
    assert all(x["exact"] == 1.0 and x["partial"] == 1.0 for x in res.requests)
    # the reference: 2 tokens, 2 steps of the fake clock
    assert all(p["ref_s"] == 2.0 and p["tokens_per_ref"] == p["tokens_per_s"] * 2.0 for p in res.points)
    assert res.limits == {"full": 4, "snapkv@128": 4, "sum@128": 4}
    serving.write_outputs(res, out)
    with open(out / "points.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(res.points) and set(serving.POINT_COLUMNS) <= set(rows[0])
    # every point row says what ran
    assert all(r["engine"] == "fake 1.0" and r["cpu"] == "fake CPU" and r["length"] == "160" for r in rows)
    assert (out / "search.csv").exists() and (out / "requests.csv").exists()
    figures = serving.plot(res.points, out / "throughput.png")
    assert [p.name for p in figures] == ["throughput_closed.png", "throughput_poisson.png"]


def test_a_pool_too_small_for_one_request_is_refused_before_any_pipeline(tokenizer, tmp_path):
    settings = serving.parse(["--haystack", "noise", "--length", "160", "--requests", "2", "--concurrency", "1",
                              "--pool-blocks", "5", "--max-new-tokens", "4", "--out", str(tmp_path)])  # fmt: skip
    with pytest.raises(
        ValueError,
        match="the pool of 5 blocks \\(160 tokens\\) cannot hold one request of 1[56]\\d prompt \\+ 4 new tokens",
    ):
        serving.run(settings, tokenizer, lambda *a: pytest.fail("built a pipeline"), log=lambda s: None)


class Failing(FakePipeline):
    """A pipeline whose step raises after `after` steps (OpenVINO's internal checks raise RuntimeError)."""

    def __init__(self, *a, after: int = 3, **k):
        super().__init__(*a, **k)
        self.after = after

    def step(self) -> None:
        self.after -= 1
        if self.after < 0:
            raise RuntimeError(
                "Check 'x == y' failed at cache_eviction.cpp:335:\nDiversity score size mismatch"
            )
        super().step()


def test_a_failing_pipeline_gives_an_error_row_and_the_run_goes_on(tokenizer, tmp_path):
    settings = serving.parse([
        "--haystack", "noise", "--length", "160", "--requests", "2", "--concurrency", "1,2",
        "--max-new-tokens", "4", "--modes", "adaptive_rkv", "--budgets", "128", "--start-size", "32",
        "--recent-size", "32", "--rounds", "1", "--reference-tokens", "0", "--out", str(tmp_path),
    ])  # fmt: skip
    clock = Clock()
    built = []

    def make(cfg: Config, max_seqs: int):
        built.append(cfg.label)
        kind = Failing if cfg.mode == "adaptive_rkv" else FakePipeline
        return kind(clock, settings.pool_blocks, block=16, budget=cfg.budget)

    res = serving.run(settings, tokenizer, make, clock=clock, sleep=clock.sleep, log=lambda s: None)
    assert [(p["concurrency"], p["config"], p["status"]) for p in res.points] == [
        (1, "full", "ok"), (1, "adaptive_rkv@128", "error"), (2, "full", "ok"), (2, "adaptive_rkv@128", "error")
    ]  # fmt: skip
    assert (
        res.points[1]["error"]
        == "Check 'x == y' failed at cache_eviction.cpp:335: | Diversity score size mismatch"
    )
    assert built == ["full", "adaptive_rkv@128", "adaptive_rkv@128"]  # built anew after its failure
    assert len(res.requests) == 4  # the full cache's
    assert not serving.ratios(res.points) and not serving.clean(res.points[1])
    assert any("error: Check" in line for line in serving.summary_lines(res.points))
    serving.write_outputs(res, tmp_path)
    assert serving.plot(res.points, tmp_path / "throughput.png")


# ---- the real pipeline


@pytest.mark.slow
@in_child_process
def test_real_smoke_run_on_a_tiny_gguf(tmp_path):
    """A whole run of the real pipeline on a tiny random Llama GGUF with a tokenizer of its own
    (tests/tiny_gguf.py: nothing cached or downloaded)."""
    pytest.importorskip("openvino_genai")
    from tiny_gguf import tiny_text_gguf

    model = tiny_text_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "serving"
    argv = ["--model-path", str(model), "--pool-blocks", "24", "--requests", "2", "--concurrency", "1,2",
            "--length", "256", "--max-new-tokens", "12", "--modes", "snapkv", "--budgets", "128",
            "--rounds", "1", "--threads", "1", "--reference-tokens", "0", "--out", str(out)]  # fmt: skip
    assert serving.main(argv) == 0
    with open(out / "points.csv") as f:
        points = list(csv.DictReader(f))
    assert [(p["concurrency"], p["config"]) for p in points] == [
        ("1", "full"), ("1", "snapkv@128"), ("2", "full"), ("2", "snapkv@128")
    ]  # fmt: skip
    assert all(p["status"] == "ok" and p["completed"] == "2" and float(p["tokens_per_s"]) > 0 for p in points)
    assert all(p["model"] == "tiny.gguf" for p in points)
    with open(out / "requests.csv") as f:
        requests = list(csv.DictReader(f))
    assert len(requests) == 8 and all(r["output_tokens"] == "12" for r in requests)
    # The budget holds the evicting configuration's pool usage below the full cache's.
    usage = {p["config"]: float(p["max_cache_usage"]) for p in points if p["concurrency"] == "2"}
    assert usage["snapkv@128"] < usage["full"]
    assert (out / "throughput_closed.png").exists()


def test_the_bench_checks_sizes_against_the_engines_cpu_block():
    """The CLI checks the pool and budgets against the KV block before torch or the engine loads, so
    it holds its own copy of the CPU plugin's block size: the two agree."""
    assert serving.BLOCK_SIZE == KV_BLOCK_SIZE["CPU"]


def test_identity_names_the_engine_file_precisions_cpu_and_settings(tmp_path):
    pytest.importorskip("openvino_genai", reason="openvino_genai is not installed (pip install .[openvino])")
    from tiny_gguf import tiny_text_gguf

    from eval.engines import openvino as ov_engine

    assert serving.WEIGHTS == ov_engine.WEIGHTS
    model = tiny_text_gguf(tmp_path / "tiny.gguf")
    settings = serving.parse(
        ["--model-path", str(model), "--length", "512", "--budgets", "256", "--rate", "0.25"]
    )
    ident = serving.identity(settings)
    assert set(ident) == set(serving.IDENTITY_COLUMNS)
    assert ident["engine"].startswith("openvino-genai 2026.")
    assert ident["model_file"] == "tiny.gguf" and ident["weights"] == "file"  # F32 tensors: served as it is
    # the plugin's resolved defaults, spelled as OpenVINO spells element types
    assert ident["kv_cache_precision"] in {"u8", "u4", "f16", "bf16", "f32"}
    assert ident["inference_precision"] in {"bf16", "f16", "f32"}
    assert ident["length"] == 512 and ident["rate"] == 0.25 and ident["snapkv_window"] == 8
