"""Tasks, registered by name (`task.name` in conf/task/*.yaml). Adding one: a file here with a
`@register_task`ed subclass of `Task` (see eval/tasks/base.py), imported below, and
`conf/task/<name>.yaml`."""

from eval.tasks import kv_retrieval, longbench, needle, reasoning, ruler  # noqa: E402, F401, I001  (registration)
from eval.tasks.base import ReportOptions, Sample, Task
from eval.tasks.registry import TASKS, build_task, register_task, task_class

__all__ = ["TASKS", "ReportOptions", "Sample", "Task", "build_task", "register_task", "task_class"]
