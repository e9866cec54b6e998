"""Hydra callback for sweeps (conf/config.yaml `hydra.callbacks.report`): after a sweep's last job,
report each results_dir once, and list the sweep points that failed.

A job of a sweep that fails on bad input (e.g. `budget=16` below the window) or whose samples all
failed does not stop the sweep: `run.py` records it as `{job dir}/error.txt` and returns (the SLURM
launcher, hydra_plugins/snapkv_bench/_slurm.py, does the same for a job that ended without a result,
e.g. a cancelled one); this callback then logs every failed point, writes the reports, and exits
with code 2. A job clears its `error.txt` when it starts, so rerunning a sweep into the same sweep
dir lists only what failed again.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

logger = logging.getLogger(__name__)

JOB_ERROR_FILE = "error.txt"


def in_multirun() -> bool:
    """True inside a job of `python run.py -m ...`: the report is then written once, by ReportCallback."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def record_job_error(message: str) -> Path | None:
    """Write `message` to the current Hydra job's output dir (None outside a Hydra job)."""
    if not HydraConfig.initialized():
        return None
    out = Path(HydraConfig.get().runtime.output_dir) / JOB_ERROR_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(message + "\n", encoding="utf-8")
    return out


def clear_job_error() -> None:
    """Remove the current Hydra job's `error.txt` left by an earlier run of the same sweep dir."""
    if HydraConfig.initialized():
        (Path(HydraConfig.get().runtime.output_dir) / JOB_ERROR_FILE).unlink(missing_ok=True)


class ReportCallback(Callback):
    """Write the report of every results_dir of the sweep once (parallel jobs never write it
    concurrently); then, if any point failed, list them and exit with code 2."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        # Lazy: Hydra builds the callback in the sweep's launching process, which needs torch and
        # the models (eval.runner) only here, after the last job.
        from eval.runner import report_results

        for results_dir in sweep_results_dirs(config):
            report_results(results_dir)
        failed = sweep_errors(config)
        for job, message in failed:
            logger.error("sweep point %s failed: %s", job, message)
        if failed:
            logger.error("%d sweep point(s) failed; the others ran and are in the report", len(failed))
            sys.exit(2)


def _jobs(config: DictConfig) -> list[Path]:
    try:
        sweep_dir, subdir = Path(config.hydra.sweep.dir), config.hydra.output_subdir
    except Exception:  # noqa: BLE001 - no hydra node (called outside Hydra)
        return []
    if not subdir or not sweep_dir.is_dir():
        return []
    # A job that never started (cancelled while pending) has only the error its launcher recorded.
    jobs = {p.parent.parent for p in sweep_dir.glob(f"*/{subdir}/config.yaml")}
    jobs |= {p.parent for p in sweep_dir.glob(f"*/{JOB_ERROR_FILE}")}
    return sorted(jobs, key=_job_order)


def _job_order(job: Path) -> tuple:
    return (0, int(job.name), "") if job.name.isdigit() else (1, 0, job.name)


def sweep_errors(config: DictConfig) -> list[tuple[str, str]]:
    """`(job overrides, error)` of each failed job of the sweep, from `{job dir}/error.txt`."""
    out = []
    for job in _jobs(config):
        err = job / JOB_ERROR_FILE
        if err.is_file():
            overrides = job / config.hydra.output_subdir / "overrides.yaml"
            try:
                point = " ".join(str(o) for o in OmegaConf.load(overrides))
            except Exception:  # noqa: BLE001 - no overrides file: name the job folder
                point = job.name
            out.append((f"{job.name} ({point})", err.read_text(encoding="utf-8").strip()))
    return out


def sweep_results_dirs(config: DictConfig) -> list[str]:
    """The results_dirs of a sweep's jobs that want a report, from each job's saved
    `{sweep dir}/{job}/.hydra/config.yaml` (any launcher writes them; a sweep may vary results_dir),
    else the sweep's own results_dir."""
    found: dict[str, bool] = {}
    for job in _jobs(config):
        try:
            saved = OmegaConf.load(job / config.hydra.output_subdir / "config.yaml")
            found.setdefault(str(saved.results_dir), bool(saved.get("report", True)))
        except Exception:  # noqa: BLE001 - an unreadable job config just adds nothing
            continue
    if not found:
        found[str(config.results_dir)] = bool(config.get("report", True))
    return [d for d, wanted in found.items() if wanted]
