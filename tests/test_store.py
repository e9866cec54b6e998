import hashlib
import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from eval.spec import RunSpec
from eval.store import (
    QUANTIZED_ROW_SCHEMA,
    ROW_FIELDS,
    ROW_SCHEMA,
    SAMPLED_ROW_SCHEMA,
    DuplicateRowWarning,
    ResultStore,
    TruncatedRowWarning,
    config_hash,
    model_key,
    normalize_row,
    read_rows,
    result_path,
    safe_name,
    shard,
)
from eval.tasks.fidelity import report as fidelity_report


def row(sample_id, status="ok", score=1.0, **kw):
    base = {
        "sample_id": sample_id,
        "model": "tiny/model",
        "task": "needle",
        "dataset": "needle",
        "method": "snapkv",
        "method_params": {"budget": 128},
        "method_hash": "abcd1234",
        "query_aware": True,
        "score": score if status == "ok" else None,
        "status": status,
        "error": None if status == "ok" else "RuntimeError: boom",
    }
    base.update(kw)
    return base


def test_config_hash_stable_and_sensitive():
    a = {"method": "snapkv", "method_params": {"budget": 512, "window_size": 32}, "query_aware": True}
    b = {"query_aware": True, "method_params": {"window_size": 32, "budget": 512}, "method": "snapkv"}
    h = config_hash(a)
    assert h == config_hash(b)
    assert len(h) == 8 and all(c in "0123456789abcdef" for c in h)
    # Pinned: file names must not change between versions. sha256 of this exact text:
    canonical = '{"method":"snapkv","method_params":{"budget":512,"window_size":32},"query_aware":true}'
    assert h == hashlib.sha256(canonical.encode()).hexdigest()[:8] == "5efe4da0"
    assert config_hash({**a, "query_aware": False}) != h
    assert config_hash({**a, "method_params": {"budget": 1024, "window_size": 32}}) != h
    assert config_hash({**a, "task": {"max_prompt_tokens": 8000}}) != h
    with pytest.raises(TypeError):
        config_hash([1, 2])


def test_result_path_readable(tmp_path):
    p = result_path(tmp_path, "needle", "HuggingFaceTB/SmolLM2-135M-Instruct", "snapkv", "abcd1234")
    assert p == tmp_path / "needle" / "HuggingFaceTB__SmolLM2-135M-Instruct" / "snapkv-abcd1234.jsonl"
    p2 = result_path(tmp_path, "needle", "m", "snapkv", "abcd1234", shard=1, num_shards=4)
    assert p2.name == "snapkv-abcd1234.shard1of4.jsonl"
    assert safe_name("a b/c") == "a_b__c"


def test_append_flush_and_reload(tmp_path):
    path = tmp_path / "sub" / "snapkv-abcd1234.jsonl"
    store = ResultStore(path)
    store.append(row("s0", extra_unicode="é"))
    # Visible on disk immediately, one line per row, before any close/flush by the caller.
    assert path.read_text(encoding="utf-8").count("\n") == 1
    store.append(row("s1", score=0.5))
    reloaded = ResultStore(path)
    assert [r["sample_id"] for r in reloaded.rows()] == ["s0", "s1"]
    assert reloaded.rows()[0]["extra_unicode"] == "é"
    assert reloaded.done_ids() == {"s0", "s1"}


def test_append_validates(tmp_path):
    store = ResultStore(tmp_path / "x-abcd1234.jsonl")
    with pytest.raises(ValueError, match="sample_id"):
        store.append({"status": "ok"})
    with pytest.raises(ValueError, match="status"):
        store.append({"sample_id": "a", "status": "done"})


