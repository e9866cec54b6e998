"""Every transformers-version difference the harness depends on, in one place.

Supported: transformers `SUPPORTED_MIN` <= version < `SUPPORTED_BELOW` (both ends are tested by
`make test-compat`; CI runs the upper end). Importing `snapkv` with a version outside that range
raises an `ImportError` that names the range: a silent wrong result is worse than no result.

What differs inside the range, and the shim for it:
- `layer_types(config)`: transformers >= 5.14 derives cache layer types with
  `cache_utils.get_layer_types_and_kwargs`; before, `DynamicCache.__init__` inferred them inline
  from `config.layer_types` / `sliding_window` / `attention_chunk_size` (and dropped the
  `num_kv_shared_layers` last layers, Gemma 3n): `legacy_layer_types` is that code, verbatim.
- `query_length(arg)`: a cache layer's `get_mask_sizes` receives the query count from 5.4 on and
  `cache_position` (`[q]`) in 5.2-5.3.
- the forward kwarg that takes the cache (`cache` from 5.24, `past_key_values` before; 5.23 and
  older silently ignore `cache=`): `snapkv.forward.cache_kwarg` reads the model's signature.
"""

from __future__ import annotations

import re

import torch
import transformers

SUPPORTED_MIN = "5.2.0"
SUPPORTED_BELOW = "5.25"  # exclusive: the newest release tested is 5.24.x
SUPPORTED_RANGE = f">={SUPPORTED_MIN},<{SUPPORTED_BELOW}"


def _parse(version: str) -> tuple[int, ...]:
    """`"5.24.0"` -> (5, 24, 0); pre/dev/local suffixes count as the release they precede
    (`"5.25.0.dev0"` -> (5, 25, 0): a 5.25 development build is outside `<5.25`)."""
    parts = re.match(r"\d+(?:\.\d+)*", version)
    if parts is None:
        raise ValueError(f"cannot parse a version number from {version!r}")
    nums = tuple(int(p) for p in parts.group(0).split("."))
    return nums + (0,) * (3 - len(nums))


def check_transformers_version(version: str | None = None) -> None:
    """Raise `ImportError` naming the supported range if `version` (default: the installed
    transformers) lies outside it."""
    version = transformers.__version__ if version is None else version
    if not _parse(SUPPORTED_MIN) <= _parse(version) < _parse(SUPPORTED_BELOW):
        raise ImportError(
            f"snapkv-bench supports transformers {SUPPORTED_RANGE}, found transformers {version}; "
            f'install a supported version, e.g. pip install "transformers{SUPPORTED_RANGE}"'
        )


check_transformers_version()


def layer_types(config) -> list[str]:
    """Cache layer type per decoder layer (`"full_attention"`, `"sliding_attention"`, ...), as the
    installed transformers' `DynamicCache(config=...)` assigns them.

    `config`: a model config (its decoder text config is used).
    """
    config = config.get_text_config(decoder=True)
    try:  # a version probe, so it stays here: the function exists from transformers 5.14 on
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # transformers < 5.14
        return legacy_layer_types(config)
    return list(get_layer_types_and_kwargs(config)[0])


def legacy_layer_types(config) -> list[str]:
    """`DynamicCache.__init__`'s layer typing in transformers 5.2-5.13 (`config`: the decoder text
    config)."""
    sliding = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        kind = "sliding_attention" if sliding is not None else "full_attention"
        types = [kind] * config.num_hidden_layers
    if hasattr(config, "num_kv_shared_layers"):
        types = types[: -config.num_kv_shared_layers]
    return list(types)


def query_length(arg: int | torch.Tensor) -> int:
    """The query count a cache layer's `get_mask_sizes(arg)` is asked about: transformers >= 5.4
    passes it as an int, 5.2-5.3 pass `cache_position` (`[q]`, one position per query)."""
    return arg.shape[0] if isinstance(arg, torch.Tensor) else arg
