"""Sweeps on a real SLURM cluster through `hydra/launcher=slurm` (conf/hydra/launcher/slurm.yaml).

`make slurm-up` (scripts/slurm.sh) starts a one-node cluster with accounting on this machine; the
tests skip, naming why, when `sinfo` is missing or no node is up (and the cancel and preemption
tests when `sacct` does not answer). Every job runs `python run.py` on a
tiny local model (random 2-layer Llama + byte-level BPE, built here), so a job is mostly the Python
start-up. Each test has its own results dir and sweep dir.

Cancelling and preempting a job "mid-run" needs samples that take a while: the jobs of those tests
get a `sitecustomize.py` on their PYTHONPATH that sleeps `SLOW_SAMPLE_S` before each sample's
generation (test scaffolding only; the harness itself is untouched).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from test_runner import save_tiny_model

from eval.store import read_rows

ROOT = Path(__file__).resolve().parents[2]
# What `make slurm-up` writes for hydra/launcher=slurm on its cluster (scripts/slurm.sh).
LOCAL_LAUNCHER = ROOT / "conf" / "local" / "slurm.yaml"
SCRIPT_MARK = "# written by snapkv-bench scripts/slurm.sh"
# A request the cluster can never serve must end the sweep within this (the launcher polls squeue
# every 5 s; the rest is the sweep command's start-up and submission).
GIVE_UP_S = 60
SLOW_SAMPLE_S = 1.0
# submitit re-reads job states from `sacct` at 2, 4, 8, 16 ... s after submission: give it time.
SWEEP_TIMEOUT_S = 420


def cluster_problem() -> str | None:
    """Why no SLURM job can run here (None: a node is up)."""
    if shutil.which("sinfo") is None:
        return "sinfo not found: SLURM is not installed (make slurm-up installs and starts a local cluster)"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 60 s: the SLURM controller is not up (make slurm-up)"
    if proc.returncode != 0:
        return f"the SLURM cluster is not up (make slurm-up): sinfo: {proc.stderr.strip()[:200]}"
    states = set(proc.stdout.split())
    if not states & {"idle", "mix", "alloc", "comp"}:
        return f"no SLURM node is up (sinfo states: {sorted(states) or 'none'}; make slurm-up)"
    return None


def accounting_problem() -> str | None:
    """Why `sacct` cannot follow jobs here (None: accounting answers). submitit reads the end of a
    job that leaves no result (cancelled, requeued) from sacct only."""
    acct = subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True, timeout=60)
    if acct.returncode != 0:
        return f"SLURM accounting does not answer (make slurm-up starts slurmdbd): sacct: {acct.stderr.strip()[:200]}"
    return None


pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster() -> None:
    problem = cluster_problem()
    if problem:
        pytest.skip(problem)


@pytest.fixture(scope="module")
def accounting(cluster) -> None:
    problem = accounting_problem()
    if problem:
        pytest.skip(problem)


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def tiny_dir(cluster, tmp_path_factory) -> str:
    """The runner tests' tiny model directory (random Llama + byte-level BPE with a chat template)."""
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


SLOW_SITECUSTOMIZE = '''
"""Test scaffolding: every sample of a job sleeps SLOW_SAMPLE_S before generating."""
import importlib.abc, importlib.util, os, sys, time

DELAY = float(os.environ["SLOW_SAMPLE_S"])


class _SlowGenerate(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "eval.runner":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            real = module.generate

            def generate(*args, **kwargs):
                time.sleep(DELAY)
                return real(*args, **kwargs)

            module.generate = generate

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _SlowGenerate())
'''


def job_name(tmp_path: Path) -> str:
    return f"snapkv-test-{tmp_path.name}"


