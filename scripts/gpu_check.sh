#!/usr/bin/env bash
# The GPU check, one prepared run on a CUDA GPU, sized for one H200 (budgeted to < 8 min; estimate
# in docs/gpu.md). Leaves in one folder (argument 1, else $OUTDIR, else $OUT, else results/gpu):
#   gpu_tests.log      pytest -m gpu tests/test_gpu.py (CUDA exactness for every method)
#   gpu_tpot.csv       A. TPOT, prefill, peak memory vs input length 4K..128K, full vs snapkv(2048),
#                         batch 1 and 2 (random-weight Llama-2-7B shape = LWM-Text-Chat-1M, bf16, sdpa)
#   gpu_capacity.csv   B. snapkv(1024, window 16, kernel 5) vs full at 393,216 tokens (> 380K), then
#                         longer while the time budget allows; out of memory = a row status=oom
#   gpu_exactness.csv  C. every method's kept positions at 32K tokens on the GPU vs on CPU (fp32, a
#                         small random Llama); runs beside the tests (neither is timed)
#   gpu_check.png      the four panels;  gpu_check.log  everything printed
# Needs: torch with CUDA, transformers in the supported range; pytest (the image has it; else the
# carry kit's .whl/ is installed first). No Hydra / OmegaConf. Every knob is an environment
# variable, so CI smoke-tests this script on CPU at toy sizes:
#   MODEL DTYPE DEVICE LENGTHS BATCHES BUDGET WINDOW CAP_LENGTH(S) CAP_BUDGET CAP_WINDOW DECODE
#   EXACT_LENGTH EXACT_BUDGET EXACT_WINDOW EXACT_THREADS (CPU threads of part C's reference; 0: torch's
#   default) EXACT_TIMEOUT (seconds; part C's rows so far are kept) EXACT(=0: skip C)
#   DEADLINE_S (no capacity run starts that is predicted to end later, counted from this script's
#   start) WARMUP GPU_TESTS(=0: skip the tests) PYTHON (default python3: the GPU image's torch)
set -euo pipefail
export GPU_CHECK_T0=$(date +%s)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
MODEL=${MODEL:-random:llama2-7b}
DTYPE=${DTYPE:-bfloat16}
DEVICE=${DEVICE:-cuda}
LENGTHS=${LENGTHS:-[4096,16384,32768,65536,131072]}
BATCHES=${BATCHES:-[1,2]}
CAP_LENGTHS=${CAP_LENGTHS:-${CAP_LENGTH:-[393216,458752,524288]}}
BUDGET=${BUDGET:-2048}
WINDOW=${WINDOW:-32}
CAP_BUDGET=${CAP_BUDGET:-1024}
CAP_WINDOW=${CAP_WINDOW:-16}
DECODE=${DECODE:-16}
DEADLINE_S=${DEADLINE_S:-420}
GPU_TESTS=${GPU_TESTS:-1}
EXACT=${EXACT:-1}
EXACT_LENGTH=${EXACT_LENGTH:-32768}
EXACT_BUDGET=${EXACT_BUDGET:-1024}
EXACT_WINDOW=${EXACT_WINDOW:-32}
EXACT_THREADS=${EXACT_THREADS:-14}
EXACT_TIMEOUT=${EXACT_TIMEOUT:-300}
OUTDIR=${1:-${OUTDIR:-${OUT:-results/gpu}}}
if [[ $DEVICE == cuda* ]]; then WARMUP=${WARMUP:-1024}; else WARMUP=${WARMUP:-0}; fi
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PIP_ROOT_USER_ACTION=ignore
exec > >(tee "$OUTDIR/gpu_check.log") 2>&1

if [ -d .whl ] && { [[ $DEVICE == cuda* ]] || ! "$PY" -c "import pytest" 2>/dev/null; }; then
  PYTHON=$PY bash scripts/carry_kit.sh --install /tmp/site
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
[[ $DEVICE == cuda* ]] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

# Part C (not timed) runs beside the tests; parts A and B (timed) start once both are done.
exact_pid=
if [ "$EXACT" = 1 ]; then
  timeout "$EXACT_TIMEOUT" "$PY" scripts/gpu_check.py --out "$OUTDIR" --parts exact --device "$DEVICE" --exact-length "$EXACT_LENGTH" \
    --exact-budget "$EXACT_BUDGET" --exact-window "$EXACT_WINDOW" --exact-threads "$EXACT_THREADS" >"$OUTDIR/gpu_exactness.log" 2>&1 &
  exact_pid=$!
fi
tests_rc=0
if [ "$GPU_TESTS" = 1 ]; then
  echo "== gpu tests (pytest -m gpu) =="
  "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py >"$OUTDIR/gpu_tests.log" 2>&1 || tests_rc=$?
  tail -n 15 "$OUTDIR/gpu_tests.log"
fi

exact_rc=0
if [ -n "$exact_pid" ]; then
  wait "$exact_pid" || exact_rc=$?
  cat "$OUTDIR/gpu_exactness.log"
fi

echo "== A: TPOT vs input length; B: longest input =="
"$PY" scripts/gpu_check.py --out "$OUTDIR" --parts tpot,capacity --model "$MODEL" --dtype "$DTYPE" --device "$DEVICE" \
  --lengths "$LENGTHS" --batches "$BATCHES" --budget "$BUDGET" --window "$WINDOW" --decode "$DECODE" \
  --cap-lengths "$CAP_LENGTHS" --cap-budget "$CAP_BUDGET" --cap-window "$CAP_WINDOW" \
  --deadline-s "$DEADLINE_S" --warmup "$WARMUP"

"$PY" - "$OUTDIR" <<'PY'
import os, sys, pandas as pd
d = sys.argv[1]
for name in ("gpu_tpot.csv", "gpu_capacity.csv"):
    df = pd.read_csv(f"{d}/{name}")
    df["tpot_ms"] = (df["tpot_s"] * 1e3).round(2)
    df["peak_GiB"] = (df["peak_mem_bytes"] / 2**30).round(2)
    df["kv_GiB"] = (df["kv_bytes"] / 2**30).round(3)
    cols = ["method", "budget", "batch_size", "input_tokens", "status", "prefill_s", "tpot_ms", "peak_GiB", "kv_GiB"]
    print(f"\n{name}\n" + df[cols].to_string(index=False))
if os.path.exists(f"{d}/gpu_exactness.csv"):  # absent with EXACT=0
    df = pd.read_csv(f"{d}/gpu_exactness.csv")
    print("\ngpu_exactness.csv\n" + df[["method", "params", "exact", "agree", "cpu_s", "device_s"]].to_string(index=False))
PY
[ "$exact_rc" = 0 ] || echo "part C FAILED (exit $exact_rc): see $OUTDIR/gpu_exactness.log"
[ "$tests_rc" = 0 ] || echo "gpu tests FAILED (exit $tests_rc): see $OUTDIR/gpu_tests.log"
[ "$tests_rc" = 0 ] && exit "$exact_rc"
exit "$tests_rc"
