"""End-to-end: scripts/bench_speed.py and the GPU check script run as subprocesses at toy sizes on CPU."""

from __future__ import annotations

import csv
import json
import re
import sys
from pathlib import Path

import pytest
from test_bench import TOY, _run  # noqa: F401  (fixtures and helpers)

from snapkv import METHODS


def test_bench_speed_rounds_rows_noise_plots_and_last_line(tmp_path):
    out = tmp_path / "bench.csv"
    proc = _run([sys.executable, "scripts/bench_speed.py", *TOY, "methods=[full,snapkv,h2o]", "subprocess=false",
                 "configs=[full@64,full@256,snapkv@256,h2o@256]", f"out={out}"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 8 and {r["status"] for r in rows} == {"ok"}  # 4 configurations x 2 rounds
    for col in ["round", "order", "method", "budget", "batch_size", "input_tokens", "prefill_s", "ttft_s",
                "tpot_s", "peak_mem_bytes", "kv_bytes", "status", "noisy", "other_cpu_s", "other_cores",
                "load_start", "load_end", "torch_threads", "omp_num_threads", "mkl_num_threads",
                "omp_wait_policy", "method_params"]:  # fmt: skip
        assert col in rows[0]
    assert {r["omp_wait_policy"] for r in rows} == {"ACTIVE"} and {r["torch_threads"] for r in rows} == {"1"}
    assert all(float(r["other_cores"]) >= 0 for r in rows)
    assert all(float(r["prefill_cpu_s"]) > 0 and float(r["tpot_cpu_s"]) > 0 for r in rows)
    # the reference clock (the CPU default): every row in reference units, the reference's CPU beside
    refs = ("prefill_ref", "tpot_ref", "ref_prefill_cpu_s", "ref_decode_cpu_s")
    assert all(float(r[c]) > 0 for r in rows for c in refs)
    assert {(r["ref_prefill_tokens"], r["ref_decode_tokens"]) for r in rows} == {("128", "16")}
    by = {(r["method"], int(r["input_tokens"])): r for r in rows if r["round"] == "0"}
    # exact KV bytes: 2 layers x 2 kv heads x 16 head_dim x 2 (K,V) x 4 bytes per kept token
    assert int(by[("snapkv", 256)]["kv_bytes"]) == 48 * 2 * 2 * 16 * 2 * 4
    assert int(by[("full", 256)]["kv_bytes"]) == 256 * 2 * 2 * 16 * 2 * 4
    assert json.loads(by[("snapkv", 256)]["method_params"])["window"] == 8
    for stem in ["tpot", "peak_mem", "longest"]:
        assert (tmp_path / f"bench_{stem}.png").read_bytes()[:4] == b"\x89PNG"
    assert "TPOT snapkv(256, b=48) / TPOT full(64)" in proc.stdout
    assert "prefill+score h2o / prefill full at 256" in proc.stdout
    assert re.search(r"rounds kept: [012] of 2 under the noise threshold", proc.stdout)
    assert "ratios of ref times" in proc.stdout and "the same rounds in raw CPU time" in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    # the table's ratios and the last line use the same clock
    table = re.search(r"TPOT snapkv\(256, b=48\) / TPOT full\(64\): ([0-9.]+)", proc.stdout).group(1)
    assert last.startswith(f"RATIOS (ref) tpot snapkv(L)/full(S) {table} ")
    assert last.startswith("RATIOS (ref) ") and last.count("[") == 4 and re.search(r"rounds [12]/2$", last), (
        last
    )


def test_bench_speed_fresh_process_per_configuration_in_rotated_rounds(tmp_path):
    out = tmp_path / "bench.csv"
    proc = _run([sys.executable, "scripts/bench_speed.py", *TOY, "configs=[full@64,snapkv@64]", "plots=false",
                 f"out={out}"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["round"], r["order"], r["method"]) for r in rows] == [
        ("0", "0", "full"),
        ("0", "1", "snapkv"),
        ("1", "0", "snapkv"),
        ("1", "1", "full"),
    ]
    assert {r["status"] for r in rows} == {"ok"} and all(int(r["peak_mem_bytes"]) > 0 for r in rows)
    # threads=1 (the default) reaches the fresh worker as OMP_NUM_THREADS before torch loads
    assert {(r["omp_num_threads"], r["torch_threads"]) for r in rows} == {("1", "1")}


@pytest.mark.skipif(not Path("/bin/bash").exists(), reason="needs bash")
def test_gpu_check_script_runs_at_toy_size_on_cpu(tmp_path):
    env = dict(MODEL="random:llama-tiny", DTYPE="float32", DEVICE="cpu", LENGTHS="[64,128]",
               BATCHES="[1,2]", CAP_LENGTH="256", DECODE="3", OUTDIR=str(tmp_path),
               EXACT_LENGTH="512", EXACT_BUDGET="64", EXACT_WINDOW="8", EXACT_THREADS="1")  # fmt: skip
    proc = _run(["bash", "scripts/gpu_check.sh"], env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gpu_tpot.csv" in proc.stdout and "gpu_capacity.csv" in proc.stdout
    rows = list(csv.DictReader((tmp_path / "gpu_tpot.csv").open()))
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows)
    # Part C at toy size: every method but full, CPU against CPU, so every kept set is the same.
    exact = list(csv.DictReader((tmp_path / "gpu_exactness.csv").open()))
    assert len(exact) == len(METHODS) - 1 and all(r["exact"] == "True" for r in exact), exact
