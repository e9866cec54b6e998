"""LongBench-v2 (arXiv 2412.15204): the prompts (`prompts`), the task (`task`), answer extraction and
result.py's aggregation (`metrics`) and the report (`report`)."""