def test_resume_semantics(tmp_path):
    store = ResultStore(tmp_path / "snapkv-abcd1234.jsonl")
    store.append(row("a"))
    store.append(row("b", status="error"))
    store.append(row("c", status="oom"))
    assert store.done_ids() == {"a"}  # error/oom rows are retried
    store.append(row("b", score=0.25))  # retry succeeds
    assert store.done_ids() == {"a", "b"}
    latest = store.latest()
    assert latest["b"]["status"] == "ok" and latest["b"]["score"] == 0.25
    assert latest["c"]["status"] == "oom"
    # A later failure never hides an earlier success.
    store.append(row("a", status="error"))
    assert store.latest()["a"]["status"] == "ok"


def test_done_ids_sees_sibling_shard_files(tmp_path):
    d = tmp_path / "needle" / "m"
    ResultStore(result_path(tmp_path, "needle", "m", "snapkv", "abcd1234", 0, 2)).append(row("a"))
    ResultStore(result_path(tmp_path, "needle", "m", "snapkv", "abcd1234", 1, 2)).append(row("b"))
    ResultStore(d / "snapkv-ffff0000.jsonl").append(row("c"))  # other config: not a sibling
    store = ResultStore(result_path(tmp_path, "needle", "m", "snapkv", "abcd1234"))
    assert store.done_ids() == {"a", "b"}


def test_truncated_last_line_tolerated_and_repaired(tmp_path):
    path = tmp_path / "snapkv-abcd1234.jsonl"
    store = ResultStore(path)
    store.append(row("a"))
    store.append(row("b"))
    text = path.read_text()
    path.write_text(text[: len(text) - 15])  # killed mid-write of row b
    with pytest.warns(TruncatedRowWarning, match=r"snapkv-abcd1234.jsonl:2"):
        assert ResultStore(path).done_ids() == {"a"}  # b is recomputed
    with pytest.warns(TruncatedRowWarning):
        df = ResultStore.load_dir(tmp_path)
    assert df["sample_id"].tolist() == ["a"]
    # Resume: the next append removes the fragment, the file is clean again.
    with pytest.warns(TruncatedRowWarning):
        ResultStore(path).append(row("b"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r["sample_id"] for r in read_rows(path)] == ["a", "b"]


def test_valid_last_line_without_newline_is_kept(tmp_path):
    path = tmp_path / "snapkv-abcd1234.jsonl"
    path.write_text(json.dumps(row("a")))  # no trailing newline
    store = ResultStore(path)
    assert store.done_ids() == {"a"}
    store.append(row("b"))
    assert [r["sample_id"] for r in read_rows(path)] == ["a", "b"]


def test_malformed_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "snapkv-abcd1234.jsonl"
    lines = [json.dumps(row("a")), "{not json", json.dumps(row("b"))]
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"snapkv-abcd1234\.jsonl:2"):
        ResultStore(path).done_ids()
    with pytest.raises(ValueError, match=r"snapkv-abcd1234\.jsonl:2"):
        ResultStore.load_dir(tmp_path)


def test_load_dir_merges_shards_without_duplicates(tmp_path):
    s0 = ResultStore(result_path(tmp_path, "needle", "m", "snapkv", "abcd1234", 0, 2))
    s1 = ResultStore(result_path(tmp_path, "needle", "m", "snapkv", "abcd1234", 1, 2))
    for sid in ("a", "b", "c"):
        s0.append(row(sid))
    s1.append(row("c", score=0.0))  # overlap (e.g. a rerun with another sharding)
    s1.append(row("d", status="error"))
    s1.append(row("d", score=0.5))
    s1.append(row("e", status="oom"))
    # Same sample ids under another config are different results.
    other = ResultStore(result_path(tmp_path, "needle", "m", "full", "99999999"))
    other.append(row("a", method="full", method_params={}, method_hash="99999999"))
    with pytest.warns(DuplicateRowWarning, match="1 samples are stored in more than one results file"):
        df = ResultStore.load_dir(tmp_path)
    # "c" is in both shard files: listed; "d" was rerun within one file: not a duplicate.
    assert df.attrs["duplicates"] == (
        ("needle", "tiny/model", "abcd1234", "c",
         "needle/m/snapkv-abcd1234.shard0of2.jsonl, needle/m/snapkv-abcd1234.shard1of2.jsonl"),
    )  # fmt: skip
    assert len(df) == 6
    assert not df.duplicated(["method_hash", "sample_id"]).any()
    snap = df[df["method_hash"] == "abcd1234"].set_index("sample_id")
    assert sorted(snap.index) == ["a", "b", "c", "d", "e"]
    assert snap.loc["d", "status"] == "ok" and snap.loc["d", "score"] == 0.5
    assert snap.loc["e", "status"] == "oom"
    assert set(ROW_FIELDS) <= set(df.columns) and "file" in df.columns
    assert snap.loc["a", "file"] == "needle/m/snapkv-abcd1234.shard0of2.jsonl"


