"""Console commands of the harness (`[project.scripts]` in pyproject.toml), for the tools that need
no checkout: they read a folder given on the command line, not conf/ or the committed results.
Each sets the environment its tool expects before the tool's imports load huggingface_hub (which
reads it at import), then runs it on the command line's arguments. scripts/report.py and
scripts/score_longbench.py run the same functions from a checkout.

The other scripts/ stay files run from a checkout: the speed benchmark, the observation analysis
and rescoring compose conf/, which an installed copy does not carry, and the remaining benchmarks
write into the checkout's results/.
"""

from __future__ import annotations

import os


def _offline() -> None:
    # Both tools read stored rows or predictions only: never wait on the Hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def report() -> int:
    """`snapkv-report RESULTS_DIR [--out DIR] [--trained-context N]`: eval.report's tables, plots
    and report.md from the stored rows."""
    _offline()
    from eval.report import main

    return main()


def score_longbench() -> int:
    """`snapkv-score-longbench PRED_DIR [--e] [--force]`: LongBench-format predictions scored with
    the official metrics (eval.tasks.longbench.score)."""
    _offline()
    from eval.tasks.longbench.score import main

    return main()
