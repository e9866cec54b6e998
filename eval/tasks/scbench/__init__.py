"""SCBench (Li et al. 2024, https://arxiv.org/abs/2412.10319): shared-context multi-turn tasks."""