@pytest.fixture
def no_leftovers(tmp_path):
    """Whatever a test leaves behind when it fails: its sweep commands and its jobs."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    subprocess.run(["scancel", f"--name={job_name(tmp_path)}"], capture_output=True, timeout=60)


def sweep_args(tiny_dir: str, tmp_path: Path, *args: str, resources: bool = True) -> list[str]:
    """`run.py -m` on the SLURM launcher: 1 CPU and 1 GB per job, no GPU (resources=False: the
    launcher's settings as configured), the tiny model, quiet; `args` replace defaults of the same key."""
    launcher = [
        "hydra.launcher.gpus_per_node=null",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.mem_gb=1",
        "hydra.launcher.timeout_min=30",
    ]
    defaults = [
        "-m",
        "hydra/launcher=slurm",
        f"hydra.sweep.dir={tmp_path}/multirun",
        f"hydra.launcher.name={job_name(tmp_path)}",
        *(launcher if resources else []),
        f"model.name={tiny_dir}",
        "model.context=4096",
        "model.max_prompt_tokens=400",
        "budget=64",
        f"results_dir={tmp_path}/results",
        "progress=false",
        "task.haystack=noise",
        "task.max_new_tokens=6",
    ]
    given = {a.split("=", 1)[0] for a in args}
    return [a for a in defaults if a.split("=", 1)[0] not in given] + list(args)


def env_for(tmp_path: Path, slow: bool = False) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR" and not k.startswith("SLURM_")}
    env.update(
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1"
    )
    # Jobs unpickle the launcher and run.py by module name: they must import THIS checkout.
    paths = [str(ROOT)]
    if slow:
        shim = tmp_path / "slow"
        shim.mkdir(exist_ok=True)
        (shim / "sitecustomize.py").write_text(SLOW_SITECUSTOMIZE)
        paths.insert(0, str(shim))
        env["SLOW_SAMPLE_S"] = str(SLOW_SAMPLE_S)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def start_sweep(
    tmp_path: Path, args: list[str], slow: bool = False, started: list | None = None
) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "run.py"), *args],
        cwd=tmp_path, env=env_for(tmp_path, slow), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    if started is not None:
        started.append(proc)
    return proc


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=SWEEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the sweep did not end in {SWEEP_TIMEOUT_S} s:\n{out[-4000:]}")
    return proc.returncode, out


def run_sweep(tmp_path: Path, args: list[str], started: list) -> tuple[int, str]:
    return finish(start_sweep(tmp_path, args, started=started))


def all_rows(results: Path) -> list[dict]:
    return [row | {"_file": p.name} for p in sorted(results.rglob("*.jsonl")) for row in read_rows(p)]


def rows_per_sample(rows: list[dict]) -> Counter:
    """How many rows each (method config, sample) has, over every shard file."""
    return Counter((r["method_hash"], r["sample_id"]) for r in rows)


