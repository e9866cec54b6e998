"""The results page's sections on folders written by their own scripts: eviction against
quantization at equal bytes (results/equal_bytes/, eval/report/equal_bytes.py) and where eviction
pays in a serving engine (results/serving/, the CSVs of scripts/bench_serving.py read by
eval/report/serving.py); the page (eval/report/page.py) places them after its own sections. Each
renders nothing while its folder is absent; its numbers come from the rows (change one score, the
table changes); its words follow Holm's p and the TOST; a throughput ratio whose IQR straddles 1 is
not called paying."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from test_report import MODEL, base_row, write

from eval.bench.serving import POINT_COLUMNS, REQUEST_COLUMNS, SEARCH_COLUMNS, write_csv
from eval.report import equal_bytes as eb
from eval.report import page, serving, wording
from eval.store import ResultStore, config_hash
from eval.tables import slug

N = 20  # samples per equal-bytes config: enough units for the interval, McNemar and the TOST
KIVI = {"kind": "kivi", "group_size": 32, "residual": 128, "order": "key_channel"}


@pytest.fixture(autouse=True)
def _fresh():
    page.clear_cache()
    yield
    page.clear_cache()


# ------------------------------------------------------------------------------------- equal bytes
def eb_rows(method: str, params: dict, quant: dict | None, kv_bytes: int, wrong: int) -> list[dict]:
    """N needle rows of one configuration storing `kv_bytes` of the full cache's 4000 per sample,
    the first `wrong` samples answered wrong."""
    out = []
    for i in range(N):
        s = 0.0 if i < wrong else 1.0
        r = base_row(f"len4000_depth{i}", "needle", "needle", method, params, s, context_length=4000,
                     depth_percent=i, scores={"exact": s, "partial": s}, kv_bytes=kv_bytes, kv_bytes_full=4000)  # fmt: skip
        if quant is not None:
            r["kv_quant"] = quant
            r["method_hash"] = config_hash({"method": method, "method_params": params, "kv_quant": quant})
        out.append(r)
    return out


def snap(budget: int) -> dict:
    return {"budget": budget, "window_size": 32}


def equal_bytes_folder(root: Path, kivi2_wrong: int = 10) -> Path:
    """full; at 1/4: KIVI-4 (no loss), SnapKV 1024 (every answer lost) and 768 (one lost, 5 % more
    bytes); at 1/8: KIVI-2 (`kivi2_wrong` lost, 4 % more bytes) and SnapKV 512 (two lost); no
    combined configuration."""
    folder = root / eb.FOLDER
    write(
        folder,
        eb_rows("full", {}, None, 4000, 0)
        + eb_rows("full", {}, {**KIVI, "bits": 4}, 1000, 0)
        + eb_rows("full", {}, {**KIVI, "bits": 2}, 520, kivi2_wrong)
        + eb_rows("snapkv", snap(1024), None, 1000, N)
        + eb_rows("snapkv", snap(768), None, 1050, 1)
        + eb_rows("snapkv", snap(512), None, 500, 2),
    )
    return folder


def table_row(text: str, first: str) -> list[str]:
    """The cells of the markdown table row of `text` starting with `first`."""
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"| {first} |")]
    return [c.strip() for c in line.strip("|").split("|")]


def test_sections_render_nothing_while_their_folders_are_absent(tmp_path):
    (tmp_path / "other").mkdir()
    assert eb.section(tmp_path) == "" and serving.section(tmp_path) == ""
    text = page.page(tmp_path, "", "<!-- b -->", "<!-- e -->")
    assert "equal bytes" not in text and "serving engine" not in text


def test_equal_bytes_table_is_the_best_of_each_kind_at_each_fraction_from_the_report(tmp_path):
    equal_bytes_folder(tmp_path)
    text = eb.section(tmp_path)
    (a,) = eb.analyses(ResultStore.load_dir(tmp_path / eb.FOLDER))
    rows = [r.split("|")[1:4] for r in text.splitlines() if r.startswith("| 1/")]
    cells = [[c.strip() for c in r] for r in rows]
    # per fraction the kinds in the report's order, each the config that loses least
    assert cells == [
        ["1/4", "quantized", "full + kivi-4"],
        ["1/4", "eviction", "snapkv b=768 w=32 (best of 2)"],
        ["1/8", "quantized", "full + kivi-2"],
        ["1/8", "eviction", "snapkv b=512 w=32"],
    ]
    cost = a.costs.set_index("config").loc["full + kivi-2"]
    (line,) = [ln for ln in text.splitlines() if "| 1/8 | quantized |" in ln]
    assert (
        f"| {cost['diff']:+.1f} [{cost['lo']:+.1f}, {cost['hi']:+.1f}] | {N} | {wording.p_text(cost['p_holm'])} |"
        in line
    )
    assert cost["diff"] == -50.0
    # Holm over every configuration near a target, the costs table's family (5 of them)
    assert f"Holm over the model's {len(a.costs)} configurations near a target" in text and len(a.costs) == 5
    assert "No configuration within ±25% of the target: combined at 1/4, combined at 1/8." in text
    assert f"[{eb.FOLDER}/]({eb.FOLDER}/{eb.MARKDOWN})" in text
    assert f"({eb.FOLDER}/equal_bytes_{slug(MODEL)}.png)" in text


def test_equal_bytes_section_links_the_speed_run_where_there_is_one(tmp_path):
    equal_bytes_folder(tmp_path)
    assert eb.SPEED not in eb.section(tmp_path)
    (tmp_path / eb.SPEED).mkdir(parents=True)
    assert f"[{eb.SPEED}/]({eb.SPEED}/README.md)" in eb.section(tmp_path)


def test_equal_bytes_reading_follows_holm_and_the_tost(tmp_path):
    equal_bytes_folder(tmp_path)
    text = eb.section(tmp_path)
    # every answer kept at a quarter of the bytes: "same" only through the TOST
    assert (
        f"same within ±{wording.MARGIN:g} by a TOST: quantized at 1/4 full + kivi-4 +0.0 (TOST p = <0.001"
        in text
    )
    # half the answers lost at 1/8: below zero with Holm's p
    assert "below zero: quantized at 1/8 full + kivi-2 -50.0 (p = 0.00" in text
    # two answers of 20 lost (McNemar p = 0.5): no difference detected, never "below"
    assert "no difference detected: " in text and "eviction at 1/8 snapkv b=512 w=32 -10.0 (p = " in text
    below = text.split("below zero: ", 1)[1].split(";", 1)[0]
    assert "snapkv b=512" not in below
    # the equal-bytes pairs, first minus second (quantized before eviction), by Holm's p
    assert "full + kivi-4 minus snapkv b=1024 w=32 +100.0" in text


def test_equal_bytes_table_follows_one_changed_score(tmp_path):
    before = eb.section(equal_bytes_folder(tmp_path / "a").parent)
    page.clear_cache()
    after = eb.section(equal_bytes_folder(tmp_path / "b", kivi2_wrong=11).parent)
    assert table_row(before, "1/8 | quantized")[6].startswith("-50.0")
    assert table_row(after, "1/8 | quantized")[6].startswith("-55.0")


def test_equal_bytes_section_says_no_rows_for_an_empty_folder(tmp_path):
    (tmp_path / eb.FOLDER).mkdir()
    text = eb.section(tmp_path)
    assert text.startswith("## Eviction or quantization at equal bytes?") and "No rows yet." in text


# ----------------------------------------------------------------------------------------- serving
SAMPLES = 8  # requests per point
# tokens/s per (config, concurrency) per round; the full cache serves 10 tokens/s everywhere
SPEED = {
    ("snapkv@256", 1): (9.0, 10.0, 11.0),  # ratios 0.9 / 1.0 / 1.1: the IQR straddles 1
    ("snapkv@256", 2): (11.0, 12.0, 13.0),  # ratios 1.1 / 1.2 / 1.3: pays
    ("snapkv@256", 4): (15.0, 15.0, 15.0),
    ("sum@256", 1): (9.0, 9.0, 9.0),
    ("sum@256", 2): (8.0, 11.0, 12.0),  # median above 1, the IQR not
    ("sum@256", 4): (9.0, 10.0, 10.5),
}


def serving_folder(
    root: Path, rounds: int = 3, flip: tuple[int, int] | None = None, search: bool = True
) -> Path:
    """results/serving/tiny: closed-loop points at concurrency 1, 2, 4 over `rounds` rounds; the full
    cache answers every request, snapkv@256 none, sum@256 all (`flip`: (round, sample) of sum@256
    answered wrong at concurrency 4)."""
    run = root / serving.FOLDER / "tiny"
    run.mkdir(parents=True)
    points, requests = [], []
    for r in range(rounds):
        for c in (1, 2, 4):
            for config in ("full", "snapkv@256", "sum@256"):
                mode, _, budget = config.partition("@")
                tps = 10.0 if config == "full" else SPEED[(config, c)][r]
                common = dict(round=r, arrival="closed", concurrency=c, config=config, mode=mode,
                              budget=int(budget) if budget else None)  # fmt: skip
                points.append(dict(common, order=0, requests=SAMPLES, completed=SAMPLES, ignored=0,
                                   tokens_per_s=tps, preemptions=0, pool_blocks=48, model="tiny.gguf", status="ok"))  # fmt: skip
                for i in range(SAMPLES):
                    ok = config != "snapkv@256" and (config, c, r, i) != ("sum@256", 4, *(flip or (-1, -1)))
                    requests.append(dict(common, request_id=i, sample_id=f"needle-{i}", status="finished",
                                         exact=1.0 if ok else 0.0, partial=1.0 if ok else 0.0))  # fmt: skip
    write_csv(run / "points.csv", points, POINT_COLUMNS)
    write_csv(run / "requests.csv", requests, REQUEST_COLUMNS)
    if search:
        found = [("full", 2, True), ("full", 3, False), ("snapkv@256", 4, True), ("sum@256", 2, False),
                 ("sum@256", 1, True)]  # fmt: skip
        write_csv(run / "search.csv", [dict(config=c, concurrency=k, ok=ok, preemptions=0 if ok else 2)
                                       for c, k, ok in found], SEARCH_COLUMNS)  # fmt: skip
    return run


def test_serving_pays_from_the_first_concurrency_whose_whole_iqr_is_above_one(tmp_path):
    serving_folder(tmp_path)
    text = serving.section(tmp_path)
    snap_row = table_row(text, "closed | snapkv@256")
    assert snap_row[2:5] == ["2", "2", "1.20 [1.15, 1.25] (3)"]
    # sum@256's median ratio at 2 is 1.1 but its IQR reaches below 1: it never pays
    sum_row = table_row(text, "closed | sum@256")
    assert sum_row[2:4] == ["not up to 4", "4"]
    assert "from 2: snapkv@256; at none run: sum@256." in text


def test_serving_accuracy_there_is_paired_on_the_same_requests_with_holm(tmp_path):
    serving_folder(tmp_path)
    text = serving.section(tmp_path)
    snap_row = table_row(text, "closed | snapkv@256")
    # every request lost: -100 over 24 pairs of 8 requests (a request's rounds one unit)
    assert snap_row[5:8] == ["0.0 (100.0)", "-100.0 [-100.0, -100.0]", "24 (8 units)"]
    assert (
        "below zero: closed snapkv@256 at 2 -100.0 (p = 0.016, n = 8)" in text
    )  # exact sign flip x Holm (2)
    assert f"same within ±{wording.MARGIN:g} by a TOST: closed sum@256 at 4 +0.0" in text
    assert "Holm over the table's 2 comparisons" in text


def test_serving_table_follows_one_changed_answer(tmp_path):
    before = serving.section(serving_folder(tmp_path / "a").parents[1])
    after = serving.section(serving_folder(tmp_path / "b", flip=(1, 3)).parents[1])
    assert table_row(before, "closed | sum@256")[6].startswith("+0.0")
    assert table_row(after, "closed | sum@256")[6].startswith("-4.2")  # 1 of 24 pairs


def test_serving_reads_no_iqr_from_one_round_and_the_search_limits(tmp_path):
    serving_folder(tmp_path, rounds=1)
    text = serving.section(tmp_path)
    assert table_row(text, "closed | snapkv@256")[2] == "not read (1 round)"
    assert (
        "Largest concurrency without preemption (closed loop, binary search): full 2; snapkv@256 4; sum@256 1."
        in text
    )


def test_serving_section_links_its_files_and_sits_before_speed_on_the_page(tmp_path):
    serving_folder(tmp_path, search=False)
    equal_bytes_folder(tmp_path)
    text = page.page(tmp_path, "", "<!-- b -->", "<!-- e -->")
    i, j, k = (
        text.index(t) for t in ("## Eviction or quantization", "## Where does eviction pay", "## Speed")
    )
    assert i < j < k
    serving = text[j:k]
    assert "[points.csv](serving/tiny/points.csv), [requests.csv](serving/tiny/requests.csv)" in serving
    assert "search.csv" not in serving and "without preemption" not in serving
    assert "tiny.gguf, 48 KV blocks, 3 rounds" in serving


def parity_rows(method: str, params: dict, scores: list[float], engine: str | None) -> list[dict]:
    """Needle rows of one config, `engine` naming the engine's rows (its own hash)."""
    out = []
    for i, s in enumerate(scores):
        r = base_row(f"len1000_depth{i}", "needle", "needle", method, params, s, prediction=f"answer {s}",
                     scores={"exact": s, "partial": s})  # fmt: skip
        if engine:
            r["engine"] = engine
            r["method_hash"] = config_hash({"method": method, "method_params": params, "engine": engine})
        out.append(r)
    return out


