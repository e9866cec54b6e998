"""Engines that run a generating task's samples (`engine=<name>`, conf/engine/): `transformers`
(the default: the harness' own path, `snapkv.generate`, where every method runs) or an adapter
around another inference engine (`eval.engines.base.Engine`: `openvino`). docs/engines.md says
how the methods map and how to add an engine.

`build_engine(node, method, chunk_size)` validates the `engine` node before anything loads: None
for transformers (rows and config hashes exactly as before the node existed), else the configured
adapter, whose `identity()` joins every row and the config hash.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from eval.engines.base import Engine, EngineOutput, generate_text
from snapkv.methods import Method

__all__ = ["ENGINES", "Engine", "EngineOutput", "build_engine", "generate_text"]

DEFAULT = "transformers"
# name -> "module:Class" of its adapter (imported on first use); the default has none.
ENGINES: dict[str, str | None] = {"transformers": None, "openvino": "eval.engines.openvino:OpenVINOEngine"}


def engine_class(name: str) -> type[Engine]:
    module, _, cls = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def build_engine(node: dict[str, Any] | None, method: Method, chunk_size: int | None = None) -> Engine | None:
    """The `engine` config node validated against the run's method: None for transformers, else
    the adapter configured for `method`. ValueError naming an unknown engine or key, a bad value,
    or a method / option the engine cannot express."""
    node = dict(node or {})
    name = node.pop("name", DEFAULT)
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    if ENGINES[name] is None:
        if node:
            raise ValueError(f"engine={name} takes no options, got engine.{sorted(node)[0]}")
        return None
    cls = engine_class(name)
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(node) - set(known))
    if unknown:
        raise ValueError(
            f"unknown engine key(s) {', '.join(unknown)} of engine={name}; known: {', '.join(known)}"
        )
    engine = cls(**node)
    engine.configure(method, chunk_size)
    return engine
