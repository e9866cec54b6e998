"""Results store: one JSONL file per (task x model x method config) [x shard], one row per sample,
appended as each sample finishes (`ResultStore`) and merged over a results dir (`load_dir`).

The row schema is `ROW_SCHEMA` below. Where a file lives: `result_path`; concurrent runs:
`ResultStore.exclusive`; crash safety: `ResultStore.append`; resume: `ResultStore.done_ids`; rows
written before today's schema: `normalize_row`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pandas as pd
from filelock import FileLock, Timeout

from snapkv.methods.registry import METHODS

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The generic row schema, in column order: field -> (JSON type, meaning). Every row is one JSON
# object on one line: these fields (filled by the runner) plus the task's own metadata columns
# (`Task.row_metadata`, e.g. the needle task's `context_length`, `depth_percent`, LongBench's
# `length`, `prompt_tokens`, `truncated`; see the task's docstring). Nothing here knows a task.
# The machine columns (`other_cores` ... `omp_wait_policy`) are absent (None) in rows written
# before they existed; the report prints "n/a" for them.
ROW_SCHEMA: dict[str, tuple[str, str]] = {
    "sample_id": ("str", "task-unique sample id (resume / de-duplication key)"),
    "model": (
        "str",
        "short model key, the results folder name (`model.key`, else a local path's stem, else the name)",
    ),
    "model_path": ("str", "what was loaded: embedded name, local path or Hub id (`model.name`)"),
    "task": ("str", "task name (`longbench`, `needle`, ...)"),
    "dataset": ("str", "dataset / subtask (LongBench dataset name; `needle` for the needle task)"),
    "method": ("str", "compression method (`full`, `snapkv`, ...)"),
    "method_params": ("dict", "all the method's parameters (budget, window, kernel_size, pooling, ...)"),
    "method_hash": (
        "str",
        "`config_hash` of method + params + query_aware (+ protocol for the shared protocols) + output-relevant task config; in the file name",
    ),
    "query_aware": (
        "bool",
        "question compressed with the context (True, SnapKV/LongBench) or fed after compression (False)",
    ),
    "protocol": (
        "str",
        "`query_aware`, `context_only`, `first_question`, `multi_request` or `multi_turn` (eval/protocols.py); absent in older rows: read from `query_aware`",
    ),
    "context_id": (
        "str | null",
        "the context the question is asked about (shared by its questions; null: a single-question task)",
    ),
    "question_index": ("int", "0-based order in which the context's questions are asked"),
    "questions_in_context": (
        "int",
        "N, the questions of that context (amortised cost = context_prefill_s / N)",
    ),
    "input_tokens": (
        "int",
        "prompt tokens after truncation / as built (shared protocols: tokens in the cache before the first answer token)",
    ),
    "kv_tokens": (
        "float",
        "mean entries kept per compressible layer and KV head after prefill (= input_tokens uncompressed)",
    ),
    "kv_bytes_full": ("int", "bytes the uncompressed KV cache of the prompt would take"),
    "kv_bytes": (
        "int",
        "bytes the stored K/V tensors really allocate after compression (Σ numel·element_size)",
    ),
    "kv_bytes_logical": ("int", "bytes of the entries kept (= kv_bytes except Ada-KV's padded layout)"),
    "kv_index_bytes": (
        "int | null",
        "bytes of the kept-index bookkeeping beside kv_bytes: the int64 positions of each compressed layer's kept entries (0 uncompressed; absent in rows written before it was recorded)",
    ),
    "compressed": (
        "bool",
        "whether compression ran at the end of prefill (False e.g. when the prompt fits the budget)",
    ),
    "evicted_during_decode": (
        "bool",
        "whether entries were evicted while decoding (H2O, StreamingLLM; also with a prompt shorter than the budget)",
    ),
    "decode_evicted": ("float", "entries evicted while decoding, per KV head, mean over compressible layers"),
    "kv_tokens_end": (
        "float",
        "mean KV entries per layer and head at the end of generation (null where a rollback follows the answer)",
    ),
    "decode_compressions": (
        "int | null",
        "scheduled compressions while decoding (`method.decode_schedule`; 0 without one; null in the shared protocols)",
    ),
    "kv_entries_peak": (
        "float | null",
        "largest KV entries per head a forward after the prefill attended to, mean over compressible layers (null: no such forward, or a shared protocol)",
    ),
    "kv_entries_mean": (
        "float | null",
        "mean over the forwards after the prefill of the KV entries per head they attended to (same units as kv_entries_peak)",
    ),
    "rollback_bytes": (
        "int | null",
        "bytes the checkpoint kept alive beyond the cache for the rollback after this question (null: no rollback)",
    ),
    "prefill_s": (
        "float",
        "prefill (prompt forward + compression) wall time, seconds (shared protocols: the context's shared prefill)",
    ),
    "context_prefill_s": (
        "float",
        "the context's prefill + compression, on every question's row (= prefill_s; shared once by `questions_in_context` questions in the shared protocols)",
    ),
    "scoring_s": (
        "float | null",
        "seconds of the method's own pass after the prompt forward (KVzip's context reconstruction), included in prefill_s and context_prefill_s; ~0 for methods without one; null in rows written before it existed",
    ),
    "ttft_s": ("float", "time to first token, seconds (shared protocols: from feeding the question)"),
    "warmup_s": (
        "float | null",
        "seconds of the untimed warm-up generation the run ran before its first timed sample (`eval.runner.warm_up`): the cold start no row's timing includes; null in rows written before it existed",
    ),
    "tpot_s": ("float", "median time per output token after the first, seconds"),
    "new_tokens": ("int", "tokens generated (the stop token included when generation stopped at one)"),
    "stop_reason": ("str", "`eos` (a stop token) or `length` (max_new_tokens reached)"),
    "e2e_s": (
        "float | null",
        "end to end: prefill + compression + every decode step (ttft_s + the decode steps; null for a question answered on an already compressed cache, eval/protocols.py)",
    ),
    "peak_mem_bytes": (
        "int",
        "peak memory during the sample: the CUDA allocator peak on GPU, the process RSS peak (sampled) on CPU",
    ),
    "decode_peak_mem_bytes": (
        "int | null",
        "peak memory while decoding, from the end of compression on (same probe as peak_mem_bytes; on CPU an upper bound, RSS keeps what the allocator holds); absent where a protocol or task does not measure it and in rows written before it was recorded",
    ),
    "attn_impl": ("str", "attention implementation (`sdpa`, `eager`, `flash_attention_2`)"),
    "dtype": ("str", "model dtype (`bfloat16`, ...)"),
    "device": ("str", "device the sample ran on (`cuda:0`, `cpu`, ...)"),
    "other_cores": (
        "float | null",
        "cores other processes kept busy while the sample ran (`eval.machine.CpuNoise`: Δ machine busy CPU - Δ this process's CPU, / Δ wall; 0 = quiet)",
    ),
    "load_1m": ("float | null", "1-minute load average when the sample finished"),
    "torch_threads": ("int | null", "`torch.get_num_threads()` while the sample ran"),
    "cpu_count": ("int | null", "`os.cpu_count()` of the machine"),
    "cpu_kernels": (
        "str | null",
        "torch's CPU dispatch level and the CPU's AVX-512/AMX bf16 and fp16 flags (`eval.machine.cpu_kernels`, e.g. `\"AVX512 avx512_bf16\"`): the kernels a bfloat16 run took",
    ),
    "omp_num_threads": ("str | null", 'the OMP_NUM_THREADS environment variable (`""`: unset)'),
    "mkl_num_threads": ("str | null", 'the MKL_NUM_THREADS environment variable (`""`: unset)'),
    "omp_wait_policy": ("str | null", 'the OMP_WAIT_POLICY environment variable (`""`: unset)'),
    "prediction": ("str | null", "generated text (null when the sample failed)"),
    "answers": ("list[str]", "reference answers"),
    "prompt_sha": (
        "str | null",
        "sha256 (hex) of the sample's prompt text as the model saw it (context + question, chat template applied as the run applied it; the shared protocols' later turns add to it); the report pairs samples by it; absent in older rows",
    ),
    "target_sha": (
        "str",
        "sha256 (hex) of the reference answers (`canonical_json` of `answers`); absent in older rows",
    ),
    "score": ("float | null", "main metric in [0, 1]; null when status != ok"),
    "scores": ("dict", 'extra metrics in [0, 1], e.g. `{"exact": 1.0, "partial": 0.43}`'),
    "status": ("str", "`ok`, `oom` or `error`"),
    "error": ("str | null", "the one-line exception type and message when status != ok"),
    "versions": ("dict", '`{"torch": ..., "transformers": ..., "snapkv_bench": ...}`'),
    "git_sha": ("str | null", "commit of the harness that produced the row"),
    "git_dirty": ("bool | null", "the checkout had uncommitted changes (tracked or untracked files)"),
    "git_diff_sha": ("str | null", "12 hex digits of the sha256 of those changes (null when clean)"),
    "slurm_job_id": ("int | null", "`SLURM_JOB_ID` of the job that ran the sample (null outside SLURM)"),
    "slurm_array_job_id": (
        "int | null",
        "`SLURM_ARRAY_JOB_ID`: the sweep's job array (null outside an array)",
    ),
    "slurm_array_task_id": (
        "int | null",
        "`SLURM_ARRAY_TASK_ID`: the array task (one sweep point; null outside an array)",
    ),
    "slurm_restart_count": (
        "int | null",
        "`SLURM_RESTART_COUNT`: times the job had been requeued (preemption, time limit); null before the first",
    ),
    "seed": ("int", "random seed"),
    "task_seed": (
        "int | null",
        "generator seed of a generated sample (needle, RULER, kv_retrieval: `task.seed` or one of `task.seeds`); null: a sample not drawn from a seed, or a row written before the field (its seed is then the config's `task.seed`)",
    ),
    "timestamp": ("str", "ISO-8601 UTC time the row was written, e.g. `2025-01-31T12:00:00Z`"),
    "rescored": (
        "dict | null",
        "set when scripts/rescore.py recomputed `score` / `scores` from the stored `prediction` with a later scorer: the rescoring commit (its git_sha, git_dirty, git_diff_sha), the timestamp and score_before, the score it replaced; null: scored when generated",
    ),
}
ROW_FIELDS: tuple[str, ...] = tuple(ROW_SCHEMA)
# The generic fields a task fills itself, through `Task.row_metadata` (the runner fills the others).
TASK_FIELDS: tuple[str, ...] = ("task_seed",)

# Columns of sampled rows only (`generation.do_sample=true`, eval/runner.py's `run_samples`); greedy
# rows have none of them. Each sample of a prompt is its own row, `sample_id` "<prompt_id>#<i>".
SAMPLED_ROW_SCHEMA: dict[str, tuple[str, str]] = {
    "prompt_id": ("str", "the task's sample id of the prompt (shared by its samples)"),
    "sample_index": ("int", "i, the sample's index among the prompt's samples (0-based)"),
    "sample_seed": (
        "int",
        "seed of the sample's torch.Generator: `eval.spec.sample_seed(seed, prompt_id, i)`, the same under every method",
    ),
    "temperature": ("float", "sampling temperature (`generation.temperature`)"),
    "top_p": ("float", "nucleus sampling threshold (`generation.top_p`)"),
}
# Columns of rows with quantized storage only (`kv_quant=kivi|quanto|hqq`); other rows have none.
QUANTIZED_ROW_SCHEMA: dict[str, tuple[str, str]] = {
    "kv_quant": (
        "dict",
        "how the kept entries were stored: kind, bits, group_size, residual, order (`snapkv.kv_quant.KVQuant`; part of the config hash; `packed: false` only for the reference storage of values read back); `kv_bytes` then counts the stored quantized layout: packed codes, scales, zero points and the full-precision residual",
    ),
}
STATUSES = ("ok", "oom", "error")

_HASH_RE = re.compile(r"-([0-9a-f]{8})(?:\.|$)")


class TruncatedRowWarning(UserWarning):
    """A results file ends with an incomplete line (a process was killed mid-write); it is skipped."""


class DuplicateRowWarning(UserWarning):
    """One sample of one config is stored in more than one results file (e.g. two shard files)."""


DUPLICATE_COLUMNS = ["task", "model", "method_hash", "sample_id", "files"]


def row_key(row: dict) -> tuple:
    """The key `load_dir` merges rows on: (task, model, method_hash, sample_id)."""
    return (row.get("task"), row.get("model"), row.get("method_hash"), str(row["sample_id"]))


def duplicate_rows(rows: Iterable[dict]) -> pd.DataFrame:
    """`DUPLICATE_COLUMNS` of every key (`row_key`) whose rows come from more than one file (their
    `file` field): the same sample of the same config written twice, e.g. by two shard runs that
    overlapped. A rerun appending to its own file (an error row, then the ok one) is not listed."""
    files: dict[tuple, list[str]] = {}
    for row in rows:
        where = files.setdefault(row_key(row), [])
        if row.get("file") not in where:
            where.append(row.get("file"))
    records = [[*k, ", ".join(sorted(map(str, f)))] for k, f in sorted(files.items(), key=str) if len(f) > 1]
    return pd.DataFrame(records, columns=DUPLICATE_COLUMNS)


def _json_default(obj: Any) -> Any:
    # numpy scalars / arrays, paths, sets: make rows written from tensors/arrays serialisable.
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 0) == 0:
        return obj.item()
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def canonical_json(obj: Any) -> str:
    """Stable JSON text: sorted keys, no whitespace, UTF-8 kept, NaN/inf rejected."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_json_default
    )


