"""`load_model`, the library's documented entry point for models: `from snapkv.models import load_model`.

Model acquisition (embedded models fetched from PyPI wheels, the Hub probe, GGUF de-quantization,
random-weight shapes) lives in the sibling package `snapkv_models`, installed with the library;
this module only re-exports its loader, and is the one module of `snapkv/` that imports
`snapkv_models` (`.importlinter` holds it).
"""

from __future__ import annotations

from snapkv_models.loading import load_model

__all__ = ["load_model"]
