"""Long-generation reasoning task (`task=reasoning`): eval/tasks/reasoning/task.py."""

from eval.tasks.reasoning.task import ReasoningTask

__all__ = ["ReasoningTask"]
