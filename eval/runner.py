"""Run one (task x model x method) configuration: `python run.py ...` calls `run(cfg)`.

Flow: build the task (registry `TASKS`, `cfg.task.name`) and the method (`snapkv.build_method(**cfg.method)`)
first, so bad input fails before a model is loaded; open the results file
`{results_dir}/{task}/{model}/{method}-{hash8}[.shardIofN].jsonl` and skip the samples it already
holds with status ok (resume); load the model once; run this job's shard of the remaining samples,
appending ONE ROW PER SAMPLE as soon as it finishes (schema: `eval.store`); finally rewrite the
report (report.md, summary.csv, needle heatmaps) of the whole `results_dir`.

A failing sample becomes a row with status "error" (or "oom") and the loop goes on; those samples
are retried on the next run. `hash8` covers everything in the config that changes a row: the method
and its parameters, `query_aware`, the model's dtype, attention implementation and chat-template
switch, the prefill chunk size (same tokens kept, different memory/timings), and the task's config
except the keys that only choose which samples run (`SELECTION_KEYS`). The device is left out, so a
run can resume on another machine; the model id is in the file's path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import re
import subprocess
import sys
import time
from datetime import datetime, timezone
from functools import cache
from pathlib import Path
from typing import Any

import torch
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from eval.store import ROW_FIELDS, ResultStore, config_hash, result_path, shard
from eval.tasks.base import Sample
from eval.tasks.longbench import LongBenchTask
from eval.tasks.needle import NeedleTask
from eval.tasks.ruler import RulerTask
from snapkv import GenerationResult, build_method, generate
from snapkv.models import EMBEDDED, fetch_embedded, load_model

# Task name (`task.name` in conf/task/*.yaml) -> class; the rest of the task node is its arguments.
TASKS: dict[str, type] = {"needle": NeedleTask, "longbench": LongBenchTask, "ruler": RulerTask}

# Task-node keys the runner consumes (job sharding) rather than the task.
RUN_KEYS = ("name", "shard", "num_shards")
# Task keys that only choose WHICH samples run, not what one sample outputs: left out of the config
# hash, so a grid or a dataset list can grow without recomputing the samples already stored.
SELECTION_KEYS = ("lengths", "depths", "datasets", "limit", "data_dir", "tasks", "samples")
# GenerationResult fields copied into the row: the schema's measurement columns, plus a few extras.
RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationResult) if f.name in ROW_FIELDS) + (
    "new_tokens",
    "stop_reason",
    "kv_tokens_per_layer",
)
REPO_ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ building
def _container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def build_task(task_cfg: DictConfig | dict) -> tuple[Any, int, int]:
    """`(task, shard, num_shards)` from a task node: `TASKS[name](**rest)`; ValueError for unknown names."""
    params = dict(_container(task_cfg))
    name = params.pop("name", None)
    shard_i, num_shards = params.pop("shard", 0), params.pop("num_shards", 1)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    for key, value in (("task.shard", shard_i), ("task.num_shards", num_shards)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{key} must be an integer, got {key}={value!r}")
    if num_shards < 1 or not 0 <= shard_i < num_shards:
        raise ValueError(
            f"task.shard must satisfy 0 <= shard < num_shards, got shard={shard_i}, num_shards={num_shards}"
        )
    try:
        task = TASKS[name](**params)
    except TypeError as e:  # an argument the task does not take (e.g. added with +task.foo=...)
        raise ValueError(f"task {name!r}: {e}") from None
    return task, shard_i, num_shards


def method_hash(cfg: DictConfig, task: Any, method: Any) -> str:
    """Config hash of everything that changes one sample's output (see the module docstring)."""
    task_params = {
        k: v for k, v in _container(cfg.task).items() if k not in RUN_KEYS and k not in SELECTION_KEYS
    }
    return config_hash(
        {
            "method": method.name,
            "method_params": method.params(),
            "query_aware": bool(cfg.query_aware),
            "task": {"name": task.name, "version": getattr(task, "version", None), **task_params},
            "model": {
                "dtype": cfg.model.dtype,
                "attn_implementation": cfg.model.attn_implementation,
                "chat_template": bool(cfg.model.chat_template),
            },
            "prefill_chunk_size": cfg.prefill.chunk_size,
        }
    )


def load_tokenizer(name: str, model: Any = None):
    """A tokenizer by name (for random-weight models): an embedded model's, a .gguf file's, a local
    directory's or a Hub id's. ValueError when its vocabulary does not fit `model`'s embeddings."""
    from transformers import AutoTokenizer

    if name in EMBEDDED:
        path = fetch_embedded(name)
    else:
        path = Path(name).expanduser()
    try:
        if path.suffix == ".gguf":
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path) if path.exists() else name)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FileNotFoundError(f"tokenizer {name!r} could not be loaded: {first}") from e
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(
            f"tokenizer {name!r} has {len(tokenizer)} tokens, more than the model's vocab_size={vocab}; "
            "set model.tokenizer to one with a smaller vocabulary"
        )
    return tokenizer


