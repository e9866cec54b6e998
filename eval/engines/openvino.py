"""`engine=openvino`: OpenVINO GenAI's `ContinuousBatchingPipeline` (paged KV cache, block-granular
eviction) runs the samples, with the harness' prompts, stop tokens and scorers (eval/engines/base.py).

Methods map onto the engine's `CacheEvictionConfig` (docs/engines.md has the table):

- `full`: no eviction.
- `snapkv`: `snapkv_window_size = window` (the last `window` prompt tokens' attention initialises
  the scores), `recent_size = window`, `max_cache_size = budget`, `start_size` one block (the
  engine needs a start area; `engine.start_size` sets it), aggregation NORM_SUM (the engine's
  default).
- `h2o`: `snapkv_window_size = 0` (every prompt query's attention accumulates, as H2O's),
  `recent_size = recent`, `max_cache_size = budget`, aggregation SUM (H2O's accumulated attention).

What the engine does differently, whatever the mapping: it keeps whole blocks of `kv_block_size`
tokens (32 on CPU) chosen per layer for all heads at once (the harness keeps entries per KV head);
its max-pool over 7 positions looks forward from each position (the harness' kernel is centred);
it evicts after the prefill's first token and then after every decode step once the cache has
grown a block past `max_cache_size` (SnapKV compresses once, at the end of prefill); and it keeps
scoring while decoding (`aggregation`). Every size must be a whole number of blocks; a method,
parameter or option the engine cannot express is a ValueError naming it, before anything loads.

`build_pipeline` builds a pipeline from a model name and scheduler / eviction settings, the one
place they become a `SchedulerConfig` and `CacheEvictionConfig`: `OpenVINOEngine` (the harness'
adapter) and the serving benchmark (`eval.bench.serving`, a fixed pool of KV blocks) build theirs
with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from eval.engines.base import Engine, EngineOutput
from eval.engines.gguf_files import rewrite_f16, tensor_types
from snapkv.methods import Method
from snapkv_models.embedded import EMBEDDED, fetch_embedded, model_dir
from snapkv_models.paths import cache_root

DISTRIBUTION = "openvino-genai"
INSTALL = "pip install -e '.[openvino]' (openvino-genai==2026.4.1.0)"
# Tokens per KV block (openvino.genai src/cpp/src/continuous_batching/cache/kv_cache_manager.hpp).
KV_BLOCK_SIZE = {"CPU": 32, "GPU": 16}
# Tensor types the engine's GGUF reader loads; any other file is rewritten as F16 first.
GGUF_TYPES = {"F32", "F16", "Q8_0", "Q4_0", "Q4_1"}
# How a GGUF's weights reach the engine (`weights`): "f16", any quantized file rewritten as F16 (the
# values transformers de-quantizes, rounded once to f16: on SmolLM2's Q4_1 file the engine's greedy
# tokens then equal the harness'); "file", a file the reader loads as it is (its quantized tensors
# go through the engine's own kernels: on the same file and prompts, greedy text diverged from the
# harness' within 8 tokens, the harness' logit margin there 1.5-1.9).
WEIGHTS = ("f16", "file")
PLAIN_TYPES = {"F32", "F16"}
AGGREGATIONS = ("sum", "norm_sum", "adaptive_rkv")
# Releases whose Adaptive R-KV eviction fails on CPU with any prompt longer than the budget (tried:
# SmolLM2 GGUF and a tiny Llama, block-aligned or not, chunked prefill or not, f32 or u8 KV).
ADAPTIVE_RKV_BROKEN = ("2026.4.1.0",)
KVCRUSH_ANCHORS = ("random", "zeros", "ones", "mean", "alternating")
PRECISIONS = ("f32", "f16", "bf16", "u8", "u4")
# Per method: the engine's default aggregation and the fields the mapping reads (every other field
# must be at the method's default, which the engine's own algorithm stands for).
METHODS = {
    "full": (None, ()),
    "snapkv": ("norm_sum", ("budget", "window")),
    "h2o": ("sum", ("budget", "recent", "recent_ratio")),
}


def installed() -> bool:
    return importlib.util.find_spec("openvino_genai") is not None


def version() -> str:
    return importlib.metadata.version(DISTRIBUTION)


def require() -> None:
    """ValueError saying how to install the engine when openvino_genai is missing."""
    if not installed():
        raise ValueError(f"engine=openvino needs openvino_genai, which is not installed: {INSTALL}")


# --------------------------------------------------------------------------------------- models
def _readable(gguf: Path, weights: str = "f16") -> bool:
    return tensor_types(gguf) <= (PLAIN_TYPES if weights == "f16" else GGUF_TYPES)


def _converted(gguf: Path, folder: Path, weights: str = "f16") -> Path:
    """`gguf` as the engine is given it (`WEIGHTS`): itself, or its F16 rewrite cached in `folder`."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got weights={weights!r}")
    if _readable(gguf, weights):
        return gguf
    target = folder / f"{gguf.stem}.f16.gguf"
    if not target.is_file():
        rewrite_f16(gguf, target)
    return target


