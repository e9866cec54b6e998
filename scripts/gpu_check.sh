#!/usr/bin/env bash
# GPU speed/memory check for a lent H200 (device tool; 15 min of device time in all).
# Budgeted to finish in < 8 min on one H200; prints a compact table and writes CSVs + plots.
#   A. TPOT vs input length 4K..128K, full vs snapkv(budget 2048), batch 1 and 2 (bf16, sdpa,
#      random-weight Llama-2-7B shape = LWM-Text-Chat-1M / LongChat, multi-head attention).
#   B. Capacity: snapkv(budget 1024, window 16, kernel 5: the paper's needle setting) vs full at
#      393,216 input tokens (target: snapkv runs, full runs out of memory).
# Every knob is an environment variable so CI can smoke-test the script on CPU at toy sizes:
#   MODEL DTYPE DEVICE LENGTHS BATCHES CAP_LENGTH DECODE OUTDIR
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-random:llama2-7b}
DTYPE=${DTYPE:-bfloat16}
DEVICE=${DEVICE:-cuda}
LENGTHS=${LENGTHS:-[4096,16384,32768,65536,131072]}
BATCHES=${BATCHES:-[1,2]}
CAP_LENGTH=${CAP_LENGTH:-393216}
DECODE=${DECODE:-16}
OUTDIR=${OUTDIR:-${OUT:-results/gpu}}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

common=(model="$MODEL" dtype="$DTYPE" device="$DEVICE" attn_implementation=sdpa subprocess=false rounds=1)
echo "== A: TPOT vs input length =="
python scripts/bench_speed.py "${common[@]}" "lengths=$LENGTHS" "batch_sizes=$BATCHES" \
  'methods=[full,snapkv]' budget=2048 window=32 decode_tokens="$DECODE" out="$OUTDIR/gpu_tpot.csv"
echo "== B: longest input, snapkv(1024) vs full =="
python scripts/bench_speed.py "${common[@]}" "lengths=[$CAP_LENGTH]" 'batch_sizes=[1]' \
  'methods=[snapkv,full]' budget=1024 window=16 kernel_size=5 decode_tokens=4 out="$OUTDIR/gpu_capacity.csv"
python - "$OUTDIR" <<'PY'
import sys, pandas as pd
d = sys.argv[1]
for name in ("gpu_tpot.csv", "gpu_capacity.csv"):
    df = pd.read_csv(f"{d}/{name}")
    df["tpot_ms"] = (df["tpot_s"] * 1e3).round(2)
    df["peak_GiB"] = (df["peak_mem_bytes"] / 2**30).round(2)
    df["kv_GiB"] = (df["kv_bytes"] / 2**30).round(3)
    cols = ["method", "budget", "batch_size", "input_tokens", "status", "prefill_s", "tpot_ms", "peak_GiB", "kv_GiB"]
    print(f"\n{name}\n" + df[cols].to_string(index=False))
PY
