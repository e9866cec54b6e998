"""The one cache-root lookup: where downloads (embedded models, haystacks, LongBench data) are kept."""

from __future__ import annotations

import os
from pathlib import Path

ENV_CACHE_ROOT = "SNAPKV_BENCH_CACHE"


def cache_root() -> Path:
    """`$SNAPKV_BENCH_CACHE` (`~` expanded; unset or empty: `~/.cache/snapkv-bench`)."""
    env = os.environ.get(ENV_CACHE_ROOT, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "snapkv-bench"
