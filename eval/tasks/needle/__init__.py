"""Needle-in-a-haystack: a fact hidden at a depth of a long context, asked for after it."""

from eval.tasks.needle import task  # noqa: F401  (registers the task)
