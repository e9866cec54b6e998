"""Score stored predictions again with the task's current scorer, without generating again.

    python scripts/rescore.py RESULTS_DIR [task.key=value ...] [model.key=value ...]

A scorer fix (say, a better final-answer extraction) should not cost the generations. For every
rows file under RESULTS_DIR, the task named in its rows is rebuilt from conf/task/<task>.yaml with
the given overrides (those of the command that wrote the rows, e.g. `task.samples=4`) and the
rows' model's tokenizer; each ok row is rescored from its `prediction` only when its
`prompt_sha` / `target_sha` equal the rebuilt sample's, so overrides that describe another run are
refused (ValueError) rather than scoring rows against the wrong answers. Rows whose score changes
get `rescored` (commit, dirty flag, time, the score before); the file is replaced atomically, in its order.
Rows of a task that generates nothing (`Task.generates` false: `fidelity`, scored from the model's
distributions) are left as they are.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from eval.conf import CONF_DIR, options
from eval.provenance import git_state, utc_now
from eval.runner import load_tokenizer, prompt_sha
from eval.spec import RunSpec
from eval.store import _json_default, read_rows, target_sha

logger = logging.getLogger(__name__)


def _spec(task: str, model: str, model_path: str, overrides: list[str]) -> RunSpec:
    # A model of conf/model/ by its config name; any other (a local directory) by its path.
    chosen = f"model={model}" if model in options("model") else f"model.name={model_path}"
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"task={task}", chosen, *overrides])
    return RunSpec.from_config(cfg)


def _one(rows: list[dict], key: str, path: Path) -> Any:
    values = {r.get(key) for r in rows}
    if len(values) != 1:
        raise ValueError(
            f"{path}: rows of several {key}s {sorted(map(str, values))}; rescore one config per file"
        )
    return values.pop()


def prompt_id(row: dict) -> str:
    """The sample a row answered (sampled rows are "<prompt_id>#<i>")."""
    return row.get("prompt_id") or row["sample_id"]


def rescore_file(path: Path, overrides: list[str]) -> tuple[int, int]:
    """Rescore one rows file in place; (ok rows checked, rows whose score changed)."""
    rows = read_rows(path)
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return 0, 0
    spec = _spec(_one(ok, "task", path), _one(ok, "model", path), _one(ok, "model_path", path), overrides)
    if not spec.task.generates:  # scored from the model's distributions, not from a stored text
        logger.info(
            "%s: task %r scores no stored prediction; its rows are left as they are", path, spec.task.name
        )
        return len(ok), 0
    tokenizer = load_tokenizer(spec.model.name)
    samples = {s.sample_id: s for s in spec.task.samples(tokenizer)}
    state = git_state()
    changed = 0
    for row in ok:
        sample = samples.get(prompt_id(row))
        if sample is None:
            raise ValueError(
                f"{path}: sample {prompt_id(row)!r} is not in the rebuilt task; pass the run's task overrides"
            )
        chat = bool(sample.chat_template and spec.model.chat_template)
        for key, want in (
            ("prompt_sha", prompt_sha(tokenizer, sample, chat)),
            ("target_sha", target_sha(sample.answers)),
        ):
            if row.get(key) is not None and row[key] != want:
                raise ValueError(
                    f"{path}: {key} of {row['sample_id']!r} differs from the rebuilt sample's; pass the run's task overrides"
                )
        score = float(spec.task.score(sample, row["prediction"]))
        scores = {k: float(v) for k, v in spec.task.score_all(sample, row["prediction"]).items()}
        if score != row["score"] or scores != row.get("scores"):
            row["rescored"] = {
                "git_sha": state["git_sha"], "git_dirty": state["git_dirty"], "git_diff_sha": state["git_diff_sha"],
                "timestamp": utc_now(), "score_before": row["score"],
            }  # fmt: skip
            row["score"], row["scores"] = score, scores
            changed += 1
    if changed:
        text = "".join(json.dumps(r, ensure_ascii=False, default=_json_default) + "\n" for r in rows)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return len(ok), changed


def rescore_dir(results_dir: str | os.PathLike, overrides: list[str]) -> dict[Path, tuple[int, int]]:
    """`rescore_file` for every `*.jsonl` under `results_dir`; {path: (checked, changed)}."""
    root = Path(results_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"results dir {str(root)!r} does not exist")
    bad = [o for o in overrides if not o.startswith(("task.", "model."))]
    if bad:
        raise ValueError(f"rescore takes task.* and model.* overrides only, got {bad[0]!r}")
    out: dict[Path, tuple[int, int]] = {}
    for path in sorted(root.rglob("*.jsonl")):
        out[path] = rescore_file(path, overrides)
        logger.info("%s: %d ok rows, %d rescored", path, *out[path])
    return out