# The last model loaded, kept so that the jobs of a sequential sweep (`python run.py -m ...` with the
# default launcher: all jobs in one process) load it once; one slot, so memory holds one model.
_LOADED: dict[tuple, tuple] = {}


def get_model(model_cfg: DictConfig, seed: int) -> tuple[Any, Any, dict]:
    """`(model, tokenizer, info)` for a model node, reusing the previous job's model when identical."""
    key = (
        str(model_cfg.name),
        model_cfg.get("tokenizer"),
        model_cfg.dtype,
        model_cfg.device,
        model_cfg.attn_implementation,
        seed,
    )
    if key not in _LOADED:
        _LOADED.clear()  # free the previous model before loading another
        gc.collect()
        model, tokenizer, info = load_model(
            key[0], dtype=key[2], device=key[3], attn_implementation=key[4], seed=seed
        )
        if key[1]:
            tokenizer = load_tokenizer(key[1], model)
        if tokenizer is None:
            raise ValueError(
                f"model {key[0]!r} has no tokenizer; set model.tokenizer=<embedded name, dir or Hub id>"
            )
        _LOADED[key] = (model, tokenizer, info)
    return _LOADED[key]


# ------------------------------------------------------------------------------------- provenance
@cache
def versions() -> dict[str, str | None]:
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "snapkv_bench": _own_version(),
    }


def _own_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("snapkv-bench")
    except PackageNotFoundError:  # running from a checkout that is not pip-installed
        pyproject = REPO_ROOT / "pyproject.toml"
        m = (
            re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
            if pyproject.is_file()
            else None
        )
        return m.group(1) if m else None


@cache
def git_sha() -> str | None:
    """Commit of the harness checkout (None outside a git checkout or without git)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", sha) else None


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ------------------------------------------------------------------------------------------ samples
def one_line(err: BaseException) -> str:
    """`Type: first line of the message` (rows and console keep errors on one line)."""
    text = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def is_oom(err: BaseException) -> bool:
    return isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower()
    )


def run_sample(
    sample: Sample, task: Any, model: Any, tokenizer: Any, method: Any, cfg: DictConfig, base: dict
) -> dict:
    """One sample -> one complete result row (status ok / error / oom; never raises for the sample)."""
    row: dict[str, Any] = {k: None for k in ROW_FIELDS}
    row.update({k: v for k, v in sample.extra.items() if k not in ROW_FIELDS})
    row.update(base)
    row.update(
        sample_id=sample.sample_id,
        dataset=sample.dataset,
        answers=list(sample.answers),
        scores={},
        context_length=sample.extra.get("context_length"),
        depth_percent=sample.extra.get("depth_percent"),
        length=sample.length,
    )
    try:
        result = generate(
            model,
            tokenizer,
            context=sample.context,
            question=sample.question,
            method=method,
            query_aware=bool(cfg.query_aware),
            chat_template=bool(sample.chat_template and cfg.model.chat_template),
            max_new_tokens=sample.max_new_tokens,
            chunk_size=cfg.prefill.chunk_size,
        )
        measured = result.to_dict()
        row.update({k: measured[k] for k in RESULT_FIELDS})
        row["prediction"] = result.text
        row["score"] = float(task.score(sample, result.text))
        if hasattr(task, "score_all"):
            row["scores"] = {k: float(v) for k, v in task.score_all(sample, result.text).items()}
        row.update(status="ok", error=None)
    except Exception as err:  # noqa: BLE001 - a failing sample is recorded, the run goes on
        oom = is_oom(err)
        row.update(
            prediction=None, score=None, scores={}, status="oom" if oom else "error", error=one_line(err)
        )
        if oom:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    row["timestamp"] = _utc_now()
    return row


# ----------------------------------------------------------------------------------------------- run
def run(cfg: DictConfig) -> Path:
    """Run the configuration `cfg` (conf/config.yaml composed) and return its results_dir."""
    t_start = time.perf_counter()
    results_dir = Path(str(cfg.results_dir)).expanduser()
    task, shard_i, num_shards = build_task(cfg.task)
    method = build_method(**_container(cfg.method))
    h = method_hash(cfg, task, method)
    path = result_path(results_dir, task.name, cfg.model.name, method.name, h, shard_i, num_shards)
    store = ResultStore(path)
    done = store.done_ids()  # also rejects a malformed results file before the model loads
    if hasattr(task, "num_samples"):
        task.num_samples()  # reads the data: a missing/malformed file fails before the model loads

    model, tokenizer, info = get_model(cfg.model, int(cfg.seed))

    samples = shard(task.samples(tokenizer), shard_i, num_shards)
    todo = [s for s in samples if s.sample_id not in done]
    label = _label(method, cfg)
    _log(
        f"{task.name} x {cfg.model.name} x {label}: {len(samples)} samples"
        + (f" in shard {shard_i}/{num_shards}" if num_shards > 1 else "")
        + f", {len(samples) - len(todo)} already done, {len(todo)} to run -> {path}"
    )
    base = {
        "model": cfg.model.name,
        "task": task.name,
        "method": method.name,
        "method_params": method.params(),
        "method_hash": h,
        "query_aware": bool(cfg.query_aware),
        "dtype": cfg.model.dtype,
        "attn_impl": info["attn_impl"],
        "device": info["device"],
        "versions": versions(),
        "git_sha": git_sha(),
        "seed": int(cfg.seed),
        "trained_context": cfg.model.get("context") or info.get("context"),
        "prefill_chunk_size": cfg.prefill.chunk_size,
    }
    counts = {"ok": 0, "error": 0, "oom": 0}
    bar = tqdm(todo, desc=f"{task.name} {label}", unit="sample", disable=not cfg.progress, dynamic_ncols=True)
    for sample in bar:
        row = run_sample(sample, task, model, tokenizer, method, cfg, base)
        store.append(row)
        counts[row["status"]] += 1
        if row["status"] != "ok":
            tqdm.write(f"[snapkv-bench] {sample.sample_id}: {row['status']}: {row['error']}", file=sys.stderr)
        bar.set_postfix({k: v for k, v in counts.items() if v})
    bar.close()
    _log(
        f"done in {time.perf_counter() - t_start:.0f} s: {counts['ok']} ok, {counts['error']} error, "
        f"{counts['oom']} oom; rows in {path}"
    )
    if cfg.get("report", True) and not _in_multirun():
        write_report(results_dir)
    return results_dir


def _label(method: Any, cfg: DictConfig) -> str:
    from eval.report import method_label

    return method_label(method.name, method.params(), bool(cfg.query_aware))


def _log(msg: str) -> None:
    print(f"[snapkv-bench] {msg}", file=sys.stderr, flush=True)


def _in_multirun() -> bool:
    """True inside a job of `python run.py -m ...`: the report is then written once, by ReportCallback."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


