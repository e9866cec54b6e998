"""Short readable labels of method configs (`snapkv b=512 w=32 k=7 max`) and the budget a config
sets: how every table, figure and paired comparison names a config. Imports nothing else from
`eval/`; the defaults it hides come from the registered method dataclasses."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from snapkv import METHODS

# Parameter name -> short label key, in label order. Several spellings map to one key.
_ABBREV: dict[str, str] = {
    "budget": "b",
    "max_capacity_prompt": "b",
    "kv_budget": "b",
    "compression_ratio": "r",
    "ratio": "r",
    "window_size": "w",
    "window": "w",
    "observation_window": "w",
    "kernel_size": "k",
    "sink_size": "s",
    "n_sink": "s",
    "num_sink_tokens": "s",
    "sink_tokens": "s",
}
_KEY_ORDER = ("b", "r", "w", "k", "s")
# Parameters shown by value only ("max" rather than "pooling=max") when the value is one of these.
_BARE = {"pooling": ("max", "avg", "mean")}
# Secondary parameters left out of the label at their default. The default is read from the
# registered method dataclasses (`snapkv.METHODS`) where the parameter is declared, so the label
# follows a changed default; a subclass that redeclares it with another default (Ada-KV's
# short_prompt="clip" over PyramidKV's "uniform") shows it. Hiding one fixed value per parameter
# never gives two different configs the same label.
QUIET_PARAMS = (
    "gqa_reduce",
    "recent_ratio",
    "evict_during_decode",
    "normalize",
    "block_size",
    "positions",
    "gqa_order",
    "schedule",
    "short_prompt",
    "allocation",
    "keep_last",
    "skip_layers",
    "prune_after",
    "chunk_score",
    "reuse_layers",
)


def _declared_defaults(names: tuple[str, ...], cls: type) -> dict[str, Any]:
    """The defaults of `names` in method class `cls`, each read where it is first declared in its
    MRO (the base-most class: Ada-KV's redeclared short_prompt="clip" is not PyramidKV's "uniform",
    so it stays in Ada-KV's labels)."""
    out = {}
    for name in names:
        owner = next((k for k in reversed(cls.__mro__) if name in vars(k).get("__annotations__", {})), None)
        if owner is not None:
            f = owner.__dataclass_fields__[name]
            out[name] = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    return out


def quiet_defaults(method: str | None) -> dict[str, Any]:
    """The secondary parameters left out of `method`'s labels, with the value at which they are
    (`QUIET_PARAMS` at their declared defaults; {} for a method that is not registered). ValueError
    for a quiet parameter no registered method declares."""
    unknown = [n for n in QUIET_PARAMS if not any(n in c.__dataclass_fields__ for c in METHODS.values())]
    if unknown:
        raise ValueError(f"quiet parameters {unknown} are declared by no registered method")
    cls = METHODS.get(method) if method else None
    return _declared_defaults(QUIET_PARAMS, cls) if cls is not None else {}


BUDGET_KEYS = ("budget", "max_capacity_prompt", "kv_budget")
QUERY_AGNOSTIC_SUFFIX = " q-agnostic"


def format_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else f"{v:g}"
    if isinstance(v, (list, tuple)):
        return ",".join(format_value(x) for x in v)
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True, separators=(",", ":"))
    return str(v)


def method_label(method: str | None, params: dict | None = None, query_aware: bool | None = None) -> str:
    """Short readable label of a method config, e.g. `snapkv b=512 w=32 k=7 max` or `full`.

    Known parameters get short keys in a fixed order (b=budget, r=ratio, w=window, k=kernel,
    s=sinks), other parameters follow as `name=value` (sorted), `pooling` is shown by value last
    (`max`/`avg`; `pooling=none` otherwise), a decode schedule as `decode=64,target=256`. None-valued parameters and secondary parameters at their
    default (`quiet_defaults`, e.g. gqa_reduce=mean) are omitted. `query_aware=False` appends
    " q-agnostic" (None/True: nothing).
    """
    params = params if isinstance(params, dict) else {}
    quiet = quiet_defaults(method)
    known: dict[str, str] = {}
    other: list[str] = []
    bare: list[str] = []
    for name in sorted(params):
        value = params[name]
        if value is None or (name in quiet and value == quiet[name]):
            continue
        if name == "decode_schedule" and isinstance(value, dict):
            other.append(_schedule_label(value))
        elif name in _BARE and value in _BARE[name]:
            bare.append(format_value(value))
        elif name in _ABBREV and _ABBREV[name] not in known:
            known[_ABBREV[name]] = f"{_ABBREV[name]}={format_value(value)}"
        else:
            other.append(f"{name}={format_value(value)}")
    parts = [str(method) if method not in (None, "") else "?"]
    parts += [known[k] for k in _KEY_ORDER if k in known] + other + bare
    label = " ".join(parts)
    if query_aware is False:
        label += QUERY_AGNOSTIC_SUFFIX
    return label


def kv_quant_suffix(kv_quant: dict | None) -> str:
    """` kivi4` for a row's `kv_quant` (`{"kind": "kivi", "bits": 4, ...}`), with the group size and
    residual where they differ from the kind's config defaults (` kivi2 g=64 r=32`); "" without
    one (rows stored at the model's dtype)."""
    if not isinstance(kv_quant, dict) or kv_quant.get("kind") in (None, "none"):
        return ""
    kind = kv_quant["kind"]
    label = f" {kind}{kv_quant.get('bits', '')}"
    defaults = {"kivi": (32, 128)}.get(kind, (64, 128))
    for key, short, default in zip(("group_size", "residual"), ("g", "r"), defaults):
        if kv_quant.get(key, default) != default:
            label += f" {short}={kv_quant[key]}"
    return label


def _schedule_label(schedule: dict) -> str:
    """A decode schedule as `decode=<interval>` plus its other set keys, e.g. `decode=64,target=256`
    (snapkv.methods.base.DecodeSchedule; buffer 0 and null values are its defaults)."""
    rest = [
        f"{k}={format_value(v)}"
        for k, v in sorted(schedule.items())
        if k != "interval" and v is not None and not (k == "buffer" and v == 0)
    ]
    return ",".join([f"decode={format_value(schedule.get('interval'))}"] + rest)


def budget_of(params: dict | None) -> float | None:
    """The token budget in `params` (first of BUDGET_KEYS present), else None."""
    if not isinstance(params, dict):
        return None
    for key in BUDGET_KEYS:
        v = params.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None
