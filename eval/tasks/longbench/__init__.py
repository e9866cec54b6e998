"""LongBench (arXiv 2308.14508): the records, prompts and truncation (`prompts`), the task
(`task`), the official metrics (`metrics`) and the scorer command (`score`)."""

from eval.tasks.longbench import task  # noqa: F401  (registers the task)
