"""The SLURM launcher's bookkeeping without a cluster: a job SLURM forgot, jobs pending for a reason
that cannot clear and submissions sbatch refuses (cancelled, one line, exit code 2), failure
messages, and a failed point that never started listed by the sweep's report callback. The launcher
on a real cluster: tests/e2e/test_slurm.py."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="needs the `cluster` extra")

from submitit.core.utils import FailedJobError, UncompletedJobError  # noqa: E402

import hydra_plugins.snapkv_bench._slurm as slurm  # noqa: E402
from eval.callbacks import sweep_errors  # noqa: E402


class FakeJob:
    """A submitit job that ends (its result or a final `sacct` state) after `done_after` polls."""

    def __init__(self, done_after: int | None = None, state: str = "PENDING"):
        self.job_id, self.done_after, self.state, self.polls, self.forced = "41_2", done_after, state, 0, 0
        self.paths = type("Paths", (), {"stderr": Path("/sweep/.submitit/41_2/41_2_0_log.err")})()

    def done(self, force_check: bool = False) -> bool:
        self.polls += 1
        self.forced += force_check
        return self.done_after is not None and self.polls > self.done_after


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_a_job_slurm_forgot_is_given_up_after_the_grace(monkeypatch):
    """Out of squeue and never ended in accounting (submitit still says PENDING): given up, while
    the job beside it, queued, is waited for."""
    monkeypatch.setattr(
        slurm, "queued", lambda ids: {j: slurm.Queued("RUNNING") for j in {"41_1"} & set(ids)}
    )
    clock = Clock()
    gone, running = FakeJob(), FakeJob(done_after=200)
    running.job_id = "41_1"
    forgotten = slurm.wait_all([running, gone], clock=clock, sleep=clock.sleep)
    assert list(forgotten) == [1] and "job 41_2 left SLURM without an accounting record" in str(forgotten[1])
    assert gone.forced >= 2 and running.forced == 0  # sacct asked each time the job was missing
    assert clock.now >= 200  # the queued job was waited for to its end


def test_given_up_only_after_the_grace_and_only_without_an_end_in_sacct(monkeypatch):
    monkeypatch.setattr(slurm, "queued", lambda ids: {})
    clock = Clock()
    forgotten = slurm.wait_all([FakeJob()], clock=clock, sleep=clock.sleep)
    assert slurm.FORGOTTEN_AFTER_S <= clock.now <= slurm.FORGOTTEN_AFTER_S + 2 * slurm.QUEUE_POLL_S
    assert list(forgotten) == [0]
    # Out of the queue, and sacct (forced) shows its end: done, not forgotten.
    job = FakeJob(done_after=1)
    assert slurm.wait_all([job], clock=clock, sleep=clock.sleep) == {} and job.forced == 1
    # squeue failing says nothing: the job is waited for.
    monkeypatch.setattr(slurm, "queued", lambda ids: None)
    job = FakeJob(done_after=100)
    assert slurm.wait_all([job], clock=clock, sleep=clock.sleep) == {} and job.forced == 0


@pytest.mark.parametrize(
    "reason",
    [
        "PartitionTimeLimit",
        "PartitionNodeLimit",
        "PartitionConfig",
        "InvalidAccount",
        "InvalidQOS",
        "BadConstraints",
        "QOSMaxWallDurationPerJobLimit",
        "AssocMaxWallDurationPerJobLimit",
        "AssocMaxCpuPerJobLimit",
        "QOSMaxGRESPerNode",
        "QOSMinGRES",
    ],
)
def test_reasons_waiting_cannot_clear(reason):
    assert slurm.is_unsatisfiable(reason)


@pytest.mark.parametrize(
    "reason",
    [
        "None",
        "Priority",
        "Resources",
        "Dependency",
        "BeginTime",
        "JobArrayTaskLimit",
        "ReqNodeNotAvail, UnavailableNodes:node[1-2]",
        "ReqNodeNotAvail, Reserved for maintenance",
        "PartitionDown",
        "AssocGrpCpuLimit",
        "QOSMaxJobsPerUserLimit",
        "QOSMaxCpuPerUserLimit",
        "QOSJobLimit",
    ],
)
def test_reasons_that_clear_by_waiting(reason):
    assert not slurm.is_unsatisfiable(reason)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2:00:00", 120), ("30:00", 30), ("1-00:00:00", 1440), ("1-12", 2160), ("16:40:00", 1000), ("45", 45)],
)
def test_slurm_times_in_minutes(text, expected):
    assert slurm.minutes(text) == expected
    assert slurm.minutes("infinite") == float("inf") and slurm.minutes("soon") is None


def fake_run(calls: list, stdout: str = "", returncode: int = 0, stderr: str = ""):
    def run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, returncode, stdout=stdout, stderr=stderr)

    return run


def test_squeue_states_and_reasons_are_read(monkeypatch):
    calls: list = []
    out = (
        "41_0|PENDING|ReqNodeNotAvail, UnavailableNodes:vm|debug|2:00:00\n41_1|RUNNING|None|batch|16:40:00\n"
    )
    monkeypatch.setattr(slurm.subprocess, "run", fake_run(calls, out))
    listed = slurm.queued(["41_0", "41_1"])
    assert listed == {
        "41_0": slurm.Queued("PENDING", "ReqNodeNotAvail, UnavailableNodes:vm", "debug", "2:00:00"),
        "41_1": slurm.Queued("RUNNING", "None", "batch", "16:40:00"),
    }
    assert calls[0][:3] == ["squeue", "--states=all", "--array"] and calls[0][-1] == "41_0,41_1"  # one call


def test_a_job_pending_over_the_partition_time_limit_ends_the_wait(monkeypatch):
    """Given up once the reason has held for UNSATISFIABLE_AFTER_S; the error names the job, the
    latest reason, the partition's limit and a partition that allows the request."""
    answers = iter(["PartitionConfig"] + ["PartitionTimeLimit"] * 100)  # SLURM refines the first

    def queue(ids):
        pending = slurm.Queued("PENDING", next(answers), "debug", "16:40:00")
        return {"41_2": pending, "41_1": pending}

    monkeypatch.setattr(slurm, "queued", queue)
    monkeypatch.setattr(slurm, "partition_limits", lambda: {"debug": "2:00:00", "batch": "infinite"})
    clock = Clock()
    with pytest.raises(slurm.Unsatisfiable) as err:
        slurm.wait_all([FakeJob()], clock=clock, sleep=clock.sleep)
    assert slurm.UNSATISFIABLE_AFTER_S <= clock.now <= slurm.UNSATISFIABLE_AFTER_S + slurm.QUEUE_POLL_S + 1
    assert str(err.value) == (
        "job 41_2 can never start: SLURM keeps it pending with reason PartitionTimeLimit (partition debug, "
        "time limit 16:40:00); the sweep's jobs are cancelled; lower hydra.launcher.timeout_min to at most "
        "120 (partition debug's limit, 2:00:00), or run on a partition that allows 16:40:00: "
        "hydra.launcher.partition=batch"
    )