def config_hash(obj: dict, length: int = 8) -> str:
    """First `length` hex digits of sha256(canonical JSON of `obj`). Key order never matters.

    Pass everything that changes outputs, e.g.
    `{"method": "snapkv", "method_params": {...}, "query_aware": True, "task": {"max_prompt_tokens": 8000}}`.
    """
    if not isinstance(obj, dict):
        raise TypeError(f"config_hash expects a dict, got {type(obj).__name__}")
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()[:length]


def sha256_hex(text: str) -> str:
    """The sha256 hex digest of `text` (UTF-8): the rows' `prompt_sha` / `target_sha`."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def target_sha(answers: Sequence[str]) -> str:
    """`target_sha` of a row: sha256 of the canonical JSON of its reference answers (order kept)."""
    return sha256_hex(canonical_json(list(answers)))


def sample_keys(rows: pd.DataFrame, by_content: bool | None = None) -> pd.Series:
    """Per row, a string identifying its sample across configs: `prompt_sha:target_sha` (by
    content; `:sample_seed` appended for sampled rows, so each seed pairs with the same seed) or the JSON of `[task, dataset, sample_id]` (rows written before the hashes existed).

    by_content None: by content when every row carries both hashes, else by id for all of them (a
    key of one kind never matches one of the other).
    """
    if by_content is None:
        by_content = has_content_hashes(rows)
    if by_content:
        keys = [f"{p}:{t}" for p, t in zip(rows["prompt_sha"], rows["target_sha"])]
        if "sample_seed" in rows.columns:  # sampled rows: one per (prompt, seed), paired on the seed
            seeds = rows["sample_seed"]
            keys = [k if pd.isna(v) else f"{k}:{int(v)}" for k, v in zip(keys, seeds)]
    else:
        ids = zip(rows["task"], rows["dataset"], rows["sample_id"])
        keys = [canonical_json([str(t), str(d), str(s)]) for t, d, s in ids]
    return pd.Series(keys, index=rows.index, dtype=object)


def has_content_hashes(rows: pd.DataFrame) -> bool:
    """Whether every row carries `prompt_sha` and `target_sha` (rows written since they exist)."""
    return all(
        c in rows.columns and rows[c].map(lambda v: isinstance(v, str) and bool(v)).all()
        for c in ("prompt_sha", "target_sha")
    )


def shared_samples(a: pd.DataFrame, b: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """The rows of two configs `a` and `b` on the samples both ran, aligned: one row per sample (the
    first of duplicates), indexed by its `sample_keys` key in `b`'s order (the baseline's), and how
    they were matched: `content` where every row of both carries the hashes, else `sample_id` (a
    key of one kind never matches one of the other)."""
    by_content = has_content_hashes(a) and has_content_hashes(b)
    a = a.assign(_key=sample_keys(a, by_content)).drop_duplicates("_key").set_index("_key")
    b = b.assign(_key=sample_keys(b, by_content)).drop_duplicates("_key").set_index("_key")
    shared = [k for k in b.index if k in a.index]
    return a.loc[shared], b.loc[shared], "content" if by_content else "sample_id"


def safe_name(name: str) -> str:
    """A readable, path-safe file/dir name component: '/' -> '__', other odd characters -> '_'."""
    name = str(name).replace("/", "__").replace("\\", "__")
    name = re.sub(r"[^A-Za-z0-9._=+-]", "_", name).strip(".")
    return name or "_"


def model_key(name: str) -> str:
    """Short model key for folder names and report labels: a local file's or directory's stem
    (`/data/gemma-3-270m-q4_k_m.gguf` -> `gemma-3-270m-q4_k_m`), else the name itself (an embedded
    name or a Hub id `org/name`, made path-safe by `result_path`)."""
    name = str(name)
    path = Path(name).expanduser()
    looks_local = name.startswith(("/", "./", "../", "~")) or path.suffix == ".gguf" or path.exists()
    if looks_local and path.name not in ("", ".", ".."):
        return path.stem if path.is_file() or path.suffix == ".gguf" else path.name
    return name


def normalize_row(row: dict) -> dict:
    """A row in today's shape; rows already in it (they have `model_path`) are returned unchanged.

    Old rows (written before `model_path` existed: the committed `results/` and earlier runs) are
    read as they are: `model_path` = their `model`, `model` = its short key, the columns the old
    fixed schema wrote as null for other tasks (e.g. `depth_percent: null` on LongBench rows)
    dropped, and `method_params` completed by the method's `upgrade_params` with the values of
    switches added since (SnapKV's `gqa_order: pool_first`, ...), so a report labels them with what
    really ran. Their files resume too when today's config hashes the same (the runner also reads
    the old folder of a local-path model); a config whose defaults changed since gets a new file.
    """
    if "model_path" in row:
        return row
    row = {k: v for k, v in row.items() if k in ROW_FIELDS or v is not None}
    row["model_path"] = row.get("model")
    if row["model_path"] is not None:
        row["model"] = model_key(row["model_path"])
    # Switches added since the row was written: the method names what really ran (its own
    # `legacy_params`), so old and new rows never share a label in a report.
    cls = METHODS.get(row.get("method"))
    if cls is not None and isinstance(row.get("method_params"), dict):
        row["method_params"] = cls.upgrade_params(row["method_params"])
    return row


def result_path(
    results_dir: str | os.PathLike,
    task: str,
    model: str,
    method: str,
    method_hash: str,
    shard: int = 0,
    num_shards: int = 1,
) -> Path:
    """`{results_dir}/{task}/{model}/{method}-{hash8}.jsonl` (`.shard{i}of{n}.jsonl` when num_shards > 1).

    `method_hash` (hash8): `config_hash` of everything that changes outputs (method name and params,
    query_aware, the task's output-relevant config; eval/spec.py). `model`: the short model key
    (`model_key`). Names are made path-safe (`safe_name`: `org/name` -> `org__name`).
    Give each shard its own file: parallel jobs never write to the same file, and `load_dir`
    merges them.
    """
    _check_shard(shard, num_shards)
    stem = f"{safe_name(method).replace('.', '_')}-{method_hash}"
    suffix = f".shard{shard}of{num_shards}.jsonl" if num_shards > 1 else ".jsonl"
    return Path(results_dir) / safe_name(task) / safe_name(model) / (stem + suffix)


def _check_shard(shard: int, num_shards: int) -> None:
    for name, value in (("num_shards", num_shards), ("shard", shard)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard must satisfy 0 <= shard < num_shards={num_shards}, got {shard}")


def shard(items: Iterable[T], shard: int, num_shards: int) -> list[T]:
    """Deterministic split: item i (in iteration order) goes to shard `i % num_shards`."""
    _check_shard(shard, num_shards)
    return [x for i, x in enumerate(items) if i % num_shards == shard]


def _scan(path: Path) -> tuple[list[dict], int | None]:
    """Parse a results file. Returns (rows, offset of a malformed last line or None).

    Blank lines are ignored. A malformed last non-blank line is reported (not raised); a malformed
    line followed by further rows raises ValueError naming file and line.
    """
    data = path.read_bytes()
    parsed: list[tuple[int, int, Any]] = []  # (lineno, offset, row or exception)
    offset = 0
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        start, offset = offset, offset + len(raw) + 1
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            if "sample_id" not in row:
                raise ValueError("row has no 'sample_id'")
            parsed.append((lineno, start, row))
        except (ValueError, UnicodeDecodeError) as e:
            parsed.append((lineno, start, e))
    bad_tail = None
    if parsed and isinstance(parsed[-1][2], Exception):
        lineno, start, err = parsed.pop()
        bad_tail = start
        warnings.warn(
            f"{path}:{lineno}: skipping incomplete last line (process killed mid-write?): {err}",
            TruncatedRowWarning,
            stacklevel=3,
        )
    rows = []
    for lineno, _, row in parsed:
        if isinstance(row, Exception):
            raise ValueError(f"{path}:{lineno}: malformed result row: {row}")
        rows.append(row)
    return rows, bad_tail


def read_rows(path: str | os.PathLike) -> list[dict]:
    """All rows of one results file in file order (truncated last line skipped with a warning)."""
    path = Path(path)
    if not path.exists():
        return []
    return _scan(path)[0]


def latest_rows(rows: Iterable[dict], key=lambda r: r["sample_id"]) -> dict[Any, dict]:
    """Winning row per key: the last row with status "ok" if any, else the last row."""
    best: dict[Any, dict] = {}
    for row in rows:
        k = key(row)
        old = best.get(k)
        if old is None or row.get("status") == "ok" or old.get("status") != "ok":
            best[k] = row
    return best


def _looks_like_results(path: Path) -> bool:
    """False for other JSONL files under a results dir (e.g. exported LongBench `pred/<dataset>.jsonl`):
    their first row is a JSON object without `sample_id`. Unparseable first lines count as results
    (so the usual errors/warnings name them)."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    first = json.loads(raw)
                except ValueError:
                    return True
                return not (isinstance(first, dict) and "sample_id" not in first)
    return True


class ResultStore:
    """Append-only JSONL store for one (task x model x method config) [x shard] file."""

    def __init__(self, path: str | os.PathLike, also_read: Sequence[str | os.PathLike] = ()):
        """`also_read`: older files of the same config (e.g. an old folder name) that count for resume."""
        self.path = Path(path)
        self.also_read = [Path(p) for p in also_read]
        self._repaired = False

    # -- reading ---------------------------------------------------------------------------------
    def rows(self) -> list[dict]:
        """Rows of this file, in write order."""
        return read_rows(self.path)

    def sibling_paths(self) -> list[Path]:
        """This file plus the other shard files of the same config (`{method}-{hash8}*.jsonl`)."""
        stem = self.path.name.split(".", 1)[0]
        found = set()
        if self.path.parent.is_dir():
            for p in self.path.parent.iterdir():
                if p.is_file() and p.name.endswith(".jsonl") and p.name.split(".", 1)[0] == stem:
                    found.add(p)
        found.add(self.path)
        return sorted(found)

    def latest(self) -> dict[str, dict]:
        """Winning row per sample_id over this file and its shard siblings (a finished retry wins)."""
        rows: list[dict] = []
        for p in self.sibling_paths() + [p for p in self.also_read if p.is_file()]:
            rows.extend(read_rows(p))
        return latest_rows(rows)

    def done_ids(self) -> set[str]:
        """sample_ids with an "ok" row (in this file or a sibling shard file); others are (re)run."""
        return {sid for sid, row in self.latest().items() if row.get("status") == "ok"}

    # -- exclusive use ---------------------------------------------------------------------------
    @property
    def lock_path(self) -> Path:
        return self.path.with_name(f".{self.path.name}.lock")

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold this file's lock (`.{name}.lock`, an OS file lock released when the process dies):
        a second run of the same config into the same results dir waits here, then resumes and
        skips what the first one did. Never two rows for one sample from concurrent runs."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(self.lock_path)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.info("another run is writing %s; waiting for it to finish", self.path)
            lock.acquire()
        try:
            yield
        finally:
            lock.release()

    # -- writing ---------------------------------------------------------------------------------
    def _repair(self) -> None:
        """Before the first append: drop a truncated last line, make sure the file ends with '\\n'."""
        self._repaired = True
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TruncatedRowWarning)
            _, bad_tail = _scan(self.path)
        if bad_tail is not None:
            warnings.warn(
                f"{self.path}: removing incomplete last line before appending",
                TruncatedRowWarning,
                stacklevel=3,
            )
            with open(self.path, "r+b") as f:
                f.truncate(bad_tail)
                f.flush()
                os.fsync(f.fileno())
        with open(self.path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return
            f.seek(-1, os.SEEK_END)
            needs_newline = f.read(1) != b"\n"
        if needs_newline:
            self._write(b"\n")

    def _write(self, data: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)

    def append(self, row: dict) -> None:
        """Append one row as a JSON line, flushed and fsync'ed before returning.

        One whole line per `os.write` on an `O_APPEND` descriptor: a process killed mid-write leaves
        at most a truncated last line, which loading skips with a `TruncatedRowWarning` (so that
        sample is recomputed on resume) and the next `append` cuts off before writing. A malformed
        line anywhere else raises `ValueError("<file>:<line>: ...")` when the file is read.
        """
        if not isinstance(row, dict):
            raise TypeError(f"row must be a dict, got {type(row).__name__}")
        if "sample_id" not in row:
            raise ValueError("row has no 'sample_id'")
        if row.get("status") not in STATUSES:
            raise ValueError(f"row status must be one of {STATUSES}, got {row.get('status')!r}")
        line = json.dumps(row, ensure_ascii=False, default=_json_default) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self._repaired:
            self._repair()
        self._write(line.encode("utf-8"))

    # -- whole results directory -----------------------------------------------------------------
    @staticmethod
    def load_dir(results_dir: str | os.PathLike) -> pd.DataFrame:
        """All rows of all `*.jsonl` files under `results_dir` (recursively), one row per sample and config.

        De-duplicated on (task, model, method_hash, sample_id) -- method_hash taken from the row, else
        from the file name -- keeping the last "ok" row (else the last row), so shard files and
        overlapping reruns merge without duplicates. A sample stored in more than one file is not
        dropped silently: a `DuplicateRowWarning` names how many, and `attrs["duplicates"]` of the
        frame holds them (`duplicate_rows`, as a tuple of records: attrs must compare equal). Columns: `ROW_FIELDS` (missing ones are None),
        any extra fields the rows carry, and `file` (the source file relative to `results_dir`).
        A `*.jsonl` whose first row is an object without `sample_id` (not a results file, e.g.
        LongBench-format predictions exported next to the results) is skipped with a warning.
        """
        results_dir = Path(results_dir)
        if not results_dir.is_dir():
            raise FileNotFoundError(f"results dir not found: {results_dir}")
        rows: list[dict] = []
        for path in sorted(results_dir.rglob("*.jsonl")):
            if not path.is_file():
                continue
            if not _looks_like_results(path):
                warnings.warn(
                    f"{path}: not a results file (first row has no sample_id); skipped", stacklevel=2
                )
                continue
            m = _HASH_RE.search(path.name)
            file_hash = m.group(1) if m else None
            rel = path.relative_to(results_dir).as_posix()
            for row in read_rows(path):
                row = dict(normalize_row(row))
                if row.get("method_hash") is None:
                    row["method_hash"] = file_hash
                row["file"] = rel
                rows.append(row)
        merged = list(latest_rows(rows, key=row_key).values())
        columns = (
            list(ROW_FIELDS) + sorted({k for r in merged for k in r} - set(ROW_FIELDS) - {"file"}) + ["file"]
        )
        out = pd.DataFrame.from_records(merged, columns=columns)
        dups = duplicate_rows(rows)
        if len(dups):
            warnings.warn(
                f"{results_dir}: {len(dups)} samples are stored in more than one results file "
                f"(e.g. {dups['sample_id'].iloc[0]} in {dups['files'].iloc[0]}); the last ok row of each is read",
                DuplicateRowWarning,
                stacklevel=2,
            )
        out.attrs["duplicates"] = tuple(tuple(r) for r in dups.itertuples(index=False))
        return out


def fields_missing(row: dict, fields: Sequence[str] = ROW_FIELDS) -> list[str]:
    """Schema fields absent from `row` (for runner-side checks)."""
    return [f for f in fields if f not in row]
