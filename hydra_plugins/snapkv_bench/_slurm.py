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

A request the cluster can never serve ends the sweep at once, with one `error:` line and exit code 2,
instead of a traceback or a wait that never ends: a submission sbatch refuses (e.g. a GPU on a
cluster without GPUs), and jobs SLURM keeps pending for a reason that waiting cannot clear
(`UNSATISFIABLE_REASONS`: a time limit over the partition's, an invalid account or QOS, a per-job
QOS or association maximum); those jobs are cancelled first. `ReqNodeNotAvail` is not one of them:
SLURM gives it for nodes that are down, drained or reserved, which an administrator or the end of a
reservation clears; the launcher logs it once and waits.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

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
# A job is given up once every poll over this long showed it pending for a reason that waiting cannot
# clear: at submission SLURM may show a coarse reason (PartitionConfig) that its scheduler then
# refines (PartitionTimeLimit) or clears; the error names the latest.
UNSATISFIABLE_AFTER_S = 10.0


# Pending reasons (squeue's %r; SLURM's "Job Reason Codes") that waiting cannot clear: the request
# itself is beyond what the partition, account or QOS allows, or names an account/QOS that is not
# there. Limits on what runs at once (Grp*, *PerUser, *PerAccount, QOSJobLimit) clear as jobs end,
# and so do Priority, Resources, BeginTime, Dependency, PartitionDown and ReqNodeNotAvail.
UNSATISFIABLE_REASONS = frozenset(
    {
        "PartitionTimeLimit",
        "PartitionNodeLimit",
        "PartitionConfig",
        "BadConstraints",
        "InvalidAccount",
        "AccountNotAllowed",
        "InvalidQOS",
        "QOSNotAllowed",
        "MaxMemPerLimit",
        "DependencyNeverSatisfied",
        "ReservationDeleted",
    }
)
# QOS / association maxima per job or per node (QOSMaxWallDurationPerJobLimit, AssocMaxCpuPerJobLimit,
# QOSMaxGRESPerNode ...) and QOS minima: the job's own request is over (or under) them.
_UNSATISFIABLE_LIMIT = re.compile(r"(QOS|Assoc)Max\w*Per(Job|Node)\w*|QOSMin\w+")
# Pending reasons that may clear but may also take long: logged once so the sweep does not wait silently.
NOTED_REASONS = (
    "ReqNodeNotAvail",
    "PartitionDown",
    "PartitionInactive",
    "NodeDown",
    "JobHeld",
    "Reservation",
)
# squeue's %r shows a job's state description in place of its reason code once the scheduler has
# written one: a job held by drained nodes reads `ReqNodeNotAvail, UnavailableNodes:vm` at submission
# and this sentence from the first scheduling pass on (SLURM 22.05; the code underneath is Resources).
DESCRIBED_REASONS = {
    "Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority partitions": (
        "ReqNodeNotAvail"
    ),
}


class JobForgotten(RuntimeError):
    """SLURM has no record of the job any more: neither queued nor ended in accounting."""


class Unsatisfiable(RuntimeError):
    """A job SLURM keeps pending for a reason that waiting cannot clear (UNSATISFIABLE_REASONS)."""


class Queued(NamedTuple):
    """A job as `squeue` lists it."""

    state: str = "PENDING"
    reason: str = "None"
    partition: str = ""
    time_limit: str = ""  # SLURM's [days-]hours:minutes:seconds