def test_parity_table_holds_the_engines_rows_against_the_harness_rows_beside_them(tmp_path):
    assert serving.parity_section(tmp_path) == []  # no engine rows: nothing
    harness_scores = [1.0] * 10 + [0.0] * 10
    write(tmp_path / serving.PARITY, parity_rows("full", {}, harness_scores, None)
          + parity_rows("snapkv", snap(512), [0.0] * 20, None))  # fmt: skip
    engine_scores = [*harness_scores[:18], 1.0, 1.0]  # two samples the other way
    write(tmp_path / serving.PARITY, parity_rows("full", {}, engine_scores, "openvino"))
    text = "\n".join(serving.section(tmp_path).splitlines())
    assert "### Does the engine agree with the harness?" in text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("| needle |") and "openvino full" in ln]
    cells = [c.strip() for c in line.strip("|").split("|")]
    # 20 pairs, 18 the same score and text, 2 flips towards the engine, 60 against 50
    assert cells[4:10] == ["20", "90%", "90%", "2", "0", "60.0"] and cells[10] == "50.0"


def test_readme_says_where_each_eviction_config_pays_from_the_rows(tmp_path):
    assert serving.readme_lines(tmp_path) == []
    serving_folder(tmp_path)
    (line,) = serving.readme_lines(tmp_path)
    assert line.startswith(
        "- tiny.gguf, a pool of 48 KV blocks, closed loop ([serving/tiny/](serving/tiny/)): "
    )
    assert "snapkv@256 pays from concurrency 2 (read at 2, throughput x1.20 [1.15, 1.25] (3)" in line
    assert "exact match -100.0 [-100.0, -100.0] vs the full cache's 100.0" in line
    assert "sum@256 pays at no concurrency up to 4 (read at 4" in line
    assert line.replace("serving/tiny/", "results/serving/tiny/") in page.readme_block(tmp_path)


