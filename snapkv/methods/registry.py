"""Methods by name: `build_method("snapkv", budget=512)`."""

from __future__ import annotations

from typing import Any

METHODS: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: register a `Method` subclass under its `name` (ValueError for a class that is
    not a Method, or a name another class already has)."""
    # Here, not at the top: the registry stays a leaf module that base and every method file can
    # import without a cycle.
    from snapkv.methods.base import Method

    if not (isinstance(cls, type) and issubclass(cls, Method)):
        raise ValueError(f"cannot register {cls!r}: it is not a subclass of snapkv.methods.base.Method")
    old = METHODS.get(cls.name)
    if old is not None and old is not cls:
        raise ValueError(
            f"method name {cls.name!r} is already registered by {old.__module__}.{old.__qualname__}; "
            f"cannot register {cls.__module__}.{cls.__qualname__} under it"
        )
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
