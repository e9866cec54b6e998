"""InfiniteBench (OpenBMB/InfiniteBench): the 100K+ tasks, their prompts and scorers."""