def test_token_parity_csvs_become_a_line_each(tmp_path):
    folder = tmp_path / serving.PARITY
    folder.mkdir(parents=True)
    rows = [dict(model="m", weights="f16", sample_id=f"s{i}", input_tokens=1000, new_tokens=32, identical=True)
            for i in range(3)] + [dict(model="m", weights="f16", sample_id="s3", input_tokens=1000, new_tokens=32,
                                       identical=False, step=7, reference=1, engine=2, margin=0.25)]  # fmt: skip
    pd.DataFrame(rows).to_csv(folder / "tokens_m.csv", index=False)
    assert serving.token_line(folder / "tokens_m.csv") == (
        "- m (f16 weights; [tokens_m.csv](serving/parity/tokens_m.csv)): identical on 3 of 4 prompts (32 new "
        "tokens each); otherwise the first divergence at new token 7-7 (median 7), the harness' logit margin "
        "there 0.25-0.25 (median 0.25)."
    )


def test_the_search_is_read_beside_what_the_pool_holds(tmp_path):
    # 96 blocks of 32 tokens: a 1024 + 32-token request takes 33 blocks whole (2 fit); at budget
    # 256 its kept 8 blocks and the one being written (10 fit)
    assert serving.pool_capacity(96, 1024, 32, None, 32) == 2
    assert serving.pool_capacity(96, 1024, 32, 256, 32) == 10
    assert serving.pool_capacity(96, 100, 32, 256, 32) == 16  # under the budget: all 5 blocks + 1
    points = [{"config": "full", "budget": None, "pool_blocks": 96}, {"config": "snapkv@256", "budget": 256, "pool_blocks": 96}]  # fmt: skip
    requests = pd.DataFrame({"prompt_tokens": [1024, 1000], "output_tokens": [32, 32]})
    text = serving._capacity_text(points, requests, ["full", "snapkv@256"])
    assert "holds whole requests of 1024 + 32 tokens: full 2; snapkv@256 10" in text
    assert serving._capacity_text(points, pd.DataFrame(), ["full"]) == ""


def test_the_reference_clock_is_read_where_every_point_has_it(tmp_path):
    run = serving_folder(tmp_path)
    points = pd.read_csv(run / "points.csv")
    assert serving.throughput_column(points.to_dict("records")) == "tokens_per_s"
    # the same run timed against a reference: snapkv@256's ratio at 1 now clearly above 1
    ref = points.assign(ref_s=1.0, tokens_per_ref=points["tokens_per_s"])
    ref.loc[(ref["config"] == "snapkv@256") & (ref["concurrency"] == 1), "tokens_per_ref"] = 12.0
    ref.to_csv(run / "points.csv", index=False)
    text = serving.section(tmp_path)
    assert "reference-clock throughput ratio to full" in text
    assert table_row(text, "closed | snapkv@256")[2:5] == ["1", "1", "1.20 [1.20, 1.20] (3)"]