def queued(job_ids: Sequence[str]) -> dict[str, Queued] | None:
    """The jobs of `job_ids` that `squeue` lists in any state, array tasks as `{array}_{task}`, with
    their state, pending reason, partition and time limit (None when squeue fails: no conclusion)."""
    try:
        out = subprocess.run(
            ["squeue", "--states=all", "--array", "-h", "-o", "%i|%T|%r|%P|%l", "-j", ",".join(job_ids)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode == 0:
        listed = {}
        for line in out.stdout.splitlines():
            job_id, *fields = line.strip().split("|")
            if job_id:
                listed[job_id] = Queued(*fields[:4])
        return listed
    # squeue fails this way when it knows none of them (a known array with unknown tasks lists none).
    return {} if "Invalid job id specified" in out.stderr else None


def reason_code(reason: str) -> str:
    """The code of a pending reason (`ReqNodeNotAvail, UnavailableNodes:n1` -> `ReqNodeNotAvail`; a
    sentence of DESCRIBED_REASONS -> the code it stands for)."""
    return DESCRIBED_REASONS.get(reason.strip()) or reason.split(",")[0].strip()


def is_unsatisfiable(reason: str) -> bool:
    """Whether a job pending for `reason` can never start without changing its request."""
    code = reason_code(reason)
    return code in UNSATISFIABLE_REASONS or _UNSATISFIABLE_LIMIT.fullmatch(code) is not None


def minutes(slurm_time: str) -> float | None:
    """SLURM's time (`[days-]hours:minutes:seconds`, `minutes:seconds`, `minutes`, `days-hours[:...]`)
    in minutes; inf for `infinite`/`UNLIMITED`; None when unreadable."""
    text = slurm_time.strip()
    if text.lower() in ("infinite", "unlimited"):
        return math.inf
    days, _, clock = text.rpartition("-")
    try:
        parts = [int(p) for p in clock.split(":")]
        if days:  # days-hours[:minutes[:seconds]]
            hours, mins, secs = (parts + [0, 0])[:3]
        else:  # [[hours:]minutes:]seconds, or minutes alone
            hours, mins, secs = ([0, 0] + parts)[-3:] if len(parts) > 1 else (0, parts[0], 0)
        return int(days or 0) * 1440 + hours * 60 + mins + secs / 60
    except (ValueError, IndexError):
        return None


def partition_limits() -> dict[str, str]:
    """Every partition's time limit as `sinfo` gives it (empty when sinfo fails)."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%R %l"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split(maxsplit=1) for line in out.stdout.splitlines() if len(line.split()) == 2)


def remedy(reason: str, job: Queued, limits: dict[str, str]) -> str:
    """What to change in the launcher's settings for a job pending for an unsatisfiable `reason`."""
    code = reason_code(reason)
    if code == "PartitionTimeLimit" or "WallDuration" in code:
        wanted = minutes(job.time_limit)
        limit = limits.get(job.partition, "")
        longer = sorted(p for p, t in limits.items() if wanted is not None and (minutes(t) or 0) >= wanted)
        fix = "lower hydra.launcher.timeout_min"
        if code == "PartitionTimeLimit" and minutes(limit) not in (None, math.inf):
            fix += f" to at most {int(minutes(limit))} (partition {job.partition}'s limit, {limit})"
        if code == "PartitionTimeLimit" and longer:
            fix += (
                f", or run on a partition that allows {job.time_limit}: hydra.launcher.partition={longer[0]}"
            )
        return fix
    if code in ("InvalidAccount", "AccountNotAllowed"):
        return "set hydra.launcher.account to an account you may use on this partition (sacctmgr show assoc user=$USER)"
    if code in ("InvalidQOS", "QOSNotAllowed"):
        return "set hydra.launcher.qos to a QOS you may use (sacctmgr show assoc user=$USER format=qos)"
    if code == "BadConstraints":
        return "no node has the features of hydra.launcher.constraint: change it (sinfo -o '%N %f')"
    return (
        "ask for what the partition's nodes have: hydra.launcher.cpus_per_task, mem_gb, gpus_per_node, "
        "gres, timeout_min, or another hydra.launcher.partition / account / qos (sinfo -o '%P %l %c %m %G')"
    )


def wait_all(
    jobs: Sequence[Any],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[int, JobForgotten]:
    """Wait until every job is done (submitit: its result is written or `sacct` shows its end), or
    has been out of `squeue` for `FORGOTTEN_AFTER_S` without accounting showing its end (submitit
    would wait for it forever). Returns those forgotten jobs by index. Raises Unsatisfiable for a job
    pending for a reason that waiting cannot clear, seen over `UNSATISFIABLE_AFTER_S` (the jobs are
    left to the caller to cancel)."""
    forgotten: dict[int, JobForgotten] = {}
    missing_since: dict[int, float] = {}
    stuck_since: dict[str, float] = {}
    noted: set[str] = set()
    checked = -math.inf
    while True:
        left = [i for i, job in enumerate(jobs) if i not in forgotten and not job.done()]
        if not left:
            return forgotten
        now = clock()
        if now - checked >= QUEUE_POLL_S:
            checked = now
            listed = queued([jobs[i].job_id for i in left])
            stuck = stuck_pending(listed or {}, noted)
            stuck_since = {j: stuck_since.get(j, now) for j in stuck}
            for job_id, since in stuck_since.items():
                if now - since >= UNSATISFIABLE_AFTER_S:
                    raise Unsatisfiable(unsatisfiable_message(job_id, stuck[job_id]))
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


def stuck_pending(listed: dict[str, Queued], noted: set[str]) -> dict[str, Queued]:
    """The pending jobs whose reason waiting cannot clear; a reason of NOTED_REASONS is logged once
    per code (`noted`: the codes logged so far), however SLURM words it from poll to poll."""
    stuck = {}
    for job_id, job in listed.items():
        if job.state != "PENDING":
            continue
        code = reason_code(job.reason)
        if is_unsatisfiable(job.reason):
            stuck[job_id] = job
        elif code.startswith(NOTED_REASONS) and code not in noted:
            noted.add(code)
            said = job.reason if job.reason.startswith(code) else f"{code} ({job.reason})"
            logger.warning("job %s is pending: %s; the sweep waits for it (scancel to stop)", job_id, said)
    return stuck


def unsatisfiable_message(job_id: str, job: Queued) -> str:
    """The sweep's one error line for a job pending for a reason that waiting cannot clear."""
    return (
        f"job {job_id} can never start: SLURM keeps it pending with reason {reason_code(job.reason)} "
        f"(partition {job.partition}, time limit {job.time_limit}); the sweep's jobs are cancelled; "
        + remedy(job.reason, job, partition_limits())
    )


def cancel(jobs: Sequence[Any]) -> None:
    """scancel the job arrays (and single jobs) of `jobs`, so that nothing of the sweep lingers."""
    ids = sorted({str(job.job_id).split("_")[0] for job in jobs})
    if ids:
        try:
            subprocess.run(["scancel", *ids], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            logger.warning("scancel %s failed: cancel them yourself", " ".join(ids))


def sbatch_refusal(stderr: str) -> str:
    """One line for a submission that sbatch refused: its reason and what to change."""
    lines = [line.strip().removeprefix("sbatch: error:").strip() for line in stderr.splitlines()]
    lines = [line for line in lines if line]
    failed = [
        line.removeprefix("Batch job submission failed:").strip()
        for line in lines
        if line.startswith("Batch job")
    ]
    specific = [line for line in lines if not line.startswith("Batch job")]
    reason = "; ".join(specific + [f for f in failed if f not in specific]) or "no reason given"
    low = reason.lower()
    if "gres" in low or "generic resource" in low:
        fix = "the cluster has no such GPUs: hydra.launcher.gpus_per_node=null for CPU jobs, or its own hydra.launcher.gres"
    elif "memory" in low:
        fix = "lower hydra.launcher.mem_gb to what a node has (sinfo -o '%N %m', in MB)"
    elif "time limit" in low:
        fix = "lower hydra.launcher.timeout_min to the partition's limit (sinfo -o '%P %l')"
    elif "partition" in low:
        fix = "set hydra.launcher.partition to one of the cluster's (sinfo -o '%P %l')"
    elif "account" in low:
        fix = "set hydra.launcher.account to an account you may use (sacctmgr show assoc user=$USER)"
    elif "qos" in low:
        fix = "set hydra.launcher.qos to a QOS you may use (sacctmgr show assoc user=$USER format=qos)"
    else:
        fix = (
            "ask for what a node has: hydra.launcher.cpus_per_task, mem_gb, gpus_per_node, gres, constraint "
            "(sinfo -o '%P %c %m %G %f')"
        )
    return f"sbatch refused the sweep's jobs: {reason}; {fix}"


def stop(message: str) -> NoReturn:
    """End the sweep on a request the cluster cannot serve: one line on stderr, exit code 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class SlurmLauncher(PluginSlurmLauncher):
    """hydra-submitit-launcher's SLURM launcher that waits for every job and records the jobs that
    end without a result as failed sweep points instead of raising at the first; a request the
    cluster can never serve ends the sweep with one line and exit code 2."""

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
        jobs = self._submit(executor, job_params)
        try:
            forgotten = wait_all(jobs)
        except Unsatisfiable as err:
            cancel(jobs)
            stop(str(err))
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

    def _submit(self, executor: Any, job_params: list[tuple]) -> list[Any]:
        """`executor.map_array`, a refusal by sbatch ending the sweep in one line (exit code 2)."""
        from submitit.core.utils import FailedJobError

        # submitit prints sbatch's stderr before raising: kept back, it becomes part of the one line.
        printed = io.StringIO()
        try:
            with contextlib.redirect_stderr(printed):
                jobs = executor.map_array(self, *zip(*job_params))
        except FailedJobError as err:
            if isinstance(err.__cause__, subprocess.CalledProcessError):
                stop(sbatch_refusal(str(err)))
            sys.stderr.write(printed.getvalue())
            raise
        sys.stderr.write(printed.getvalue())
        return jobs

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