def wait_for_rows(
    results: Path, n: int, proc: subprocess.Popen, method: str | None = None, timeout: float = 240
) -> list[dict]:
    """Once `n` rows (of `method`, if given) are written: all of them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [r for r in (all_rows(results) if results.is_dir() else []) if method in (None, r["method"])]
        if len(rows) >= n:
            return rows
        if proc.poll() is not None:
            pytest.fail(f"the sweep ended before {n} rows were written:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.5)
    proc.kill()
    pytest.fail(f"fewer than {n} rows after {timeout} s")


def job_of(row: dict) -> str:
    """The row's job as scancel / sacct name it: `{array}_{task}` for an array task (its own job id
    is not accepted there), else the job id."""
    if row["slurm_array_job_id"] is not None:
        return f"{row['slurm_array_job_id']}_{row['slurm_array_task_id']}"
    return str(row["slurm_job_id"])


def sacct(job: str | int, fields: str = "JobID,State,Partition") -> list[dict]:
    """`sacct` rows of a job (array tasks included, steps left out), every requeued run too."""
    out = subprocess.run(
        ["sacct", "-X", "-D", "-P", "-o", fields, "-j", str(job)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    names = out[0].split("|")
    return [dict(zip(names, line.split("|"))) for line in out[1:]]


def wait_for_state(job: str, states: set[str], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = sacct(job)[-1]["State"]
        if state.split()[0] in states:
            return state
        time.sleep(1)
    pytest.fail(f"job {job} not in {states} after {timeout} s (sacct: {sacct(job)})")


# --------------------------------------------------------------------------------------------- tests
def test_a_sharded_sweep_runs_as_a_job_array_every_sample_once(tiny_dir, tmp_path, no_leftovers):
    """method=full,snapkv x 2 shards: 4 array tasks on the `batch` partition; every sample of both
    configs lands exactly once over the shard files, each row names its job, and one report holds both."""
    args = sweep_args(
        tiny_dir, tmp_path, "hydra.launcher.partition=batch", "method=full,snapkv",
        "task.num_shards=2", "task.shard=0,1", "task.lengths=[150,250]", "task.depths=[0,50,100]",
    )  # fmt: skip
    code, out = run_sweep(tmp_path, args, no_leftovers)
    assert code == 0, out[-4000:]
    rows = all_rows(tmp_path / "results")
    counts = rows_per_sample(rows)
    assert len(counts) == 2 * 6 and set(counts.values()) == {1}, counts
    assert {r["status"] for r in rows} == {"ok"}
    assert len({r["_file"] for r in rows}) == 4  # {full, snapkv} x {shard 0, shard 1}
    # One array: 4 tasks with their own job ids, each file written by one task.
    (array,) = {r["slurm_array_job_id"] for r in rows}
    assert isinstance(array, int)
    assert sorted({r["slurm_array_task_id"] for r in rows}) == [0, 1, 2, 3]
    assert len({r["slurm_job_id"] for r in rows}) == 4
    assert all(
        len({r["slurm_job_id"] for r in rows if r["_file"] == f}) == 1 for f in {r["_file"] for r in rows}
    )
    tasks = sacct(array)
    assert [t["State"] for t in tasks] == ["COMPLETED"] * 4 and {t["Partition"] for t in tasks} == {"batch"}
    report = (tmp_path / "results" / "report.md").read_text()
    assert "| full |" in report and "snapkv b=64" in report


def test_a_bad_point_is_recorded_and_the_other_points_finish(tiny_dir, tmp_path, no_leftovers):
    """budget=64,16: 16 is below SnapKV's window; that array task records the error, the other
    finishes, the report is written, and the command exits 2 naming the bad point."""
    args = sweep_args(tiny_dir, tmp_path, "budget=64,16", "task.lengths=[150]", "task.depths=[50]")
    code, out = run_sweep(tmp_path, args, no_leftovers)
    assert code == 2, out[-4000:]
    rows = all_rows(tmp_path / "results")
    assert [(r["method_params"]["budget"], r["status"]) for r in rows] == [(64, "ok")]
    (error,) = (tmp_path / "multirun").glob("*/error.txt")
    assert "window must be < budget, got window=32, budget=16" in error.read_text()
    assert "budget=16" in out and "1 sweep point(s) failed" in out
    assert "snapkv b=64" in (tmp_path / "results" / "report.md").read_text()


def test_cancelled_jobs_are_listed_and_resumed_by_rerunning_the_command(
    accounting, tiny_dir, tmp_path, no_leftovers
):
    """method=full,streamingllm,snapkv, one array task at a time: scancel the snapkv task while it
    is pending (SLURM drops it from the array without an accounting record), then the full job
    mid-run. The streamingllm job runs and finishes; the command ends listing the two cancelled
    points (exit 2); the same command again runs only the missing samples, none twice, and ends cleanly."""
    n = 16
    args = sweep_args(
        tiny_dir, tmp_path, "method=full,streamingllm,snapkv", "hydra.launcher.array_parallelism=1",
        "report=false", "task.lengths=[150,200,250,300]", "task.depths=[0,33,66,100]",
    )  # fmt: skip
    proc = start_sweep(tmp_path, args, slow=True, started=no_leftovers)
    results = tmp_path / "results"
    running = wait_for_rows(results, 1, proc, method="full")[0]
    job = job_of(running)
    pending = f"{running['slurm_array_job_id']}_2"
    queued = subprocess.run(["squeue", "-h", "-r", "-o", "%i %t"], capture_output=True, text=True, check=True)
    assert f"{pending} PD" in queued.stdout  # tasks 1 and 2 wait for the one slot
    subprocess.run(["scancel", pending], check=True)  # first: with task 1 still pending beside it
    subprocess.run(["scancel", job], check=True)
    code, out = finish(proc)
    assert code == 2, out[-4000:]
    assert wait_for_state(job, {"CANCELLED"}).startswith("CANCELLED")
    first = all_rows(results)
    done_full = sum(r["method"] == "full" for r in first)
    assert 1 <= done_full < n  # really stopped mid-run
    assert sum(r["method"] == "streamingllm" for r in first) == n  # the other point finished
    assert not any(r["method"] == "snapkv" for r in first)  # never started
    assert set(rows_per_sample(first).values()) == {1}
    errors = {e.parent.name: e.read_text() for e in (tmp_path / "multirun").glob("*/error.txt")}
    assert sorted(errors) == ["0", "2"]
    assert f"job {job} ended without a result (SLURM state: CANCELLED" in errors["0"]
    assert f"job {pending} left SLURM without an accounting record" in errors["2"]
    assert "2 sweep point(s) failed" in out and "method=full" in out and "method=snapkv" in out

    code, out = run_sweep(tmp_path, args, no_leftovers)
    assert code == 0, out[-4000:]
    rows = all_rows(results)
    counts = rows_per_sample(rows)
    assert len(counts) == 3 * n and set(counts.values()) == {1}, counts  # the missing ones ran, none twice
    assert {r["status"] for r in rows} == {"ok"}
    assert not list((tmp_path / "multirun").glob("*/error.txt"))  # the rerun cleared the old failures
    log = (tmp_path / "multirun" / "0" / "run.log").read_text()
    assert f"{n} samples, {done_full} rows already done, {n - done_full} to run" in log


def test_a_preempted_job_is_requeued_and_finishes_without_duplicates(
    accounting, tiny_dir, tmp_path, no_leftovers
):
    """USR2, the signal SLURM sends before a time limit or on preemption (submitit's `--signal`):
    submitit checkpoints the job and requeues it (`scontrol requeue`); the requeued job skips the
    samples already written and finishes; the sweep command never notices."""
    n = 12
    args = sweep_args(
        tiny_dir,
        tmp_path,
        "method=full",
        "report=false",
        "task.lengths=[150,200,250]",
        "task.depths=[0,33,66,100]",
    )
    proc = start_sweep(tmp_path, args, slow=True, started=no_leftovers)
    rows = wait_for_rows(tmp_path / "results", 2, proc)
    job = job_of(rows[0])
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    code, out = finish(proc)
    assert code == 0, out[-4000:]
    rows = all_rows(tmp_path / "results")
    counts = rows_per_sample(rows)
    assert len(counts) == n and set(counts.values()) == {1}, counts
    assert {r["status"] for r in rows} == {"ok"} and {job_of(r) for r in rows} == {job}
    # Rows before the requeue, then rows of the requeued run (SLURM counts its restarts).
    restarts = [r["slurm_restart_count"] for r in rows]
    assert restarts[0] is None and restarts[-1] == 1 and restarts == sorted(restarts, key=lambda c: c or 0)
    runs = sacct(job)
    assert [r["State"] for r in runs] == ["REQUEUED", "COMPLETED"], runs
    logs = "".join(p.read_text() for p in (tmp_path / "multirun" / ".submitit").rglob("*_log.err"))
    assert "Caught signal SIGUSR2" in logs and f"Requeued job {job}" in logs


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error:")]


def timed_sweep(tmp_path: Path, args: list[str], started: list) -> tuple[int, str, float]:
    start = time.monotonic()
    code, out = run_sweep(tmp_path, args, started)
    return code, out, time.monotonic() - start


def test_a_time_limit_over_the_partitions_ends_the_sweep_with_exit_2_naming_the_reason(
    tiny_dir, tmp_path, no_leftovers
):
    """timeout_min=1000 on `debug` (2 h): SLURM keeps the jobs pending (PartitionTimeLimit) forever.
    The sweep cancels them and exits 2 within a minute, one line naming the reason and the fix."""
    limit = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%l"], capture_output=True, text=True).stdout
    if limit.strip() != "2:00:00":
        pytest.skip(
            f"no `debug` partition with a 2 h limit as make slurm-up starts (sinfo: {limit.strip()!r})"
        )
    args = sweep_args(
        tiny_dir, tmp_path, "hydra.launcher.partition=debug", "hydra.launcher.timeout_min=1000",
        "method=full,snapkv", "task.lengths=[150]", "task.depths=[50]",
    )  # fmt: skip
    code, out, took = timed_sweep(tmp_path, args, no_leftovers)
    assert code == 2, out[-4000:]
    assert took < GIVE_UP_S, f"{took:.0f} s"
    (line,) = error_lines(out)
    assert "can never start: SLURM keeps it pending with reason PartitionTimeLimit" in line, line
    assert "timeout_min to at most 120" in line and "hydra.launcher.partition=batch" in line, line
    assert "Traceback" not in out
    # Nothing lingers: the array is cancelled.
    array = line.removeprefix("error: job ").split("_")[0]
    assert array.isdigit(), line
    queue = subprocess.run(["squeue", "-h", "-r", "-j", array, "-o", "%i %T"], capture_output=True, text=True)
    assert "PENDING" not in queue.stdout and "RUNNING" not in queue.stdout, queue.stdout
    assert not list(tmp_path.rglob("*.jsonl"))  # no job ran


def test_a_gpu_on_a_cluster_without_gpus_ends_the_sweep_with_exit_2_naming_sbatchs_reason(
    cluster, tiny_dir, tmp_path, no_leftovers
):
    """gpus_per_node=1 (the launcher's default) where no node has a GPU: sbatch refuses the array."""
    gres = subprocess.run(["sinfo", "-h", "-o", "%G"], capture_output=True, text=True, check=True).stdout
    if any("gpu" in g for g in gres.split()):
        pytest.skip(f"this cluster has GPUs (sinfo GRES: {gres.strip()})")
    args = sweep_args(
        tiny_dir, tmp_path, "hydra.launcher.gpus_per_node=1", "task.lengths=[150]", "task.depths=[50]"
    )
    code, out, took = timed_sweep(tmp_path, args, no_leftovers)
    assert code == 2, out[-4000:]
    assert took < GIVE_UP_S, f"{took:.0f} s"
    assert error_lines(out) == [
        "error: sbatch refused the sweep's jobs: Invalid generic resource (gres) specification; the cluster "
        "has no such GPUs: hydra.launcher.gpus_per_node=null for CPU jobs, or its own hydra.launcher.gres"
    ]
    assert "Traceback" not in out and "sbatch: error" not in out


def test_make_slurm_ups_launcher_settings_run_a_sweep_with_no_launcher_overrides(
    tiny_dir, tmp_path, no_leftovers
):
    """conf/local/slurm.yaml as scripts/slurm.sh writes it: the launcher's own defaults (a GPU, 12 h
    on `debug`) would be refused or pend forever; with it the sweep runs on the default partition."""
    if not LOCAL_LAUNCHER.is_file() or SCRIPT_MARK not in LOCAL_LAUNCHER.read_text():
        pytest.skip(
            f"{LOCAL_LAUNCHER} is missing or not written by scripts/slurm.sh (make slurm-up writes it)"
        )
    args = sweep_args(
        tiny_dir, tmp_path, "method=full,snapkv", "task.lengths=[150]", "task.depths=[50]", resources=False
    )
    code, out = run_sweep(tmp_path, args, no_leftovers)
    assert code == 0, out[-4000:]
    rows = all_rows(tmp_path / "results")
    assert sorted(r["method"] for r in rows) == ["full", "snapkv"] and {r["status"] for r in rows} == {"ok"}
    tasks = sacct(rows[0]["slurm_array_job_id"], "JobID,State,Partition,Timelimit")
    assert {t["Partition"] for t in tasks} == {"debug"} and {t["Timelimit"] for t in tasks} == {"02:00:00"}


@pytest.fixture
def drained(cluster):
    """Every node drained for the test (as an administrator does before maintenance), resumed after."""
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True)
    nodes = ",".join(sorted(set(nodes.stdout.split())))
    drain = subprocess.run(
        ["scontrol", "update", f"nodename={nodes}", "state=drain", "reason=snapkv-test"],
        capture_output=True,
        text=True,
    )
    if drain.returncode != 0:
        pytest.skip(f"cannot drain the nodes (scontrol needs the SLURM admin): {drain.stderr.strip()[:200]}")
    try:
        yield nodes
    finally:
        subprocess.run(
            ["scontrol", "update", f"nodename={nodes}", "state=resume"], capture_output=True, timeout=60
        )


def test_a_job_waiting_for_drained_nodes_is_waited_for_not_given_up(
    drained, tiny_dir, tmp_path, no_leftovers
):
    """ReqNodeNotAvail (nodes down, drained or reserved) clears when the nodes return: the sweep
    logs it once and keeps waiting, well past the time an unsatisfiable request takes to end it."""
    args = sweep_args(tiny_dir, tmp_path, "method=full", "task.lengths=[150]", "task.depths=[50]")
    proc = start_sweep(tmp_path, args, started=no_leftovers)
    time.sleep(30)
    still_waiting = proc.poll() is None
    proc.kill()
    out, _ = proc.communicate()
    assert still_waiting, out[-4000:]
    assert out.count("is pending: ReqNodeNotAvail") == 1 and "the sweep waits for it" in out, out[-4000:]
    assert not error_lines(out)
