"""The run spec: one typed, validated description of a run, built from the Hydra config before
anything loads. `RunSpec.from_config(cfg)` raises ValueError naming the bad value for any config
error (the CLI turns it into one line and exit code 2); the runner only ever sees a `RunSpec`.

`method_hash` covers everything in the config that changes a row: the method and its parameters,
`query_aware`, the protocol when it is one of the shared ones (eval/protocols.py), the model's dtype, attention implementation and chat-template switch, the prefill
chunk size (same tokens kept, different memory/timings), with `generation.do_sample` the sampling
settings and the run seed (`GenerationSpec.hash_fields`; nothing when greedy, so greedy configs
keep their hash), and the task's config except its
`selection_keys` (keys that only choose which samples run) and keys at their `hash_defaults`
(`Task.hash_params`), the `kv_quant` storage when it is not none, and with an engine other than transformers its identity (`engine=openvino`:
version, KV block size and precision, eviction config; eval/engines/; nothing for transformers, so
every config keeps its hash). The device is left out, so a run can resume on another machine; the model is
in the file's path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from eval import protocols
from eval.engines import Engine, build_engine
from eval.store import config_hash, model_key, result_path, safe_name
from eval.tasks import Task, build_task, task_class
from snapkv import Sampling, build_method
from snapkv.kv_quant import KVQuant
from snapkv.methods import Method
from snapkv_models.loading import DTYPES

# Task-node keys the runner consumes (job sharding) rather than the task.
RUN_KEYS = ("name", "shard", "num_shards")


def _container(node: Any) -> Any:
    return (
        OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
        if OmegaConf.is_config(node)
        else node
    )


def _int(key: str, value: Any, minimum: int | None = None, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        what = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise ValueError(f"{key} must be {what}{' or null' if allow_none else ''}, got {key}={value!r}")
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {key}={value!r}")
    return value


def sample_seed(seed: int, sample_id: str, index: int) -> int:
    """The seed of sample `index` of the prompt `sample_id` under the run seed `seed`: the first 8
    bytes of sha256("{seed}:{sample_id}:{index}") as an integer < 2**63. It names no method, so
    every method draws sample i of a prompt with the same seed (paired comparisons), and it does not
    depend on how many samples run (`samples_per_prompt` can grow)."""
    digest = hashlib.sha256(f"{seed}:{sample_id}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key} must be a number, got {key}={value!r}")
    return float(value)


@dataclass(frozen=True)
class GenerationSpec:
    """The `generation` node: how tokens are picked (snapkv.generation.Sampling).

    do_sample false (the default): greedy, one output per prompt, rows and config hash as before
    the node existed. do_sample true: `samples_per_prompt` (k) samples per prompt at `temperature`
    and `top_p`, sample i seeded with `sample_seed(seed, sample_id, i)`, all k decoded from one
    prefill + compression (`snapkv.generate_samples`); each sample is its own row.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    samples_per_prompt: int = 1

    @classmethod
    def from_config(cls, node: Any) -> GenerationSpec:
        g = dict(_container(node) or {})
        known = {"do_sample", "temperature", "top_p", "samples_per_prompt"}
        unknown = sorted(set(g) - known)
        if unknown:
            raise ValueError(
                f"unknown generation key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        spec = cls(
            do_sample=_bool("generation.do_sample", g.get("do_sample", False)),
            temperature=_number("generation.temperature", g.get("temperature", 1.0)),
            top_p=_number("generation.top_p", g.get("top_p", 1.0)),
            samples_per_prompt=_int("generation.samples_per_prompt", g.get("samples_per_prompt", 1), 1),
        )
        if spec.do_sample:
            try:
                spec.sampling()
            except ValueError as e:
                raise ValueError(f"generation.{e}") from None
        elif spec.samples_per_prompt > 1:
            raise ValueError(
                "generation.samples_per_prompt > 1 needs generation.do_sample=true (greedy outputs are "
                f"identical), got samples_per_prompt={spec.samples_per_prompt}"
            )
        return spec

    def sampling(self) -> Sampling | None:
        """The sampler of `snapkv.generate` (None: greedy)."""
        return Sampling(self.temperature, self.top_p) if self.do_sample else None

    def hash_fields(self, seed: int) -> dict[str, Any]:
        """What enters the config hash: nothing when greedy; else the sampling settings and the run
        seed (the samples' seeds derive from it). `samples_per_prompt` stays out: it only chooses
        how many samples run, and sample i's seed does not depend on it."""
        if not self.do_sample:
            return {}
        return {
            "generation": {
                "do_sample": True,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "seed": seed,
            }
        }

    def row_fields(self) -> dict[str, Any]:
        """Columns of every sampled row (none when greedy)."""
        return {"temperature": self.temperature, "top_p": self.top_p} if self.do_sample else {}


