"""The SLURM launcher of `hydra/launcher=slurm` (conf/hydra/launcher/slurm.yaml).

It is hydra-submitit-launcher's `SlurmLauncher` (a sweep is one job array; preempted and timed-out
jobs are requeued through submitit's checkpointing and resume from the rows already written),
except for jobs that end without a result: cancelled (`scancel`), killed (out of memory, node
failure), out of requeues, or failing before the harness starts (e.g. the checkout is not importable
on the node). The plugin raises at the first such job and leaves while the others still run, with
no report; and it waits forever for an array task cancelled while pending, which SLURM (22.05)
drops from the array without an accounting record, so `sacct` never gives submitit its end.

Here every job is waited for, all at once; such a job is recorded like any failed sweep point
(`{job dir}/error.txt`, eval/callbacks.py), so the report is written from the others and the
command ends listing the failed points (exit code 2). Rerunning the command runs what they missed.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as PluginSlurmLauncher
from omegaconf import OmegaConf, open_dict

from eval.callbacks import JOB_ERROR_FILE

logger = logging.getLogger(__name__)

# A job that `squeue --states=all` has not listed for this long, and that accounting does not show
# ended, has left SLURM without a trace: an array task cancelled while pending. (submitit keeps such a
# task's last `sacct` state, PENDING, forever.) Finished jobs stay listed for MinJobAge (300 s).
FORGOTTEN_AFTER_S = 30.0
QUEUE_POLL_S = 5.0


class JobForgotten(RuntimeError):
    """SLURM has no record of the job any more: neither queued nor ended in accounting."""


def queued(job_ids: Sequence[str]) -> set[str] | None:
    """The jobs of `job_ids` that `squeue` lists in any state, array tasks as `{array}_{task}`
    (None when squeue fails: no conclusion)."""
    try:
        out = subprocess.run(
            ["squeue", "--states=all", "--array", "-h", "-o", "%i", "-j", ",".join(job_ids)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode == 0:
        return set(out.stdout.split())
    # squeue fails this way when it knows none of them (a known array with unknown tasks lists none).
    return set() if "Invalid job id specified" in out.stderr else None


def wait_all(
    jobs: Sequence[Any],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[int, JobForgotten]:
    """Wait until every job is done (submitit: its result is written or `sacct` shows its end), or
    has been out of `squeue` for `FORGOTTEN_AFTER_S` without accounting showing its end (submitit
    would wait for it forever). Returns those forgotten jobs by index."""
    forgotten: dict[int, JobForgotten] = {}
    missing_since: dict[int, float] = {}
    checked = -math.inf
    while True:
        left = [i for i, job in enumerate(jobs) if i not in forgotten and not job.done()]
        if not left:
            return forgotten
        now = clock()
        if now - checked >= QUEUE_POLL_S:
            checked = now
            listed = queued([jobs[i].job_id for i in left])
            for i in left:
                if listed is None or jobs[i].job_id in listed:
                    missing_since.pop(i, None)
                elif jobs[i].done(force_check=True):  # out of the queue: ask sacct now, not at its next poll
                    continue
                elif now - missing_since.setdefault(i, now) >= FORGOTTEN_AFTER_S:
                    forgotten[i] = JobForgotten(
                        f"job {jobs[i].job_id} left SLURM without an accounting record (an array task "
                        "cancelled while pending)"
                    )
        sleep(1.0)


class SlurmLauncher(PluginSlurmLauncher):
    """hydra-submitit-launcher's SLURM launcher that waits for every job and records the jobs that
    end without a result as failed sweep points instead of raising at the first."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

        if self.config is None or self.hydra_context is None:
            raise RuntimeError("launch() called before setup()")
        # Executor, parameters and submission as the plugin's `launch` (hydra-submitit-launcher 1.2).
        init_keys = {"submitit_folder", "max_num_timeout"}
        init = {f"{self._EXECUTOR}_{k}": v for k, v in self.params.items() if k == "max_num_timeout"}
        executor = submitit.AutoExecutor(
            cluster=self._EXECUTOR, folder=self.params["submitit_folder"], **init
        )
        queue_keys = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{
                k if k in queue_keys else f"{self._EXECUTOR}_{k}": v
                for k, v in self.params.items()
                if k not in init_keys
            }
        )
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        logger.info("Submitit '%s' sweep output dir : %s", self._EXECUTOR, sweep_dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        job_params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            logger.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            job_params.append(
                (list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state())
            )
        jobs = executor.map_array(self, *zip(*job_params))

        forgotten = wait_all(jobs)
        returns = []
        for i, ((overrides, _, idx, *_rest), job) in enumerate(zip(job_params, jobs)):
            try:
                if i in forgotten:
                    raise forgotten[i]
                returns.append(job.results()[0])
            except (submitit.core.utils.UncompletedJobError, JobForgotten) as err:
                message = self._job_failure(job, err)
                logger.error("sweep point #%d failed: %s", idx, message)
                self._record_failure(overrides, idx, message)
                returns.append(JobReturn(overrides=overrides, status=JobStatus.COMPLETED))
        return returns

    @staticmethod
    def _job_failure(job: Any, err: Exception) -> str:
        """One line: the job, how it ended, where its log is, and what to do."""
        from submitit.core.utils import FailedJobError

        if isinstance(err, JobForgotten):
            return f"{err}; rerun the command to run its samples"
        if isinstance(err, FailedJobError):  # raised in the job before the harness caught anything
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            how = f"failed: {lines[-1] if lines else type(err).__name__}"
        else:
            how = f"ended without a result (SLURM state: {job.state})"
        return (
            f"job {job.job_id} {how}; log: {job.paths.stderr}; rerun the command to run its missing samples"
        )

    def _record_failure(self, overrides: list[str], idx: int, message: str) -> None:
        """`{job dir}/error.txt` (and the job's overrides, when it never started) for ReportCallback."""
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num = idx
        job_dir = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
        job_dir.mkdir(parents=True, exist_ok=True)
        (job_dir / JOB_ERROR_FILE).write_text(message + "\n", encoding="utf-8")
        if cfg.hydra.output_subdir:
            saved = job_dir / str(cfg.hydra.output_subdir) / "overrides.yaml"
            if not saved.exists():
                saved.parent.mkdir(parents=True, exist_ok=True)
                OmegaConf.save(OmegaConf.create(list(overrides)), saved)