def check_model(name: str) -> None:
    """ValueError (before anything loads) for a model the engine cannot be given: it reads GGUF
    files (an embedded model's, a local .gguf) and OpenVINO IR folders."""
    if name in EMBEDDED:
        return
    path = Path(name).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return
    if path.is_dir() and (path / "openvino_model.xml").is_file():
        return
    raise ValueError(
        f"engine=openvino reads an embedded model ({', '.join(sorted(EMBEDDED))}), a .gguf file or an "
        f"OpenVINO IR folder (openvino_model.xml), got model.name={name!r}"
    )


def model_path(name: str, weights: str = "f16") -> Path:
    """What the engine loads for the model `name` (`check_model`): an embedded model's GGUF as it
    is when it holds only F32 / F16 tensors (`weights="file"`: any tensor type the engine reads),
    else its F16 rewrite cached beside it (`{cache}/models/<name>/openvino/`); a local .gguf
    likewise (rewrite in `{cache}/openvino/<sha of its path, size, mtime>/`); an IR folder as it is."""
    check_model(name)
    if name in EMBEDDED:
        return _converted(fetch_embedded(name), model_dir(name) / "openvino", weights)
    path = Path(name).expanduser().resolve()
    if path.is_dir():
        return path
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return _converted(path, cache_root() / "openvino" / key, weights)


# ------------------------------------------------------------------------------------- pipeline
def eviction_config(eviction: dict[str, Any]):
    """An `openvino_genai.CacheEvictionConfig` from an eviction dict (`OpenVINOEngine.eviction`'s,
    or a benchmark's): start_size, recent_size, max_cache_size, aggregation and snapkv_window_size;
    apply_rotation (default False), kvcrush (blocks, default 0: off) and kvcrush_anchor optional."""
    import openvino_genai as ov_genai

    kvcrush = None
    if eviction.get("kvcrush", 0):
        anchor = getattr(ov_genai.KVCrushAnchorPointMode, eviction.get("kvcrush_anchor", "random").upper())
        kvcrush = ov_genai.KVCrushConfig(eviction["kvcrush"], anchor)
    return ov_genai.CacheEvictionConfig(
        start_size=eviction["start_size"],
        recent_size=eviction["recent_size"],
        max_cache_size=eviction["max_cache_size"],
        aggregation_mode=getattr(ov_genai.AggregationMode, eviction["aggregation"].upper()),
        apply_rotation=eviction.get("apply_rotation", False),
        snapkv_window_size=eviction["snapkv_window_size"],
        kvcrush_config=kvcrush,
    )


def build_pipeline(
    model: str,
    *,
    eviction: dict[str, Any] | None = None,
    device: str = "CPU",
    kv_cache_precision: str | None = "f32",
    inference_precision: str | None = "f32",
    cache_size_gb: int = 1,
    num_kv_blocks: int | None = None,
    max_num_seqs: int = 1,
    max_num_batched_tokens: int | None = None,
    enable_prefix_caching: bool = False,
    threads: int | None = None,
    weights: str = "f16",
):
    """A `ContinuousBatchingPipeline` for the model `model` (an embedded name, a .gguf file or an
    OpenVINO IR folder: `model_path`), its KV pool `cache_size_gb` GB, or `num_kv_blocks` blocks
    when given (a serving benchmark's fixed pool), in `kv_cache_precision`. The one place a
    pipeline's `SchedulerConfig` and `CacheEvictionConfig` are written: the harness' adapter and
    the serving benchmark (`eval.bench.serving`) both build theirs here.

    eviction: None (full cache) or `eviction_config`'s dict. kv_cache_precision /
    inference_precision: None leaves the device plugin's default (on CPU: a u8 KV cache, bf16 or
    f32 inference by the CPU's features). max_num_seqs: requests scheduled at once.
    max_num_batched_tokens: tokens one step may process (None: a whole prompt in one step, no
    chunked prefill); dynamic split-fuse is on. enable_prefix_caching: off, a finished request frees
    its blocks. threads: the CPU plugin's INFERENCE_NUM_THREADS (None: the plugin's choice).
    weights: how a GGUF's weights reach the engine (`WEIGHTS`)."""
    require()
    import openvino_genai as ov_genai

    sched = ov_genai.SchedulerConfig()
    if num_kv_blocks is not None:
        sched.num_kv_blocks = num_kv_blocks
    else:
        sched.cache_size = cache_size_gb
    sched.max_num_seqs = max_num_seqs
    sched.dynamic_split_fuse = True
    sched.max_num_batched_tokens = max_num_batched_tokens or 2**31 - 1
    sched.enable_prefix_caching = enable_prefix_caching
    if eviction is not None:
        sched.use_cache_eviction = True
        sched.cache_eviction_config = eviction_config(eviction)
    props: dict[str, Any] = {}
    if kv_cache_precision is not None:
        props["KV_CACHE_PRECISION"] = kv_cache_precision
    if inference_precision is not None:
        props["INFERENCE_PRECISION_HINT"] = inference_precision
    if threads is not None:
        props["INFERENCE_NUM_THREADS"] = threads
    return ov_genai.ContinuousBatchingPipeline(str(model_path(model, weights)), sched, device, props)


