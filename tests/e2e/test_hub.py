"""The paths real users take: models and LongBench data from a Hub endpoint, and a Hub that does not answer.

A Hub look-alike (`tests/hub_server.py`) on 127.0.0.1 serves a tiny random Llama repo (config,
tokenizer, safetensors) and a LongBench-format `data.zip`. `run.py` runs in a subprocess with
`HF_ENDPOINT` pointing at it in its environment (huggingface_hub reads HF_ENDPOINT into
`huggingface_hub.constants` when it is imported, so the variable is set in the child's environment
rather than patched here), with its own empty `HF_HOME` and `SNAPKV_BENCH_CACHE`. Nothing else is
contacted: an unreachable endpoint is a 127.0.0.1 port that refuses connections.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import CHATML, byte_level_bpe
from hub_server import HubServer, Repo
from huggingface_hub import constants, hf_hub_download
from huggingface_hub.utils import _http
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[2]
MODEL_ID = "tiny-org/tiny-llama"
LONGBENCH = ("dataset", "THUDM/LongBench")
# Seconds an unreachable endpoint may cost a missing model or data set inside the process. Without
# the probe, huggingface_hub's retries sleep 1+2+4+8+8 = 23 s per file (a model asks for two).
FAST_S = 10.0


# ------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def model_repo(tmp_path_factory) -> Repo:
    """A tiny random Llama saved as transformers saves it: config, generation config, a byte-level
    BPE tokenizer with a ChatML chat template, model.safetensors."""
    tokenizer = byte_level_bpe(
        ["There are some paragraphs below sourced from Wikipedia. Paragraph 1"],
        300,
        ["<|im_start|>", "<|im_end|>"],
        bos="<|im_start|>",
        chat_template=CHATML,
    )
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Repo.from_dir(out)


def longbench_records(n: int = 3) -> list[dict]:
    paragraph = "Paragraph {i}: The river flows past the old mill and into the sea near the town."
    return [
        {
            "input": "",
            "context": "\n\n".join(paragraph.format(i=j) for j in range(1, 4 + i)),
            "answers": [str(3 + i)],
            "length": 40 + i,
            "dataset": "passage_count",
            "language": "en",
            "all_classes": None,
            "_id": f"passage-count-{i}",
        }
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def longbench_repo() -> Repo:
    """THUDM/LongBench's layout: data.zip holding data/<dataset>.jsonl."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("data/passage_count.jsonl", "".join(json.dumps(r) + "\n" for r in longbench_records()))
    return Repo({"data.zip": buf.getvalue(), "README.md": b"# LongBench (test copy)\n"})


@pytest.fixture
def hub(model_repo, longbench_repo):
    with HubServer({("model", MODEL_ID): model_repo, LONGBENCH: longbench_repo}) as server:
        yield server


