#!/usr/bin/env bash
# Carry kit for a GPU machine that reaches no package index: the wheels the harness needs that its
# image lacks (hydra-core, omegaconf, antlr4-python3-runtime, gguf, rouge; pytest with its two
# plugins' base in case it is missing), for Python 3.12 on x86-64 Linux, in the git-ignored folder
# .whl/ that is copied there with the checkout. Versions = the ones installed here (what the tests
# ran with), else the newest.
#
#   bash scripts/carry_kit.sh                  # here (package index reachable): fill .whl/, check it
#   bash scripts/carry_kit.sh --install [DIR]  # there, offline: install into DIR (default /tmp/site)
#                                              # then: export PYTHONPATH=DIR (gpu_check.sh does both)
#
# The install is one line (pytest's wheels only where `import pytest` fails):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=.whl
PY=${PYTHON:-python3}

if [ "${1:-}" = "--install" ]; then
  dir=${2:-/tmp/site}
  [ -d "$KIT" ] || { echo "carry_kit: no $KIT/ here (run scripts/carry_kit.sh on a machine with the index)" >&2; exit 1; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dir" "$KIT"/*.whl
  if ! "$PY" -c "import pytest" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$dir" "$KIT"/pytest/*.whl
  fi
  echo "carry_kit: installed $(ls "$KIT"/*.whl | wc -l) wheels into $dir (export PYTHONPATH=$dir)"
  exit 0
fi

# name: what the harness imports that the GPU image (Python 3.12, torch 2.11, transformers 5.17) lacks.
MAIN=(hydra-core omegaconf antlr4-python3-runtime gguf rouge)
PYTEST=(pytest pluggy iniconfig)
pin() { "$PY" -c "import importlib.metadata as m, sys
try: print(sys.argv[1] + '==' + m.version(sys.argv[1]))
except m.PackageNotFoundError: print(sys.argv[1])" "$1"; }
PLATFORM=(--python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
fetch() {  # fetch DEST NAME: a binary wheel for the GPU machine, else build a pure-Python one
  local dest=$1 req
  req=$(pin "$2")
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$dest" "$req" 2>/dev/null; then
    # antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 pins) ships only an sdist: pure Python
    "$PY" -m pip wheel -q --no-deps -w "$dest" "$req"
  fi
}
rm -rf "$KIT"
mkdir -p "$KIT/pytest"
for name in "${MAIN[@]}"; do fetch "$KIT" "$name"; done
for name in "${PYTEST[@]}"; do fetch "$KIT/pytest" "$name"; done

# Check: every wheel is pure Python or built for cp312/manylinux x86-64, and each requirement (for
# Python 3.12 on Linux) is in the kit or in the GPU image; and the kit + the tree without results/
# fit in 64 MiB.
"$PY" - "$KIT" <<'PY'
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

IMAGE = {"numpy", "pyyaml", "requests", "tqdm", "packaging", "pygments", "six", "torch", "transformers",
         "pandas", "matplotlib", "psutil", "accelerate", "safetensors", "huggingface-hub", "tokenizers"}  # fmt: skip
env = dict(default_environment(), python_version="3.12", python_full_version="3.12.3",
           sys_platform="linux", platform_system="Linux", platform_machine="x86_64", extra="")  # fmt: skip
kit = sorted(Path(sys.argv[1]).rglob("*.whl"))
names = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in kit}
bad = []
for w in kit:
    tags = {str(t) for t in parse_wheel_filename(w.name)[3]}
    if not any(t.endswith("-none-any") or ("cp312" in t and "x86_64" in t) for t in tags):
        bad.append(f"{w.name}: not installable on cp312 x86-64 ({tags})")
    meta = next(n for n in zipfile.ZipFile(w).namelist() if n.endswith(".dist-info/METADATA"))
    for line in zipfile.ZipFile(w).read(meta).decode().splitlines():
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker and not req.marker.evaluate(env):
                continue
            name = canonicalize_name(req.name)
            if name not in names and name not in IMAGE:
                bad.append(f"{w.name} needs {req} (neither in the kit nor in the GPU image)")
# results/ (the committed runs, ~75 MiB) stays behind: the check reads none of it.
tree = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", ".", ":!results"],
                      capture_output=True, check=True).stdout.split(b"\0")  # fmt: skip
tree_bytes = sum(Path(p.decode()).stat().st_size for p in tree if p and Path(p.decode()).is_file())
kit_bytes = sum(w.stat().st_size for w in kit)
for w in kit:
    print(f"  {w.stat().st_size / 2**10:8.0f} KiB  {w.relative_to(sys.argv[1])}")
total = tree_bytes + kit_bytes
print(f"carry kit: {len(kit)} wheels, {kit_bytes / 2**20:.2f} MiB; with the tree less results/ ({tree_bytes / 2**20:.2f} MiB): "
      f"{total / 2**20:.2f} MiB of the 64 MiB limit")  # fmt: skip
if total > 64 * 2**20:
    bad.append(f"kit + tree = {total / 2**20:.1f} MiB > 64 MiB")
if bad:
    sys.exit("carry kit check failed:\n  " + "\n  ".join(bad))
PY
echo "carry kit ready in $KIT/ (copy it to the GPU machine with the checkout; gpu_check.sh installs it)"