# -------------------------------------------------------------------------------------- adapter
def _blocks(tokens: int, block: int) -> int:
    return -(-tokens // block)


@dataclass
class OpenVINOEngine(Engine):
    """conf/engine/openvino.yaml's options (every key a field; see its comments)."""

    name: ClassVar[str] = "openvino"
    install: ClassVar[str] = INSTALL

    device: str = "CPU"
    kv_cache_precision: str = "f32"
    inference_precision: str = "f32"
    aggregation: str | None = None
    start_size: int | None = None
    apply_rotation: bool = False
    kvcrush: int = 0
    kvcrush_anchor: str = "random"
    cache_size_gb: int = 1
    threads: int | None = None
    weights: str = "f16"
    prefill_chunk: int | None = dataclasses.field(default=None, init=False, repr=False)
    method_name: str = dataclasses.field(default="full", init=False)
    eviction: dict[str, Any] | None = dataclasses.field(default=None, init=False)
    pipeline: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(key: str, rule: str) -> ValueError:
            return ValueError(f"engine.{key} must be {rule}, got engine.{key}={getattr(self, key)!r}")

        if self.device not in KV_BLOCK_SIZE:
            raise bad("device", " or ".join(KV_BLOCK_SIZE))
        for key in ("kv_cache_precision", "inference_precision"):
            if getattr(self, key) not in PRECISIONS:
                raise bad(key, "one of " + ", ".join(PRECISIONS))
        if self.aggregation is not None and self.aggregation not in AGGREGATIONS:
            raise bad("aggregation", "null or one of " + ", ".join(AGGREGATIONS))
        if self.weights not in WEIGHTS:
            raise bad("weights", "one of " + ", ".join(WEIGHTS))
        if self.kvcrush_anchor not in KVCRUSH_ANCHORS:
            raise bad("kvcrush_anchor", "one of " + ", ".join(KVCRUSH_ANCHORS))
        for key, low in (("kvcrush", 0), ("cache_size_gb", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise bad(key, f"an integer >= {low}")
        for key in ("start_size", "threads"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise bad(key, "a positive integer or null")
        if not isinstance(self.apply_rotation, bool):
            raise bad("apply_rotation", "true or false")

    @property
    def block_size(self) -> int:
        return KV_BLOCK_SIZE[self.device]

    def check_model(self, name: str) -> None:
        check_model(name)

    def configure(self, method: Method, chunk_size: int | None = None) -> None:
        """Map `method` onto the engine (the module doc); ValueError naming what it cannot express.
        `chunk_size` (the run's `prefill.chunk_size`) becomes the tokens one step may process."""
        require()
        if method.name not in METHODS:
            raise ValueError(f"engine=openvino cannot run method={method.name}; it runs {', '.join(METHODS)}")
        aggregation, mapped = METHODS[method.name]
        defaults = type(method)().params()
        for key, value in method.params().items():
            if key not in mapped and value != defaults.get(key):
                raise ValueError(
                    f"engine=openvino cannot express {method.name}'s {key}={value!r} (it maps "
                    f"{', '.join(mapped) or 'no parameter'}; the rest must stay at their defaults)"
                )
        self.method_name, self.prefill_chunk = method.name, chunk_size
        if aggregation is None:
            for key, off in (
                ("aggregation", None),
                ("start_size", None),
                ("apply_rotation", False),
                ("kvcrush", 0),
            ):
                if getattr(self, key) != off:
                    raise ValueError(
                        f"engine.{key}={getattr(self, key)!r} sets the engine's eviction, which "
                        f"method={method.name} does not use; evicting methods: "
                        + ", ".join(m for m, (a, _) in METHODS.items() if a)
                    )
            self.eviction = None
            return
        aggregation = self.aggregation or aggregation
        if aggregation == "adaptive_rkv" and self.kvcrush:
            raise ValueError(
                f"engine.kvcrush={self.kvcrush} cannot be used with engine.aggregation=adaptive_rkv"
            )
        if aggregation == "adaptive_rkv" and version() in ADAPTIVE_RKV_BROKEN:
            # Every sample would fail at its first eviction: refused before anything loads.
            raise ValueError(
                f"engine.aggregation=adaptive_rkv stops at the first eviction in openvino-genai {version()} "
                "on CPU (its check 'num_diversity_values_registered == num_expected_diversity_values' or "
                "'Token diversity must be registered'); use sum or norm_sum"
            )
        if method.name == "snapkv":
            recent, window = method.window, method.window
        else:  # h2o: its recent tokens, every prompt query scoring
            recent, window = method.n_recent, 0
        sizes = {
            "start_size": self.start_size or self.block_size,
            "recent_size": recent,
            "max_cache_size": method.budget,
        }
        names = {
            "start_size": "engine.start_size",
            "recent_size": "recent tokens",
            "max_cache_size": "budget",
        }
        if method.name == "snapkv":
            names["recent_size"] = "method.window"
        for key, value in sizes.items():
            if value % self.block_size:
                raise ValueError(
                    f"engine=openvino keeps whole blocks of {self.block_size} tokens: {names[key]} must be "
                    f"a multiple of {self.block_size}, got {names[key]}={value}"
                )
        if sizes["max_cache_size"] <= sizes["start_size"] + sizes["recent_size"]:
            raise ValueError(
                f"engine=openvino needs budget > start + recent tokens, got budget={method.budget}, "
                f"start {sizes['start_size']} ({names['start_size']}), recent {sizes['recent_size']}"
            )
        self.eviction = {
            **sizes,
            "aggregation": aggregation,
            "snapkv_window_size": window,
            "apply_rotation": self.apply_rotation,
            "kvcrush": self.kvcrush,
            "kvcrush_anchor": self.kvcrush_anchor,
        }

    def identity(self) -> dict[str, Any]:
        """What a row's output depends on beyond the method and the prompt (hashed, in every row)."""
        return {
            "engine": self.name,
            "version": version(),
            "device": self.device,
            "kv_block_size": self.block_size,
            "kv_cache_precision": self.kv_cache_precision,
            "inference_precision": self.inference_precision,
            "weights": self.weights,
            "eviction": self.eviction,
        }

    def load(self, model_name: str) -> dict[str, Any]:
        self.pipeline = build_pipeline(
            model_name,
            eviction=self.eviction,
            device=self.device,
            kv_cache_precision=self.kv_cache_precision,
            inference_precision=self.inference_precision,
            cache_size_gb=self.cache_size_gb,
            max_num_batched_tokens=self.prefill_chunk,
            threads=self.threads,
            weights=self.weights,
        )
        return {"attn_impl": f"openvino-paged-{self.device.lower()}", "device": self.device.lower()}

    def generate(self, ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> EngineOutput:
        """One greedy request, stepped to the end (`ContinuousBatchingPipeline.step`) so that the KV
        blocks it holds can be read after every step (the pipeline's `cache_usage`, scaled by the
        prompt's blocks after the prefill step). Timings are this process's clock around steps."""
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai

        config = ov_genai.GenerationConfig()
        config.max_new_tokens = max_new_tokens
        config.do_sample = False
        if stop_ids:
            config.stop_token_ids = set(stop_ids)
        else:
            config.ignore_eos = True
        handle = self.pipeline.add_request(0, ov.Tensor(np.asarray([ids], dtype=np.int64)), config)
        steps, usage = [], []
        while self.pipeline.has_non_finished_requests():
            t = time.perf_counter()
            self.pipeline.step()
            steps.append(time.perf_counter() - t)
            usage.append(self.pipeline.get_metrics().cache_usage)
        (output,) = handle.read_all()
        new = list(output.generated_ids)
        # One sequence: the prompt takes the steps before the last len(new) - 1 decode steps.
        prompt_steps = max(1, len(steps) - max(len(new) - 1, 0))
        prompt_blocks = _blocks(len(ids), self.block_size)
        per_block = usage[prompt_steps - 1] / prompt_blocks if usage[prompt_steps - 1] else 0.0
        blocks = [round(u / per_block) if per_block else 0 for u in usage]
        decode = steps[prompt_steps:]
        stopped = output.finish_reason == ov_genai.GenerationFinishReason.STOP
        fields = {
            "prefill_s": sum(steps[:prompt_steps]),
            "ttft_s": sum(steps[:prompt_steps]),
            "tpot_s": statistics.median(decode) if decode else None,
            "e2e_s": sum(steps),
            "new_tokens": len(new),
            "stop_reason": "eos" if stopped else "length",
            "compressed": any(b < a for a, b in zip(blocks, blocks[1:])),
            "engine_kv_blocks": blocks,
            "engine_kv_blocks_peak": max(blocks, default=0),
            "engine_kv_blocks_end": blocks[-1] if blocks else 0,
        }
        return EngineOutput(new, fields["stop_reason"], fields)
