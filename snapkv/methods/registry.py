"""Methods by name: `build_method("snapkv", budget=512)`."""

from __future__ import annotations

from typing import Any

METHODS: dict[str, type] = {}


def register(cls: type) -> type:
    METHODS[cls.name] = cls
    return cls


def build_method(name: str, **params: Any):
    """Instantiate a registered method, validating its parameters (ValueError names the bad one)."""
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(sorted(METHODS))}")
    cls = METHODS[name]
    fields = {f for f in cls.__dataclass_fields__}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"unknown parameter(s) {unknown} for method {name!r}; it takes {sorted(fields)}")
    return cls(**params)
