"""Tasks by name, beside the method registry: `build_task({"name": "needle", "lengths": [1000]})`."""

from __future__ import annotations

from typing import Any

from eval.tasks.base import Task

TASKS: dict[str, type[Task]] = {}


def register_task(cls: type) -> type:
    """Class decorator: register a `Task` subclass under its `name`.

    ValueError for a class that is not a Task, one without a name, or a name already taken.
    """
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"cannot register {cls!r}: it is not a subclass of eval.tasks.base.Task")
    name = cls.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"cannot register {cls.__qualname__}: it has no `name`")
    old = TASKS.get(name)
    if old is not None and old is not cls:
        raise ValueError(
            f"task name {name!r} is already registered by {old.__module__}.{old.__qualname__}; "
            f"cannot register {cls.__module__}.{cls.__qualname__} under it"
        )
    TASKS[name] = cls
    return cls


def task_class(name: str) -> type[Task]:
    """The registered class of `name` (ValueError listing the known names)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def build_task(name: str, **params: Any) -> Task:
    """Instantiate a registered task; ValueError for an unknown name or a parameter it does not take."""
    cls = task_class(name)
    try:
        return cls(**params)
    except TypeError as e:  # an argument the task does not take (e.g. added with +task.foo=...)
        raise ValueError(f"task {name!r}: {e}") from None
