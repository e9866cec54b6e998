#!/usr/bin/env bash
# The version-sensitive tests on one transformers version: .ci/compat.sh PYTHON VERSION [PYTEST_ARGS...]
# SKIP_CURRENT=1: do nothing when PYTHON already has VERSION (its tests ran in the main tiers).
#
# Default: the files that drive transformers / huggingface_hub APIs that differ inside the supported
# range (cache layers and their masks, generate, the cache kwarg of the harness's own forwards,
# model-specific attention kwargs, Hub downloads with the huggingface_hub that transformers pins),
# ~3 min on 2 loaded CPU cores. The rest of the suite (configs, store, report, metrics, tasks,
# runner, embedded fetch) runs on the upper end only (`make test`): where it reaches transformers it
# goes through the paths these files cover, at a higher cost.
#
# PYTHON's own packages (torch, pytest, ...) are reused, from a venv or the system interpreter alike:
# when PYTHON already has transformers VERSION the tests run in place; otherwise in a cached venv
# .venv-compat/VERSION whose .pth file puts PYTHON's site-packages after its own, so only
# transformers (and a dependency it pins differently) is installed there, once.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$1 version=$2
shift 2
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/test_core.py tests/test_compat.py tests/test_pyramid_adakv.py
  tests/test_padding.py tests/test_softcap.py tests/test_decode_eviction.py tests/test_observe.py
  tests/test_digits.py tests/test_rollback.py tests/e2e/test_hub.py)
tf_version() { "$1" -c "import transformers; print(transformers.__version__)" 2>/dev/null || true; }

if [ "$(tf_version "$py")" = "$version" ]; then
  # `make test` has just run every file on this interpreter's own transformers: not twice.
  if [ "${SKIP_CURRENT:-}" = 1 ]; then
    echo "test-compat: transformers $version is this interpreter's own; its tests already ran"
    exit 0
  fi
  run=$py
else
  venv=.venv-compat/$version
  run=$venv/bin/python
  parent=$("$py" -c "import sys; print(sys.prefix)")
  # rebuilt when missing, broken, or made for another interpreter (its .pth points there)
  if [ "$(tf_version "$run")" != "$version" ] || [ "$(cat "$venv/parent" 2>/dev/null)" != "$parent" ]; then
    echo "test-compat: installing transformers==$version into $venv (once; cached)"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    site=$("$run" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
    "$py" - "$site/parent-site.pth" <<'PY'
import os, site, sys, sysconfig
dirs = [sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *site.getsitepackages()]
if site.ENABLE_USER_SITE:
    dirs.append(site.getusersitepackages())
dirs = [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]
with open(sys.argv[1], "w") as f:  # addsitedir also processes the parent's own .pth files
    f.write("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
PY
    "$run" -m pip install -q --disable-pip-version-check "transformers==$version"
    [ "$(tf_version "$run")" = "$version" ] || { echo "test-compat: transformers $version did not install" >&2; exit 1; }
    echo "$parent" >"$venv/parent"
  fi
fi
echo "test-compat: transformers $version ($run)"
"$run" -m pytest -q -p no:cacheprovider "${tests[@]}"
