"""LongBench (arXiv 2308.14508): the records, prompts and truncation (`prompts`), the task
(`task`), the official metrics (`metrics`), the scorer command (`score`) and the report (`report`)."""