def kv_quant_from_config(node: Any) -> KVQuant | None:
    """The `kv_quant` node (conf/kv_quant/): None for `kind: none` (or no node), else a validated
    `KVQuant`; ValueError naming an unknown key or a bad value."""
    q = dict(_container(node) or {})
    if q.get("kind", "none") == "none":
        extra = sorted(set(q) - {"kind"})
        if extra:
            raise ValueError(
                f"kv_quant.{extra[0]} needs a quantized storage (kv_quant=kivi|quanto|hqq), got kind=none"
            )
        return None
    known = {f.name for f in dataclasses.fields(KVQuant)}
    unknown = sorted(set(q) - known)
    if unknown:
        raise ValueError(f"unknown kv_quant key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return KVQuant(**q)


@dataclass(frozen=True)
class ModelSpec:
    """The `model` node: what to load and how (`snapkv_models.loading.load_model`)."""

    name: str  # embedded name, local dir, .gguf file, Hub id or random:<shape>
    key: str  # short name: results folder and the rows' `model`
    tokenizer: str | None
    dtype: str
    device: str
    attn_implementation: str
    context: int | None  # trained context length
    chat_template: bool

    @classmethod
    def from_config(cls, node: Any) -> ModelSpec:
        if OmegaConf.is_config(node) and OmegaConf.is_missing(node, "name"):
            raise ValueError("model.name is required (???): set model.name=<local path or Hub id>")
        m = dict(_container(node))
        name = m.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"model.name must be a non-empty string, got model.name={name!r}")
        if m.get("dtype") not in DTYPES:
            raise ValueError(
                f"model.dtype must be one of {sorted(DTYPES)}, got model.dtype={m.get('dtype')!r}"
            )
        attn = m.get("attn_implementation")
        if attn not in ("sdpa", "eager", "flash_attention_2"):
            raise ValueError(
                "model.attn_implementation must be sdpa, eager or flash_attention_2, "
                f"got model.attn_implementation={attn!r}"
            )
        device = str(m.get("device", "cpu"))
        if device not in ("cpu", "auto") and not device.startswith("cuda"):
            raise ValueError(f"model.device must be cpu, cuda, cuda:N or auto, got model.device={device!r}")
        key = m.get("key") or model_key(name)
        if not isinstance(key, str):
            raise ValueError(f"model.key must be a string or null, got model.key={key!r}")
        return cls(
            name=name,
            key=key,
            tokenizer=m.get("tokenizer"),
            dtype=m["dtype"],
            device=device,
            attn_implementation=attn,
            context=_int("model.context", m.get("context"), 1, allow_none=True),
            chat_template=_bool("model.chat_template", m.get("chat_template", True)),
        )


def _check_engine_run(
    engine: Engine, task: Task, protocol: str, generation: GenerationSpec, model: ModelSpec
) -> None:
    """ValueError for what an engine other than transformers does not run: a task that generates
    nothing, a protocol other than query_aware, sampling, a model it cannot read."""
    if not task.generates:
        raise ValueError(
            f"engine={engine.name} runs generating tasks; task {task.name!r} scores given text (use engine=transformers)"
        )
    if protocol != protocols.DEFAULT:
        raise ValueError(
            f"engine={engine.name} feeds each prompt whole (protocol={protocols.DEFAULT}), got protocol={protocol}"
        )
    if generation.do_sample:
        raise ValueError(f"engine={engine.name} decodes greedily, got generation.do_sample=true")
    engine.check_model(model.name)


