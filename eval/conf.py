"""The one place that finds the Hydra configs (`conf/` of this checkout) and lists or loads the
options of a config group (`conf/<group>/<name>.yaml`)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

# Absolute, so that entry points also work when imported (tests) or started from another directory.
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def options(group: str) -> list[str]:
    """The option names of a config group, sorted: `options("method")` -> ["adakv", ...]."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def load_option(group: str, name: str) -> DictConfig:
    """`conf/<group>/<name>.yaml`, unresolved (ValueError listing the known options if missing)."""
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown {group} {name!r}; known: {', '.join(options(group))}")
    return OmegaConf.load(path)
