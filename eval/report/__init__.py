"""The report of a results folder (`build`: summary.csv, report.md, figures), its paired
comparisons (`paired`) and its shared-context protocol section (`protocols`). Each task's own
tables and plots are its `TaskReport` (eval/tasks/<benchmark>/report.py), found by name."""

from eval.report.build import (
    NothingToReport,
    Report,
    build_report,
    listed_figures,
    main,
    prepare,
    summarize,
    write_plots,
    write_report,
)

__all__ = [
    "NothingToReport",
    "Report",
    "build_report",
    "listed_figures",
    "main",
    "prepare",
    "summarize",
    "write_plots",
    "write_report",
]