def test_load_dir_skips_other_jsonl_files(tmp_path):
    ResultStore(tmp_path / "needle" / "m" / "snapkv-abcd1234.jsonl").append(row("a"))
    (tmp_path / "pred").mkdir()
    (tmp_path / "pred" / "qasper.jsonl").write_text('{"pred": "x", "answers": ["x"], "all_classes": null}\n')
    with pytest.warns(UserWarning, match="not a results file"):
        df = ResultStore.load_dir(tmp_path)
    assert df["sample_id"].tolist() == ["a"]


def test_load_dir_hash_from_file_name_and_empty(tmp_path):
    assert ResultStore.load_dir(tmp_path).empty
    r = row("a")
    del r["method_hash"]
    ResultStore(tmp_path / "t" / "snapkv-0badcafe.jsonl").append(r)
    df = ResultStore.load_dir(tmp_path)
    assert df["method_hash"].tolist() == ["0badcafe"] and df.attrs["duplicates"] == ()
    with pytest.raises(FileNotFoundError):
        ResultStore.load_dir(tmp_path / "missing")


def test_shard_split():
    items = list(range(23))
    parts = [shard(items, i, 4) for i in range(4)]
    assert sorted(x for p in parts for x in p) == items  # every item exactly once
    assert parts[1] == [1, 5, 9, 13, 17, 21]
    assert shard(iter("abc"), 0, 1) == ["a", "b", "c"]
    assert shard(["x"], 0, 1) == shard(["x"], 0, 1)


@pytest.mark.parametrize(
    ("s", "n", "bad"), [(0, 0, "num_shards"), (4, 4, "got 4"), (-1, 2, "got -1"), (0, 1.5, "num_shards")]
)
def test_shard_validation(s, n, bad):
    with pytest.raises(ValueError, match=bad):
        shard([1, 2], s, n)