@dataclass(frozen=True)
class RunSpec:
    """Everything one run needs, validated; built by `from_config` before any model loads."""

    task: Task
    task_config: dict[str, Any]  # the task node minus RUN_KEYS (as configured; hashed minus selection keys)
    method: Method
    model: ModelSpec
    results_dir: Path
    query_aware: bool = True  # the compression sees a question (protocols.QUESTION_IN_WINDOW)
    protocol: str = protocols.DEFAULT  # eval/protocols.py
    seed: int = 42
    chunk_size: int | None = None
    shard: int = 0
    num_shards: int = 1
    progress: bool = True
    report: bool = True
    generation: GenerationSpec = GenerationSpec()
    kv_quant: KVQuant | None = None  # how the kept entries are stored (None: the model's dtype)
    engine: Engine | None = None  # None: transformers (eval/engines/)

    @classmethod
    def from_config(cls, cfg: DictConfig | dict) -> RunSpec:
        """Validate `cfg` (conf/config.yaml composed); ValueError naming the first bad value."""
        cfg = OmegaConf.create(_container(cfg)) if not OmegaConf.is_config(cfg) else cfg
        task_node = dict(_container(cfg.task))
        name = task_node.get("name")
        task_class(name)  # unknown task: ValueError listing the known ones
        shard_i = _int("task.shard", task_node.get("shard", 0))
        num_shards = _int("task.num_shards", task_node.get("num_shards", 1))
        if num_shards < 1 or not 0 <= shard_i < num_shards:
            raise ValueError(
                f"task.shard must satisfy 0 <= shard < num_shards, got shard={shard_i}, num_shards={num_shards}"
            )
        task_config = {k: v for k, v in task_node.items() if k not in RUN_KEYS}
        task = build_task(name, **task_config)
        method = build_method(**_container(cfg.method))
        prefill = cfg.get("prefill") or {}
        protocol, query_aware = protocols.resolve(cfg.get("protocol"), cfg.get("query_aware", True))
        if protocol in protocols.SHARED and not task.multi_question():
            raise ValueError(
                f"protocol={protocol} asks several questions per context, but task {name!r} as configured "
                "asks one (Task.multi_question() is false); use protocol=query_aware or context_only"
            )
        generation = GenerationSpec.from_config(cfg.get("generation"))
        if generation.do_sample and not task.generates:
            raise ValueError(
                f"generation.do_sample=true samples answers, but task {name!r} generates none (it scores "
                "given text); use generation.do_sample=false"
            )
        if generation.do_sample and protocol in protocols.SHARED:
            raise ValueError(
                f"generation.do_sample=true runs protocol=query_aware or context_only, got protocol={protocol}"
            )
        kv_quant = kv_quant_from_config(cfg.get("kv_quant"))
        if kv_quant is not None:
            kv_quant.check_available()
            kv_quant.check_method(method)
            if not task.generates:
                raise ValueError(
                    f"kv_quant={kv_quant.kind} is not supported with task {name!r}, which scores given "
                    "text through its own passes; use kv_quant=none"
                )
        chunk_size = _int("prefill.chunk_size", prefill.get("chunk_size"), 1, allow_none=True)
        engine = build_engine(_container(cfg.get("engine")), method, chunk_size)
        model = ModelSpec.from_config(cfg.model)
        if engine is not None:
            _check_engine_run(engine, task, protocol, generation, model)
        if engine is not None and kv_quant is not None:
            raise ValueError(
                f"kv_quant={kv_quant.kind} is not supported with engine={engine.name}: the engine stores its "
                "KV cache at its own precision (engine options); use kv_quant=none"
            )
        results_dir = cfg.get("results_dir")
        if not isinstance(results_dir, str) or not results_dir.strip():
            raise ValueError(f"results_dir must be a path, got results_dir={results_dir!r}")
        return cls(
            task=task,
            task_config=task_config,
            method=method,
            model=model,
            results_dir=Path(results_dir).expanduser(),
            query_aware=query_aware,
            protocol=protocol,
            seed=_int("seed", cfg.get("seed", 42)),
            chunk_size=chunk_size,
            shard=shard_i,
            num_shards=num_shards,
            progress=_bool("progress", cfg.get("progress", True)),
            report=_bool("report", cfg.get("report", True)),
            generation=generation,
            kv_quant=kv_quant,
            engine=engine,
        )

    # ---- derived
    @property
    def method_hash(self) -> str:
        """Config hash of everything that changes one sample's output (see the module docstring)."""
        task_params = self.task.hash_params(self.task_config)
        return config_hash(
            {
                "method": self.method.name,
                "method_params": self.method.params(),
                "query_aware": self.query_aware,
                "task": {"name": self.task.name, "version": self.task.version, **task_params},
                "model": {
                    "dtype": self.model.dtype,
                    "attn_implementation": self.model.attn_implementation,
                    "chat_template": self.model.chat_template,
                },
                "prefill_chunk_size": self.chunk_size,
                **protocols.hash_fields(self.protocol),
                **self.generation.hash_fields(self.seed),
                # nothing without quantized storage: every earlier config keeps its hash
                **({"kv_quant": self.kv_quant.to_dict()} if self.kv_quant is not None else {}),
                **({"engine": self.engine.identity()} if self.engine is not None else {}),
            }
        )

    @property
    def result_path(self) -> Path:
        return result_path(
            self.results_dir, self.task.name, self.model.key, self.method.name, self.method_hash,
            self.shard, self.num_shards,
        )  # fmt: skip

    @property
    def legacy_result_paths(self) -> list[Path]:
        """Where older versions wrote this config's rows (the folder was the full model name)."""
        if safe_name(self.model.name) == safe_name(self.model.key):
            return []
        return [
            result_path(
                self.results_dir, self.task.name, self.model.name, self.method.name, self.method_hash,
                self.shard, self.num_shards,
            )
        ]  # fmt: skip

    def check_results_dir(self) -> None:
        """ValueError when results_dir (or the first of its parents that exists) is a file, or when
        a file cannot be created in it (tried for real: root ignores permission bits). Folders
        created for the probe are removed again, so a run that fails later leaves nothing behind."""
        d = self.results_dir
        existing = next(p for p in (d, *d.parents) if p.exists())
        if not existing.is_dir():
            raise ValueError(f"results_dir={str(d)!r} is not usable: {str(existing)!r} is a file")
        created = [p for p in (d, *d.parents) if not p.exists()]
        try:
            d.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=d, prefix=".write-probe-"):
                pass
        except OSError as e:
            raise ValueError(
                f"results_dir={str(d)!r} is not writable: {e.strerror or e} ({type(e).__name__})"
            ) from None
        finally:
            for p in created:  # deepest first
                with contextlib.suppress(OSError):
                    p.rmdir()