# ---------------------------------------------------------------------------------------------- report
def write_report(results_dir: str | Path, quiet: bool = False) -> Path | None:
    """Rewrite report.md, summary.csv and the plots of `results_dir` (eval.report); print where they are."""
    from eval.report import main as report_main

    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        _log(f"no report: {results_dir} does not exist")
        return None
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = report_main([str(results_dir)])
    if code != 0:
        _log(f"no report: {err.getvalue().strip()}")
        return None
    if not quiet:
        print(out.getvalue(), flush=True)
    for line in err.getvalue().splitlines():  # report warnings (merged configs, omitted rows)
        _log(line)
    plots = sorted(p.name for p in results_dir.glob("*.png"))
    _log(f"report: {results_dir / 'report.md'}  table: {results_dir / 'summary.csv'}")
    if plots:
        _log(f"plots in {results_dir}: {', '.join(plots)}")
    return results_dir / "report.md"


class ReportCallback(Callback):
    """Hydra callback (conf/config.yaml `hydra.callbacks.report`): after a sweep's last job, write
    the report of results_dir once (jobs running in parallel never write it concurrently)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        for results_dir in sweep_results_dirs(config):
            write_report(results_dir)


def sweep_results_dirs(config: DictConfig) -> list[str]:
    """The results_dirs of a sweep's jobs that want a report, from each job's saved
    `{sweep dir}/{job}/.hydra/config.yaml` (any launcher writes them; a sweep may vary results_dir),
    else the sweep's own results_dir."""
    found: dict[str, bool] = {}
    try:
        sweep_dir, subdir = Path(config.hydra.sweep.dir), config.hydra.output_subdir
    except Exception:  # noqa: BLE001 - no hydra node (called outside Hydra): use the config itself
        sweep_dir, subdir = None, None
    if sweep_dir is not None and subdir and sweep_dir.is_dir():
        for saved in sorted(sweep_dir.glob(f"*/{subdir}/config.yaml")):
            try:
                job = OmegaConf.load(saved)
                found.setdefault(str(job.results_dir), bool(job.get("report", True)))
            except Exception:  # noqa: BLE001 - an unreadable job config just adds nothing
                continue
    if not found:
        found[str(config.results_dir)] = bool(config.get("report", True))
    return [d for d, wanted in found.items() if wanted]