# ------------------------------------------------------------------------- old rows (committed results)
REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "experiment, method",
    [("needle_methods", "snapkv"), ("needle_methods", "full"), ("longbench_multinews", "snapkv")],
)
def test_committed_results_resume_under_the_new_schema(experiment, method, tmp_path):
    """The committed rows (written before the schema change) load with their task columns and
    with what really ran; `full` (unchanged since) is found by today's config: same file path and
    hash, every sample done. SnapKV's default GQA order changed since (pool_first -> reduce_first):
    today's default must NOT reuse those rows, and `method.gqa_order=pool_first` names what they ran."""
    src = REPO / "results" / experiment
    shutil.copytree(src, tmp_path / experiment, ignore=shutil.ignore_patterns("*.png"))
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={experiment}", f"method={method}",
                                           f"results_dir={tmp_path / experiment}"])  # fmt: skip
    spec = RunSpec.from_config(cfg)
    if method == "snapkv":
        # The old rows (no gqa_order in their params) live in their own file, never today's: rows
        # on today's defaults may sit beside them (the gallery reran them), all reduce_first.
        files = sorted(spec.result_path.parent.glob("snapkv-*.jsonl"))
        old_files = [f for f in files if "gqa_order" not in read_rows(f)[0]["method_params"]]
        assert old_files, "no committed pre-switch snapkv rows"
        assert spec.result_path not in old_files, "old pool-first rows must not resume under reduce_first"
        old_rows = read_rows(old_files[0])
        assert normalize_row(old_rows[0])["method_params"]["gqa_order"] == "pool_first"
        if spec.result_path.exists():
            today = read_rows(spec.result_path)
            assert {r["method_params"]["gqa_order"] for r in today} == {"reduce_first"}
        df = ResultStore.load_dir(tmp_path / experiment)
        snap = df[df["method"] == "snapkv"]
        old_ids = {r["sample_id"] for f in old_files for r in read_rows(f)}
        labelled = {p["gqa_order"] for i, p in zip(snap["sample_id"], snap["method_params"]) if i in old_ids}
        assert "pool_first" in labelled
        return
    assert spec.result_path.is_file(), f"{spec.result_path} (today's hash) is not a committed file"
    old_rows = read_rows(spec.result_path)
    assert "model_path" not in old_rows[0]  # really the old shape
    assert ResultStore(spec.result_path).done_ids() == {r["sample_id"] for r in old_rows}
    new = normalize_row(old_rows[0])
    assert new["model"] == model_key(old_rows[0]["model"]) == old_rows[0]["model"]
    assert new["model_path"] == old_rows[0]["model"]
    df = ResultStore.load_dir(tmp_path / experiment)
    assert df["model_path"].notna().all()
    if spec.task.name == "needle":
        assert (
            df["context_length"].notna().all() and "length" not in df
        )  # null columns of other tasks dropped
    else:
        assert df["length"].notna().all() and "depth_percent" not in df


def test_old_rows_name_the_switches_added_since():
    """Rows without a switch get the value that reproduces what ran before it existed."""

    def old(method, params):
        return normalize_row({"sample_id": "s", "model": "m", "method": method, "method_params": params})

    assert old("snapkv", {"budget": 64})["method_params"] == {"budget": 64, "gqa_order": "pool_first"}
    assert old("pyramidkv", {})["method_params"] == {"gqa_order": "pool_first", "short_prompt": "clip"}
    ada = old("adakv", {"normalize": True})["method_params"]
    assert ada == {"normalize": "sum", "gqa_order": "pool_first", "allocation": "exact"}
    assert old("adakv", {"normalize": False})["method_params"]["normalize"] is False
    assert old("h2o", {"budget": 64})["method_params"] == {"budget": 64}  # nothing changed there
    # Today's rows (with model_path) and explicit values are left as they are.
    new = {"sample_id": "s", "model": "m", "model_path": "m", "method": "snapkv", "method_params": {}}
    assert normalize_row(new)["method_params"] == {}
    assert old("snapkv", {"gqa_order": "reduce_first"})["method_params"] == {"gqa_order": "reduce_first"}


def test_the_row_schema_is_described_once_beside_row_fields():
    assert ROW_FIELDS == tuple(ROW_SCHEMA)
    assert all(kind and meaning for kind, meaning in ROW_SCHEMA.values())
    # docs/results.md points at ROW_SCHEMA instead of repeating it; the fields it names are real.
    docs = (Path(__file__).resolve().parents[1] / "docs" / "results.md").read_text()
    section = docs.split("## The result row\n", 1)[1].split("\n## ", 1)[0]
    assert "`ROW_SCHEMA` in [eval/store.py]" in section and "| field |" not in section
    task_columns = {"context_length", "depth_percent", "needle", "actual_tokens", "length", "prompt_tokens"}
    # The fidelity task's measured columns are real too: the ones its report reads, and its timing.
    task_columns |= {*fidelity_report.METRICS, "teacher_force_s"}
    named = set(re.findall(r"`([a-z][a-z0-9_]*)`", section)) - task_columns - {"truncated"}
    documented = set(ROW_FIELDS) | set(SAMPLED_ROW_SCHEMA) | set(QUANTIZED_ROW_SCHEMA)
    assert named and named <= documented, named - documented
