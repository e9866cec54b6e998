"""The SLURM launcher's bookkeeping without a cluster: a job SLURM forgot, failure messages, and a
failed point that never started listed by the sweep's report callback. The launcher on a real
cluster: tests/e2e/test_slurm.py."""

from __future__ import annotations

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
    monkeypatch.setattr(slurm, "queued", lambda ids: {"41_1"} & set(ids))
    clock = Clock()
    gone, running = FakeJob(), FakeJob(done_after=200)
    running.job_id = "41_1"
    forgotten = slurm.wait_all([running, gone], clock=clock, sleep=clock.sleep)
    assert list(forgotten) == [1] and "job 41_2 left SLURM without an accounting record" in str(forgotten[1])
    assert gone.forced >= 2 and running.forced == 0  # sacct asked each time the job was missing
    assert clock.now >= 200  # the queued job was waited for to its end


def test_given_up_only_after_the_grace_and_only_without_an_end_in_sacct(monkeypatch):
    monkeypatch.setattr(slurm, "queued", lambda ids: set())
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