def refused_endpoint() -> str:
    """A 127.0.0.1 URL whose port refuses connections (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def child_env(tmp_path: Path, endpoint: str, offline: bool = False) -> dict[str, str]:
    """The environment of a user's shell: no offline flags, empty caches in tmp_path, HF_ENDPOINT set."""
    drop = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "LONGBENCH_DIR", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_CACHE=str(tmp_path / "hf" / "hub"),
        SNAPKV_BENCH_CACHE=str(tmp_path / "snapkv-cache"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(ROOT),
    )
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def run_py(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    # compare=[]: the method alone (the Hub paths are the subject, not the default's side-by-side)
    cmd = [sys.executable, "run.py", "progress=false", "report=false", "compare=[]", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def timed(env: dict[str, str], *calls: str) -> list[dict]:
    """Run each of `calls` in one fresh interpreter with `env`; imports happen before the clock starts,
    so the seconds are those of the Hub path alone (start-up on a loaded machine varies by seconds)."""
    script = f"""
import builtins, json, time
import huggingface_hub, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
import snapkv_models.loading, eval.runner, eval.tasks.longbench.task
for call in {list(calls)!r}:
    t = time.perf_counter()
    try:
        out, error = str(builtins.eval(call)), None  # `eval` is the package here
    except Exception as err:
        out, error = None, f"{{type(err).__name__}}: {{err}}"
    print(json.dumps({{"seconds": time.perf_counter() - t, "out": out, "error": error}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(calls) :]]


def rows(results_dir: Path) -> list[dict]:
    files = sorted(results_dir.rglob("*.jsonl"))
    return [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]


LONGBENCH_RUN = (f"model.name={MODEL_ID}", "task=longbench", "task.datasets=[passage_count]", "task.limit=2",
                 "budget=64", "method.window=8")  # fmt: skip


# ---------------------------------------------------------------------------- downloads, then offline
def test_run_py_downloads_model_and_longbench_once_then_runs_offline(hub, tmp_path):
    """`python run.py model.name=<org/model> task=longbench` without data_dir: both come from the
    endpoint, once; later runs work from the caches with the server gone and with HF_HUB_OFFLINE=1."""
    env = child_env(tmp_path, hub.url)
    first = run_py(env, *LONGBENCH_RUN, f"results_dir={tmp_path / 'runs1'}")
    assert first.returncode == 0, first.stderr[-3000:]
    got = rows(tmp_path / "runs1")
    assert [r["sample_id"] for r in got] == ["passage-count-0", "passage-count-1"]
    assert {r["model"] for r in got} == {MODEL_ID} and {r["status"] for r in got} == {"ok"}
    assert hub.unhandled == []  # every request huggingface_hub / transformers made was understood
    gets = hub.paths_requested("GET")
    sha = {
        name: hashlib.sha256(data).hexdigest() for name, data in hub.repos[("model", MODEL_ID)].files.items()
    }
    zip_sha = hashlib.sha256(hub.repos[LONGBENCH].files["data.zip"]).hexdigest()
    assert gets.count(f"/lfs/{sha['model.safetensors']}") == 1  # weights via the CDN redirect
    assert gets.count(f"/lfs/{zip_sha}") == 1
    assert any(p.endswith("/config.json") for p in gets) and any(p.endswith("/tokenizer.json") for p in gets)
    extracted = tmp_path / "snapkv-cache" / "longbench" / "data" / "passage_count.jsonl"
    assert extracted.is_file()

    # Server gone (connections refused): the model from the Hugging Face cache, the data extracted.
    hub.stop()
    second = run_py(env, *LONGBENCH_RUN, f"results_dir={tmp_path / 'runs2'}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Retrying" not in second.stderr
    assert [r["prediction"] for r in rows(tmp_path / "runs2")] == [r["prediction"] for r in got]  # same model

    # HF_HUB_OFFLINE=1 and the extracted files removed: data.zip itself comes from the Hub cache.
    shutil.rmtree(extracted.parent)
    offline = child_env(tmp_path, refused_endpoint(), offline=True)
    third = run_py(offline, *LONGBENCH_RUN, f"results_dir={tmp_path / 'runs3'}")
    assert third.returncode == 0, third.stderr[-3000:]
    assert extracted.is_file() and len(rows(tmp_path / "runs3")) == 2


# ---------------------------------------------------------------------------- an endpoint that refuses
def test_unreachable_endpoint_fails_at_once(tmp_path):
    """A missing model id, tokenizer id and LongBench data, endpoint refusing: an error naming the
    fix, at once (without the probe: 46 s for the model, 23 s for the data, of huggingface_hub retry
    sleeps)."""
    endpoint = refused_endpoint()
    model, tokenizer, data = timed(
        child_env(tmp_path, endpoint),
        "snapkv_models.loading.load_model('tiny-org/missing')",
        "eval.runner.load_tokenizer('tiny-org/missing')",
        "eval.tasks.longbench.task.find_data_file('passage_count')",
    )
    assert [r["seconds"] < FAST_S for r in (model, tokenizer, data)] == [True] * 3, (model, tokenizer, data)
    for result, fix in [(model, "(model.name=PATH)"), (data, "task.data_dir=... or LONGBENCH_DIR=...")]:
        assert result["error"] is not None and result["error"].startswith("FileNotFoundError"), result
        assert f"the Hub endpoint {endpoint} cannot be reached" in result["error"]
        assert "local Hugging Face cache" in result["error"] and fix in result["error"]
    assert "'tiny-org/missing'" in model["error"]
    assert tokenizer["error"].startswith(
        "FileNotFoundError: tokenizer 'tiny-org/missing' could not be loaded"
    )


@pytest.mark.parametrize(
    "args, expected",
    [
        (["model.name=tiny-org/missing"], "model.name=PATH"),
        (["task=longbench"], "task.data_dir=... or LONGBENCH_DIR=..."),
    ],
    ids=["model", "longbench"],
)
def test_run_py_unreachable_endpoint_one_line_exit_2(tmp_path, args, expected):
    # Wall time is not asserted here (start-up alone varies by tens of seconds on a loaded machine;
    # the Hub path is timed in test_unreachable_endpoint_fails_at_once); without the probe the
    # retries cost 23 s per file.
    proc = run_py(child_env(tmp_path, refused_endpoint()), *args, f"results_dir={tmp_path / 'runs'}")
    assert "Retrying" not in proc.stderr  # huggingface_hub's backoff (5 retries per file) never started
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "cannot be reached" in errors[0] and expected in errors[0], errors[0]
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------- an endpoint that answers (slowly)
def test_slow_endpoint_still_downloads(model_repo, longbench_repo, tmp_path):
    """Every answer 2 s late: reachable, so the download runs (the probe stops waiting after 1 s)."""
    with HubServer({LONGBENCH: longbench_repo}, delay=2.0) as slow:
        (result,) = timed(
            child_env(tmp_path, slow.url), "eval.tasks.longbench.task.find_data_file('passage_count')"
        )
        assert result["error"] is None, result
        assert Path(result["out"]).read_text().count("\n") == 3
        assert ("HEAD", "/datasets/THUDM/LongBench/resolve/main/data.zip") in slow.requests
        assert slow.unhandled == []


def test_missing_repo_on_answering_endpoint_is_a_fast_clear_error(hub, tmp_path):
    (result,) = timed(child_env(tmp_path, hub.url), "snapkv_models.loading.load_model('tiny-org/missing')")
    assert result["error"].startswith("FileNotFoundError: model 'tiny-org/missing' could not be loaded: ")
    assert "model.name=PATH" in result["error"] and "cannot be reached" not in result["error"]
    assert result["seconds"] < FAST_S, result
    assert hub.unhandled == []


# --------------------------------------------------------------------------------------- the probe
@pytest.fixture
def online(monkeypatch):
    """The probe in this process: conftest switches huggingface_hub to offline mode for all tests."""
    from snapkv_models import hub  # here: at module level `hub` is the Hub look-alike fixture

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub._probe.cache_clear()
    yield hub
    hub._probe.cache_clear()


def test_probe_refused_answering_and_slow(online, longbench_repo):
    endpoint = refused_endpoint()
    reason = online._probe(endpoint, 10.0)
    assert reason == f"the Hub endpoint {endpoint} cannot be reached (Connection refused)"
    with HubServer({LONGBENCH: longbench_repo}) as server:
        assert online._probe(server.url, 10.0) is None
        assert server.requests == []  # a TCP connection only: no request reaches the Hub
    with HubServer({}, delay=3.0) as slow:
        start = time.perf_counter()
        assert online._probe(slow.url, 10.0) is None  # accepts connections: slow, not unreachable
        assert time.perf_counter() - start < 1.0


def test_probe_goes_through_the_proxy(online, monkeypatch, longbench_repo):
    refused = refused_endpoint()
    with HubServer({LONGBENCH: longbench_repo}) as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)  # the endpoint refuses, its proxy answers
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        assert online._probe("http://hub.invalid", 10.0) is None
        online._probe.cache_clear()
        monkeypatch.setenv("HTTP_PROXY", refused)
        port = refused.rsplit(":", 1)[1]
        assert online._probe("http://hub.invalid", 10.0) == (
            f"the Hub endpoint http://hub.invalid cannot be reached through the proxy 127.0.0.1:{port} "
            "(Connection refused)"
        )


def test_offline_mode_is_not_probed(monkeypatch):
    from snapkv_models import hub  # here: at module level `hub` is the Hub look-alike fixture

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "_probe", lambda *a: pytest.fail("probed in offline mode"))
    assert hub.hub_unavailable() == "offline mode is on (HF_HUB_OFFLINE=1)"
    assert hub.cache_only_kwargs() == {"local_files_only": True}


# ------------------------------------------------------------------- LFS redirects (huggingface_hub 1.30-1.x)
@pytest.mark.parametrize("cdn_host", ["127.0.0.1", "localhost"], ids=["same-host-other-port", "other-host"])
def test_lfs_redirect_is_not_followed_to_another_origin(online, longbench_repo, tmp_path, cdn_host):
    """data.zip's HEAD answers 302 to the CDN with the file's metadata: the client must take it from
    that answer and GET the CDN once. huggingface_hub 1.30-1.33 (transformers 5.2.0's) followed the
    redirect when the CDN was on the Hub's host name, another port, and failed: "missing the
    'X-Repo-Commit' header" (`snapkv_models.hub.origin_aware_redirects` fixes that)."""
    online.origin_aware_redirects()
    with HubServer({LONGBENCH: longbench_repo}, cdn_host=cdn_host) as server:
        path = hf_hub_download(
            LONGBENCH[1], "data.zip", repo_type="dataset", endpoint=server.url, cache_dir=tmp_path
        )
        data = longbench_repo.files["data.zip"]
        assert Path(path).read_bytes() == data
        lfs = f"/lfs/{hashlib.sha256(data).hexdigest()}"
        assert server.requests == [("HEAD", "/datasets/THUDM/LongBench/resolve/main/data.zip"), ("GET", lfs)]


def test_redirect_check_compares_origins():
    """After `origin_aware_redirects()` huggingface_hub treats a redirect as within the Hub only for the
    same (scheme, host, port) or a Hub endpoint's, on 1.x as on 2.x."""
    from snapkv_models import hub  # here: at module level `hub` is the Hub look-alike fixture

    hub.origin_aware_redirects()
    within = _http._is_same_or_hub_host
    assert within(
        "http://127.0.0.1:8000/org/m/resolve/main/w.bin", "http://127.0.0.1:8000/org/m2/resolve/main/w.bin"
    )
    assert not within("http://127.0.0.1:8000/org/m/resolve/main/w.bin", "http://127.0.0.1:9000/lfs/abc")
    assert within(
        "https://mirror.invalid/org/m/resolve/main/w.bin", "https://huggingface.co/org/m/resolve/main/w.bin"
    )
    assert not within(
        "https://huggingface.co/org/m/resolve/main/w.bin", "http://huggingface.co/org/m/resolve/main/w.bin"
    )
    assert not within("https://huggingface.co/org/m/resolve/main/w.bin", "https://cdn-lfs.hf.co/repos/abc")
