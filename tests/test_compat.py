"""The supported transformers range and the version shims (`snapkv/compat.py`).

Runs on whatever transformers is installed; `make test-compat` runs this file, tests/test_core.py and
the other version-sensitive tests (listed in .ci/compat.sh) on the declared lower and upper ends.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

from snapkv import CompressibleLayer, compat

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["4.57.6", "5.0.0", "5.1.0", "5.25.0", "5.25.0.dev0", "6.0.0"])
def test_version_outside_the_range_fails_naming_the_range(version):
    with pytest.raises(
        ImportError, match=re.escape(f"transformers >=5.2.0,<5.25, found transformers {version}")
    ):
        compat.check_transformers_version(version)


@pytest.mark.parametrize("version", ["5.2.0", "5.10.4", "5.17.0", "5.24.0", "5.24.9"])
def test_version_inside_the_range_passes(version):
    compat.check_transformers_version(version)


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_import_with_an_unsupported_transformers_names_the_range(tmp_path):
    """A stand-in `transformers` 5.1.0 package first on the path: `import snapkv` must stop at the
    version check, before anything reaches into transformers' internals."""
    fake = tmp_path / "transformers"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "5.1.0"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-c", "import snapkv"], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: snapkv-bench supports transformers >=5.2.0,<5.25"), last
    assert "found transformers 5.1.0" in last


def test_declared_range_matches_pyproject_and_make_test_compat():
    tomllib = pytest.importorskip("tomllib")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"transformers{compat.SUPPORTED_RANGE}" in deps
    make = (ROOT / "Makefile").read_text()
    low = re.search(r"^COMPAT_LOW \?= (\S+)", make, re.M).group(1)
    high = re.search(r"^COMPAT_HIGH \?= (\S+)", make, re.M).group(1)
    assert low == compat.SUPPORTED_MIN  # the lower end itself is tested ...
    assert compat._parse(high)[:2] == (5, 24) and compat._parse(compat.SUPPORTED_BELOW) == (
        5,
        25,
        0,
    )  # ... and the last minor


def test_make_test_compat_runs_the_hub_tests_on_both_ends():
    """The Hub download paths depend on the huggingface_hub that each transformers pins (5.2.0: <2),
    so .ci/compat.sh's default files include tests/e2e/test_hub.py; every file it lists exists."""
    script = (ROOT / ".ci" / "compat.sh").read_text()
    listed = re.search(r"\|\| tests=\(([^)]*)\)", script).group(1).split()
    assert {"tests/test_core.py", "tests/test_compat.py", "tests/e2e/test_hub.py"} <= set(listed)
    assert [f for f in listed if not (ROOT / f).is_file()] == []


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3", "mistral-sliding"])
def test_layer_types_match_the_installed_dynamic_cache(arch):
    config = tiny_config("mistral") if arch == "mistral-sliding" else tiny_config(arch)
    if arch == "mistral-sliding":
        config.sliding_window = 16  # no layer_types: every layer inferred as sliding
    types = compat.layer_types(config)
    layers = DynamicCache(config=config).layers
    assert len(types) == len(layers)
    for t, layer in zip(types, layers):
        assert isinstance(layer, DynamicSlidingWindowLayer) == (t == "sliding_attention"), (t, type(layer))
    if arch == "gemma3":
        assert types.count("full_attention") == 1 and types[5] == "full_attention"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_legacy_layer_types_equal_get_layer_types_and_kwargs(arch):
    cache_utils = pytest.importorskip("transformers.cache_utils")
    if not hasattr(cache_utils, "get_layer_types_and_kwargs"):
        pytest.skip("transformers < 5.14: only the legacy typing exists (checked against DynamicCache above)")
    config = tiny_config(arch).get_text_config(decoder=True)
    assert compat.legacy_layer_types(config) == cache_utils.get_layer_types_and_kwargs(config)[0]


def test_mask_sizes_take_a_query_count_or_cache_position():
    layer = CompressibleLayer()
    k = torch.randn(1, 2, 10, 4)
    layer.update(k, k)
    assert compat.query_length(torch.arange(10, 13)) == 3 and compat.query_length(3) == 3
    assert layer.get_mask_sizes(torch.arange(10, 13)) == layer.get_mask_sizes(3) == (13, 0)
