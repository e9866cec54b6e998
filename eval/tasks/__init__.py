"""Tasks, registered by name (`task.name` in conf/task/*.yaml). Adding one: a package here with a
`Task` subclass (eval/tasks/base.py) in `task.py` and, for tables and plots of its own, a
`TaskReport` subclass in `report.py`, both named in `eval.tasks.registry`'s tables (or registered at
run time with `register_task` / `register_report`), and `conf/task/<name>.yaml`. Importing this
package loads no task: the registry imports a task's module when it is first asked for."""

from eval.tasks.base import EvalContext, Evaluation, ReportOptions, Sample, Task, TaskReport
from eval.tasks.registry import (
    REPORTS,
    TASKS,
    build_task,
    register_report,
    register_task,
    task_class,
    task_report,
)

__all__ = [
    "REPORTS",
    "TASKS",
    "EvalContext",
    "Evaluation",
    "ReportOptions",
    "Sample",
    "Task",
    "TaskReport",
    "build_task",
    "register_report",
    "register_task",
    "task_class",
    "task_report",
]
