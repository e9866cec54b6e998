"""The speed scripts, exercised on CPU at toy sizes (the numbers themselves are not asserted)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(args, env=None, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


def test_bench_speed_rows_plots_and_ratios(tmp_path):
    out = tmp_path / "bench.csv"
    proc = _run([sys.executable, "scripts/bench_speed.py", "model=random:llama-tiny", "lengths=[64,256]",
                 "methods=[full,snapkv,h2o]", "budget=48", "window=8", "decode_tokens=4", f"out={out}"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 6 and {r["status"] for r in rows} == {"ok"}
    for col in ["method", "budget", "batch_size", "input_tokens", "prefill_s", "ttft_s", "tpot_s",
                "peak_mem_bytes", "kv_bytes", "status"]:  # fmt: skip
        assert col in rows[0]
    by = {(r["method"], int(r["input_tokens"])): r for r in rows}
    # exact KV bytes: 2 layers x 2 kv heads x 16 head_dim x 2 (K,V) x 4 bytes per kept token
    assert int(by[("snapkv", 256)]["kv_bytes"]) == 48 * 2 * 2 * 16 * 2 * 4
    assert int(by[("full", 256)]["kv_bytes"]) == 256 * 2 * 2 * 16 * 2 * 4
    for stem in ["tpot", "peak_mem", "longest"]:
        assert (tmp_path / f"bench_{stem}.png").read_bytes()[:4] == b"\x89PNG"
    assert "TPOT snapkv(256, b=48) / TPOT full(64)" in proc.stdout
    assert "prefill+score h2o / prefill full at 256" in proc.stdout


def test_bench_speed_bad_input_is_one_line(tmp_path):
    proc = _run([sys.executable, "scripts/bench_speed.py", "methods=[full,pyramid]", f"out={tmp_path}/b.csv"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "pyramid" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _run([sys.executable, "scripts/bench_speed.py", "lenghts=[5]"])
    assert proc.returncode == 2 and "lenghts" in proc.stderr


def test_oom_in_a_worker_becomes_a_row(monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_speed

    def fake_run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, -9, "", "")

    monkeypatch.setattr(bench_speed.subprocess, "run", fake_run)
    cfg = bench_speed.OmegaConf.create(bench_speed.DEFAULTS)
    row = bench_speed.run_subprocess(cfg, "full", 1 << 20, 1)
    assert row["status"] == "oom" and row["input_tokens"] == 1 << 20


@pytest.mark.skipif(not Path("/bin/bash").exists(), reason="needs bash")
def test_gpu_check_script_runs_at_toy_size_on_cpu(tmp_path):
    env = dict(MODEL="random:llama-tiny", DTYPE="float32", DEVICE="cpu", LENGTHS="[64,128]",
               BATCHES="[1,2]", CAP_LENGTH="256", DECODE="3", OUTDIR=str(tmp_path))  # fmt: skip
    proc = _run(["bash", "scripts/gpu_check.sh"], env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "gpu_tpot.csv" in proc.stdout and "gpu_capacity.csv" in proc.stdout
    rows = list(csv.DictReader((tmp_path / "gpu_tpot.csv").open()))
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows)
