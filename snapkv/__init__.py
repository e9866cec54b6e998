"""snapkv-bench's library: KV-cache compression (SnapKV, PyramidKV, Ada-KV, ChunkKV, CriticalKV,
Expected Attention, TOVA, KNorm, H2O, StreamingLLM, full) inside unmodified HuggingFace transformers
models, plus generation with timing and memory probes."""

import snapkv.compat  # noqa: F401  (first: a transformers outside the supported range fails here)
from snapkv.cache import CacheMark, CompressedCache, CompressibleLayer
from snapkv.forward import prefill
from snapkv.generation import (
    Answer,
    Compressed,
    Decoded,
    GenerationConfig,
    GenerationResult,
    ProgressCallback,
    answer,
    compress,
    compress_context,
    decode,
    generate,
    generate_ids,
    generate_samples,
    sample_ids,
    teacher_force,
)
from snapkv.headwise import HeadwiseLayer
from snapkv.hooks import apply, hooks_installed, session
from snapkv.methods import METHODS, Method, build_method, register
from snapkv.prompts import stop_token_ids
from snapkv.sampling import Sampling

__all__ = [
    "METHODS",
    "Answer",
    "CacheMark",
    "CompressedCache",
    "CompressibleLayer",
    "Compressed",
    "Decoded",
    "GenerationConfig",
    "GenerationResult",
    "HeadwiseLayer",
    "Method",
    "ProgressCallback",
    "Sampling",
    "answer",
    "apply",
    "build_method",
    "compress",
    "compress_context",
    "decode",
    "generate",
    "generate_ids",
    "generate_samples",
    "hooks_installed",
    "prefill",
    "sample_ids",
    "register",
    "session",
    "stop_token_ids",
    "teacher_force",
]
