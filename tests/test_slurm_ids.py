"""Rows name the SLURM job that ran them (`slurm_*` columns), and nothing outside SLURM."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

import eval.runner as runner
from eval.provenance import SLURM_FIELDS, slurm_ids
from eval.spec import RunSpec
from eval.store import ROW_FIELDS

CONF = Path(__file__).resolve().parents[1] / "conf"
ARRAY_TASK = {"SLURM_JOB_ID": "4131", "SLURM_ARRAY_JOB_ID": "4129", "SLURM_ARRAY_TASK_ID": "2"}


def test_slurm_ids_of_an_array_task_a_plain_job_and_no_job():
    assert slurm_ids(ARRAY_TASK) == {
        "slurm_job_id": 4131,
        "slurm_array_job_id": 4129,
        "slurm_array_task_id": 2,
        "slurm_restart_count": None,
    }
    assert slurm_ids({"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}) == {
        "slurm_job_id": 77,
        "slurm_array_job_id": None,
        "slurm_array_task_id": None,
        "slurm_restart_count": 1,
    }
    assert slurm_ids({"HOME": "/root", "SLURM_ARRAY_TASK_ID": ""}) == dict.fromkeys(SLURM_FIELDS)
    # A value SLURM spells otherwise is kept as it is rather than lost.
    assert slurm_ids({"SLURM_JOB_ID": "12+0"})["slurm_job_id"] == "12+0"


def test_rows_record_the_slurm_job_and_nothing_outside_slurm(monkeypatch):
    assert set(SLURM_FIELDS) <= set(ROW_FIELDS)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        spec = RunSpec.from_config(compose("config", overrides=["method=full", "task.haystack=noise"]))
    info = {"attn_impl": "sdpa", "device": "cpu"}
    for var in (*SLURM_FIELDS.values(), "SLURM_JOBID"):
        monkeypatch.delenv(var, raising=False)
    outside = runner._base_fields(spec, info)
    assert {k: outside[k] for k in SLURM_FIELDS} == dict.fromkeys(SLURM_FIELDS)
    for var, value in ARRAY_TASK.items():
        monkeypatch.setenv(var, value)
    inside = runner._base_fields(spec, info)
    assert (inside["slurm_job_id"], inside["slurm_array_job_id"], inside["slurm_array_task_id"]) == (
        4131,
        4129,
        2,
    )