def test_a_reason_that_clears_before_the_grace_is_waited_for(monkeypatch):
    """A coarse reason at submission that the scheduler then clears is no reason to give up."""
    answers = iter(["PartitionConfig", "Priority"] + ["None"] * 100)
    monkeypatch.setattr(slurm, "queued", lambda ids: {"41_2": slurm.Queued("PENDING", next(answers))})
    clock = Clock()
    assert slurm.wait_all([FakeJob(done_after=60)], clock=clock, sleep=clock.sleep) == {}


@pytest.mark.parametrize(
    ("reason", "names"),
    [
        ("InvalidAccount", "hydra.launcher.account"),
        ("InvalidQOS", "hydra.launcher.qos"),
        ("QOSMaxWallDurationPerJobLimit", "hydra.launcher.timeout_min"),
        ("PartitionConfig", "hydra.launcher.cpus_per_task"),
    ],
)
def test_each_reason_says_what_to_change(reason, names):
    assert names in slurm.remedy(reason, slurm.Queued("PENDING", reason, "debug", "1:00:00"), {})


def test_a_job_waiting_for_nodes_is_waited_for_and_logged_once(monkeypatch, caplog):
    """ReqNodeNotAvail (nodes down, drained or reserved) clears when they return: not an error."""
    reason = "ReqNodeNotAvail, UnavailableNodes:vm"
    # An in-process Hydra run earlier in the session configures logging with existing loggers disabled.
    monkeypatch.setattr(logging.getLogger(slurm.__name__), "disabled", False)
    monkeypatch.setattr(
        slurm, "queued", lambda ids: {"41_2": slurm.Queued("PENDING", reason, "debug", "2:00:00")}
    )
    clock = Clock()
    with caplog.at_level(logging.WARNING, logger=slurm.__name__):
        assert slurm.wait_all([FakeJob(done_after=60)], clock=clock, sleep=clock.sleep) == {}
    assert [r.getMessage() for r in caplog.records] == [
        f"job 41_2 is pending: {reason}; the sweep waits for it (scancel to stop)"
    ]


def test_nodes_described_in_words_are_the_same_wait_logged_once(monkeypatch, caplog):
    """SLURM shows ReqNodeNotAvail at submission and a sentence from its first scheduling pass on:
    one wait, one line, whichever wording the first poll sees."""
    sentence = "Nodes required for job are DOWN, DRAINED or reserved for jobs in higher priority partitions"
    answers = iter(["ReqNodeNotAvail, UnavailableNodes:vm"] + [sentence] * 100)
    monkeypatch.setattr(logging.getLogger(slurm.__name__), "disabled", False)
    monkeypatch.setattr(slurm, "queued", lambda ids: {"41_2": slurm.Queued("PENDING", next(answers))})
    clock = Clock()
    with caplog.at_level(logging.WARNING, logger=slurm.__name__):
        assert slurm.wait_all([FakeJob(done_after=60)], clock=clock, sleep=clock.sleep) == {}
    assert len(caplog.records) == 1 and "is pending: ReqNodeNotAvail" in caplog.records[0].getMessage()
    caplog.clear()
    assert slurm.stuck_pending({"41_2": slurm.Queued("PENDING", sentence)}, noted := set()) == {}
    assert noted == {"ReqNodeNotAvail"} and [r.getMessage() for r in caplog.records] == [
        f"job 41_2 is pending: ReqNodeNotAvail ({sentence}); the sweep waits for it (scancel to stop)"
    ]


