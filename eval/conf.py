"""The one place that finds the Hydra configs (`conf/` of this checkout), lists or loads the
options of a config group (`conf/<group>/<name>.yaml`), and generates the method configs' fields.

A method's config file sets only what differs from its dataclass (`budget: ${budget}`, mostly);
every other field comes from `method_fields(cls)`, registered in Hydra's ConfigStore as
`method_fields_<name>` (`register_method_configs`, called by the `hydra_plugins.snapkv_bench`
plugin, so every Hydra app and `compose` of this checkout has them) and extended by the file's
defaults list. Every field is thereby in the composed config: `method.window=16` needs no `+`,
and a typo (`method.windw=16`) is refused by Hydra's struct mode (run.py refuses it first, in one
line naming the keys there are: `missing_key`).
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

# Absolute, so that entry points also work when imported (tests) or started from another directory.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
# ConfigStore name of a method's generated fields (`- /method_fields_<name>@_here_` in its file).
FIELDS_CONFIG = "method_fields_{}"


def options(group: str) -> list[str]:
    """The option names of a config group, sorted: `options("method")` -> ["adakv", ...]."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def is_group(name: str) -> bool:
    """Whether a command-line `name=value` chooses a config group option (`method=full`,
    `hydra/launcher=joblib`) rather than setting a key: a folder of conf/, or a path of groups."""
    return "/" in name or (CONF_DIR / name).is_dir()


def missing_key(cfg: DictConfig, key: str) -> tuple[str, list[str]] | None:
    """Where the dotted `key` leaves the composed config `cfg` as Hydra's struct mode refuses an
    override: `(parent, the keys parent has)` for the first part a struct dict lacks (`method.nope`
    -> `("method", ["budget", ...])`, `nope` -> `("", [top-level keys])`), else None. A path that runs
    into anything else (a list, a value, a dict open to new keys) is None: Hydra decides there.
    Nothing is resolved on the way (interpolations, `???` values)."""
    node, path = cfg, []
    for part in key.split("."):
        if not isinstance(node, DictConfig) or not OmegaConf.is_struct(node):
            return None
        children = dict(node.items_ex(resolve=False))
        if part not in children:
            return ".".join(path), sorted(str(k) for k in children)
        node = children[part]
        path.append(part)
    return None


def load_option(group: str, name: str) -> DictConfig:
    """`conf/<group>/<name>.yaml`, unresolved (ValueError listing the known options if missing)."""
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown {group} {name!r}; known: {', '.join(options(group))}")
    return OmegaConf.load(path)


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field's type names (`DecodeSchedule | None` -> DecodeSchedule), or None."""
    for t in (hint, *typing.get_args(hint)):
        if isinstance(t, type) and dataclasses.is_dataclass(t):
            return t
    return None


def method_fields(cls: type) -> dict[str, Any]:
    """`name` and every init field of the method dataclass `cls` at its default: a field typed as
    a dataclass (`decode_schedule`) as a node of that dataclass's fields (last, so that
    `method.decode_schedule.interval=32` needs no `+`), a field without a default as `???`.

    Values stay as the dataclass has them, untyped: the method validates them itself (ValueError
    naming the value), and nothing is converted (`beta: float = 20` stays the int 20, so config
    hashes are those of the values the dataclass holds)."""
    hints = typing.get_type_hints(cls)
    plain: dict[str, Any] = {"name": cls.name}
    nested: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = "???"
        inner = _dataclass_in(hints.get(f.name))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            nested[f.name] = dataclasses.asdict(value)
        elif value is None and inner is not None:
            nested[f.name] = dataclasses.asdict(inner())
        else:
            plain[f.name] = value
    return {**plain, **nested}


def register_method_configs() -> None:
    """Store `method_fields(cls)` of every registered method in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    from snapkv import METHODS

    store = ConfigStore.instance()
    for name, cls in METHODS.items():
        store.store(name=FIELDS_CONFIG.format(name), node=method_fields(cls), provider="snapkv-bench")


def method_config(name: str) -> DictConfig:
    """The node `method=<name>` composes to, unresolved (its `${budget}` resolves once placed in a
    config): conf/method/<name>.yaml over its dataclass's fields."""
    from snapkv import METHODS

    node = load_option("method", name)
    node.pop("defaults", None)
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; known methods: {', '.join(sorted(METHODS))}")
    return OmegaConf.merge(method_fields(METHODS[name]), node)
