"""Compression methods, registered by name. Adding one: a file here with a `@register`ed dataclass
subclass of `Method` (its hyper-parameters as fields, a `score()`), plus `conf/method/<name>.yaml`."""

from snapkv.methods import (  # noqa: F401  (registration)
    adakv,
    chunkkv,
    criticalkv,
    expected_attention,
    full,
    h2o,
    knorm,
    kvzip,
    pyramidkv,
    rkv,
    snapkv,
    snapkv_d,
    streamingllm,
    tova,
)
from snapkv.methods.base import Method, check_model_generate, post_init_from_tokenizer
from snapkv.methods.registry import METHODS, build_method, register

__all__ = [
    "METHODS",
    "Method",
    "build_method",
    "check_model_generate",
    "post_init_from_tokenizer",
    "register",
]
