"""RULER (arXiv 2404.06654): task settings (`config`), the offline generators (`generate`), the
task (`task`) and its report tables and figures (`report`)."""

from eval.tasks.ruler import task  # noqa: F401  (registers the task)
