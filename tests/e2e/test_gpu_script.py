"""End-to-end: scripts/gpu_check.sh at toy size on CPU leaves its CSVs, plot and log."""

from __future__ import annotations

import csv
import os
import subprocess
import sys

from test_gpu import ROOT, TOY  # noqa: F401  (fixtures and helpers)


def test_gpu_check_script_leaves_csvs_plot_and_log(tmp_path):
    env = {**os.environ, **TOY, "GPU_TESTS": "0", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    tpot = list(csv.DictReader((tmp_path / "gpu_tpot.csv").open()))
    assert [(r["batch_size"], r["input_tokens"], r["method"]) for r in tpot] == [
        (b, n, m) for b in ("1", "2") for n in ("64", "128") for m in ("full", "snapkv")
    ]
    assert all(r["status"] == "ok" and float(r["tpot_s"]) > 0 and float(r["prefill_s"]) > 0 for r in tpot)
    per_token = 2 * 2 * 16 * 2 * 4  # layers x kv heads x head_dim x (K, V) x fp32 bytes
    for r in tpot:  # exact KV bytes: snapkv keeps its budget, full every token
        kept = 48 if r["method"] == "snapkv" else int(r["input_tokens"])
        assert int(r["kv_bytes"]) == kept * per_token * int(r["batch_size"])
        assert int(r["peak_mem_bytes"]) > 0
    cap = list(csv.DictReader((tmp_path / "gpu_capacity.csv").open()))
    assert [(r["method"], r["input_tokens"], r["status"]) for r in cap] == [
        ("full", "256", "ok"), ("snapkv", "256", "ok"), ("snapkv", "320", "ok")
    ]  # fmt: skip
    assert (cap[1]["budget"], cap[1]["window"], cap[1]["kernel_size"]) == ("64", "8", "5")
    exact = list(csv.DictReader((tmp_path / "gpu_exactness.csv").open()))
    assert len(exact) >= 14 and all(r["exact"] == "True" for r in exact)  # CPU against CPU
    assert (tmp_path / "gpu_check.png").read_bytes()[:4] == b"\x89PNG"
    log = (tmp_path / "gpu_check.log").read_text()
    assert "gpu_tpot.csv" in log and "gpu_capacity.csv" in log and "TPOT full / TPOT snapkv" in log
    assert "gpu_exactness.csv" in log and "kept positions at 160 tokens" in log
