"""Tasks and their reports by name, beside the method registry: `build_task("needle", lengths=[1000])`.

The built-in entries are "module:Class" paths, imported on first use (lm-eval's lazy task index):
listing or checking task names loads no task, running one loads only its own module, and a task's
report module (`eval/tasks/<benchmark>/report.py`) is loaded only by the report. A class registered
at run time (`register_task`, `register_report`) is stored as it is. Names are unique: a second
class under a taken name is refused.
"""

from __future__ import annotations

import importlib
from typing import Any

from eval.tasks.base import Task, TaskReport

TASKS: dict[str, str | type[Task]] = {
    "fidelity": "eval.tasks.fidelity.task:FidelityTask",
    "infinitebench": "eval.tasks.infinitebench.task:InfiniteBenchTask",
    "kv_retrieval": "eval.tasks.kv_retrieval.task:KVRetrievalTask",
    "longbench": "eval.tasks.longbench.task:LongBenchTask",
    "longbench_v2": "eval.tasks.longbench_v2.task:LongBenchV2Task",
    "needle": "eval.tasks.needle.task:NeedleTask",
    "reasoning": "eval.tasks.reasoning.task:ReasoningTask",
    "ruler": "eval.tasks.ruler.task:RulerTask",
    "scbench": "eval.tasks.scbench.task:SCBenchTask",
}
REPORTS: dict[str, str | type[TaskReport]] = {
    "fidelity": "eval.tasks.fidelity.report:FidelityReport",
    "kv_retrieval": "eval.tasks.kv_retrieval.report:KVRetrievalReport",
    "longbench": "eval.tasks.longbench.report:LongBenchReport",
    "longbench_v2": "eval.tasks.longbench_v2.report:LongBenchV2Report",
    "needle": "eval.tasks.needle.report:NeedleReport",
    "reasoning": "eval.tasks.reasoning.report:ReasoningReport",
    "ruler": "eval.tasks.ruler.report:RulerReport",
}


def _path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _register(table: dict, kind: str, name: str, cls: type) -> None:
    old = table.get(name)
    if old is not None and old is not cls and old != _path(cls):
        taken = old if isinstance(old, str) else _path(old)
        raise ValueError(
            f"{kind} name {name!r} is already registered by {taken.replace(':', '.')}; "
            f"cannot register {_path(cls).replace(':', '.')} under it"
        )
    table[name] = cls


def _resolve(table: dict, name: str) -> type:
    entry = table[name]
    if isinstance(entry, str):
        module, _, qualname = entry.partition(":")
        cls = getattr(importlib.import_module(module), qualname)
        table[name] = cls
        return cls
    return entry


def register_task(cls: type) -> type:
    """Class decorator: register a `Task` subclass under its `name`.

    ValueError for a class that is not a Task, one without a name, or a name already taken.
    """
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"cannot register {cls!r}: it is not a subclass of eval.tasks.base.Task")
    name = cls.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"cannot register {cls.__qualname__}: it has no `name`")
    _register(TASKS, "task", name, cls)
    return cls


def register_report(name: str, cls: type) -> type:
    """Register the `TaskReport` subclass of task `name`. ValueError for a class that is not a
    TaskReport or a name whose report is already registered."""
    if not (isinstance(cls, type) and issubclass(cls, TaskReport)):
        raise ValueError(f"cannot register {cls!r}: it is not a subclass of eval.tasks.base.TaskReport")
    _register(REPORTS, "report", name, cls)
    return cls


def task_class(name: str) -> type[Task]:
    """The registered class of `name` (ValueError listing the known names)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}")
    return _resolve(TASKS, name)


def task_report(name: str) -> type[TaskReport]:
    """The report of task `name`; the generic `TaskReport` (default tables) for a task without one
    (rows of a task that is not registered here)."""
    return _resolve(REPORTS, name) if name in REPORTS else TaskReport


def build_task(name: str, **params: Any) -> Task:
    """Instantiate a registered task; ValueError for an unknown name or a parameter it does not take."""
    cls = task_class(name)
    try:
        return cls(**params)
    except TypeError as e:  # an argument the task does not take (e.g. added with +task.foo=...)
        raise ValueError(f"task {name!r}: {e}") from None
