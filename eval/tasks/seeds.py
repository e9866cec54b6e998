"""Generator seeds of the generated tasks (needle, RULER, kv_retrieval): ``task.seeds=[...]``.

A generated task draws its content (magic numbers, keys, haystack offsets) from its ``seed``.
``seeds`` lists the generator seeds to run: one context per (cell, seed), so the score's spread over
seeds can be told apart from its sampling spread (`eval.stats.seed_variance`). ``seeds`` only
chooses which samples run (a task's `selection_keys`): the results file stays the one of ``seed``,
and adding seeds resumes into it. Samples of ``seed`` keep their sample ids; those of another seed
carry ``-seed<N>`` at the end of their context's id. Every generated sample records its generator
seed in the row field `task_seed` (`eval.store.ROW_SCHEMA`).
"""

from __future__ import annotations

from typing import Any


def generator_seeds(task: str, seed: Any, seeds: Any) -> list[int]:
    """The generator seeds to run, in order and without repeats: ``seeds``, or ``[seed]`` when None.
    ValueError naming the bad value."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{task} seed must be an integer, got seed={seed!r}")
    if seeds is None:
        return [seed]
    if isinstance(seeds, int) and not isinstance(seeds, bool):
        seeds = [seeds]
    if not isinstance(seeds, (list, tuple)) or not seeds:
        raise ValueError(f"{task} seeds must be a non-empty list of integers or null, got seeds={seeds!r}")
    for s in seeds:
        if isinstance(s, bool) or not isinstance(s, int):
            raise ValueError(f"{task} seeds must be integers, got {s!r} in seeds={list(seeds)!r}")
    return list(dict.fromkeys(seeds))


def seed_suffix(seed: int, base: int) -> str:
    """What a context id of generator seed ``seed`` carries: nothing for the task's own ``base`` seed
    (its ids as they were before ``seeds`` existed), else ``-seed<N>``."""
    return "" if seed == base else f"-seed{seed}"