def test_giving_up_cancels_the_arrays_and_exits_2_with_one_line(monkeypatch, capsys):
    calls: list = []
    monkeypatch.setattr(slurm.subprocess, "run", fake_run(calls))
    jobs = [FakeJob(), FakeJob(), FakeJob()]
    jobs[0].job_id, jobs[2].job_id = "41_0", "57"
    slurm.cancel(jobs)
    assert calls == [["scancel", "41", "57"]]
    with pytest.raises(SystemExit) as end:
        slurm.stop("job 41_2 can never start: ...")
    assert end.value.code == 2
    assert capsys.readouterr().err == "error: job 41_2 can never start: ...\n"


GRES = "sbatch: error: Invalid generic resource (gres) specification\n"
MEMORY = (
    "sbatch: error: Memory specification can not be satisfied\n"
    "sbatch: error: Batch job submission failed: Requested node configuration is not available\n"
)


@pytest.mark.parametrize(
    ("stderr", "expected"),
    [
        (
            GRES,
            "sbatch refused the sweep's jobs: Invalid generic resource (gres) specification; the cluster has "
            "no such GPUs: hydra.launcher.gpus_per_node=null for CPU jobs, or its own hydra.launcher.gres",
        ),
        (
            MEMORY,
            "sbatch refused the sweep's jobs: Memory specification can not be satisfied; Requested node "
            "configuration is not available; lower hydra.launcher.mem_gb to what a node has "
            "(sinfo -o '%N %m', in MB)",
        ),
    ],
)
def test_an_sbatch_refusal_is_one_line_naming_its_reason(stderr, expected):
    assert slurm.sbatch_refusal(stderr) == expected


def test_a_refused_submission_ends_the_sweep_with_exit_2_and_one_line(capsys):
    """submitit prints sbatch's stderr, then raises FailedJobError: the sweep ends with one line."""
    import sys

    class Refusing:
        def map_array(self, *args):
            print(GRES.strip(), file=sys.stderr)
            try:
                raise subprocess.CalledProcessError(1, ["sbatch"], stderr=GRES)
            except subprocess.CalledProcessError as err:
                raise FailedJobError(GRES.strip()) from err

    launcher = slurm.SlurmLauncher.__new__(slurm.SlurmLauncher)
    with pytest.raises(SystemExit) as end:
        launcher._submit(Refusing(), [(["budget=1"], "hydra.sweep.dir", 0, "job_id_for_0", None)])
    assert end.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: sbatch refused the sweep's jobs: Invalid generic")


def test_failure_messages_name_the_job_its_end_its_log_and_the_remedy():
    job = FakeJob(state="CANCELLED by 0")
    cancelled = slurm.SlurmLauncher._job_failure(job, UncompletedJobError("has not produced any output"))
    assert cancelled == (
        "job 41_2 ended without a result (SLURM state: CANCELLED by 0); "
        "log: /sweep/.submitit/41_2/41_2_0_log.err; rerun the command to run its missing samples"
    )
    trace = "Traceback (most recent call last):\n  File ...\nModuleNotFoundError: No module named 'eval'\n"
    failed = slurm.SlurmLauncher._job_failure(job, FailedJobError(trace))
    assert failed.startswith("job 41_2 failed: ModuleNotFoundError: No module named 'eval'; log: ")
    forgotten = slurm.SlurmLauncher._job_failure(job, slurm.JobForgotten("job 41_2 left SLURM"))
    assert forgotten == "job 41_2 left SLURM; rerun the command to run its samples"


def test_a_failed_point_that_never_started_is_listed(tmp_path):
    """A job cancelled while pending has no `.hydra/config.yaml`, only what the launcher recorded."""
    ran = tmp_path / "0" / ".hydra"
    ran.mkdir(parents=True)
    OmegaConf.save(OmegaConf.create({"results_dir": "r"}), ran / "config.yaml")
    OmegaConf.save(OmegaConf.create(["method=full"]), ran / "overrides.yaml")
    never = tmp_path / "1"
    (never / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(["method=snapkv"]), never / ".hydra" / "overrides.yaml")
    (never / "error.txt").write_text("job 41_1 left SLURM without an accounting record\n")
    cfg = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}, "output_subdir": ".hydra"}})
    assert sweep_errors(cfg) == [("1 (method=snapkv)", "job 41_1 left SLURM without an accounting record")]
