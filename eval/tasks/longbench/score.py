"""Score LongBench-format predictions: `python scripts/score_longbench.py PRED_DIR [--e]`.

Reads `PRED_DIR/<dataset>.jsonl` (one JSON object per line with `pred`, `answers`, `all_classes`
and, for `--e`, `length`), writes `PRED_DIR/result.json` as LongBench's eval.py does (dataset ->
score, or with `--e` dataset -> {"0-4k", "4-8k", "8k+"}) and prints it. As in LongBench, the
`all_classes` of a file's last line is used for the whole file. An empty `--e` bucket (NaN in
LongBench) is written as `null`, so result.json is strict JSON. An existing result.json is never
overwritten silently: pass `--force` to replace it.
Files whose stem is not a LongBench English dataset are skipped with a message on stderr.
Bad input (missing directory, malformed line, missing key, ...) exits with code 2 and one line on
stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eval.tasks.longbench.metrics import DATASET2METRIC, scorer, scorer_e

RESULT_FILE = "result.json"
REQUIRED_KEYS = ("pred", "answers", "all_classes")


class PredictionFileError(ValueError):
    """Bad prediction input; the message names the file (and line) at fault."""


@dataclass
class Predictions:
    """One dataset's predictions, read from a LongBench-format jsonl file."""

    predictions: list[str]
    answers: list[list[str]]
    lengths: list[float]
    all_classes: list[str] | None


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_record(record: object, where: str, require_length: bool) -> dict:
    """Validate one parsed line; raise PredictionFileError naming `where` (file:line)."""
    if not isinstance(record, dict):
        raise PredictionFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
    keys = REQUIRED_KEYS + (("length",) if require_length else ())
    missing = [k for k in keys if k not in record]
    if missing:
        raise PredictionFileError(f"{where}: missing key(s) {', '.join(map(repr, missing))}")
    if not isinstance(record["pred"], str):
        raise PredictionFileError(f"{where}: 'pred' must be a string")
    if not _is_str_list(record["answers"]):
        raise PredictionFileError(f"{where}: 'answers' must be a list of strings")
    if record["all_classes"] is not None and not _is_str_list(record["all_classes"]):
        raise PredictionFileError(f"{where}: 'all_classes' must be null or a list of strings")
    if require_length:
        length = record["length"]
        if isinstance(length, bool) or not isinstance(length, int | float):
            raise PredictionFileError(f"{where}: 'length' must be a number")
    return record


def read_predictions(path: Path, require_length: bool = False) -> Predictions:
    """Read and validate one `<dataset>.jsonl`; blank lines are ignored."""
    out = Predictions([], [], [], None)
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    parsed = json.loads(line)
                except json.JSONDecodeError as err:
                    raise PredictionFileError(
                        f"{where}: malformed JSON ({err.msg} at column {err.colno})"
                    ) from None
                record = _check_record(parsed, where, require_length)
                out.predictions.append(record["pred"])
                out.answers.append(record["answers"])
                out.all_classes = record["all_classes"]  # LongBench keeps the last line's
                if "length" in record:
                    out.lengths.append(record["length"])
    except UnicodeDecodeError as err:
        raise PredictionFileError(f"{path}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    except OSError as err:
        raise PredictionFileError(f"{path}: cannot read ({err.strerror or err})") from None
    if not out.predictions:
        raise PredictionFileError(f"{path}: no predictions in file")
    return out


def score_dir(pred_dir: Path, longbench_e: bool = False) -> dict[str, float | dict[str, float]]:
    """Score every `<dataset>.jsonl` of `pred_dir` (sorted by name); unknown stems are skipped."""
    if not pred_dir.is_dir():
        what = "does not exist" if not pred_dir.exists() else "is not a directory"
        raise PredictionFileError(f"prediction directory {pred_dir} {what}")
    scores: dict[str, float | dict[str, float]] = {}
    for path in sorted(pred_dir.glob("*.jsonl")):
        dataset = path.stem
        if dataset not in DATASET2METRIC:
            print(f"skipping {path.name}: {dataset!r} is not a LongBench English dataset", file=sys.stderr)
            continue
        data = read_predictions(path, require_length=longbench_e)
        try:
            if longbench_e:
                scores[dataset] = scorer_e(
                    dataset, data.predictions, data.answers, data.lengths, data.all_classes
                )
            else:
                scores[dataset] = scorer(dataset, data.predictions, data.answers, data.all_classes)
        except ValueError as err:  # e.g. trec without all_classes, retrieval answer without "Paragraph N"
            raise PredictionFileError(f"{path}: {err}") from None
    if not scores:
        raise PredictionFileError(f"no LongBench <dataset>.jsonl prediction files in {pred_dir}")
    return scores


def strict_json(scores: dict) -> dict:
    """NaN / infinite scores (an empty LongBench-E bucket) -> None, i.e. `null` in JSON."""

    def fix(v):
        if isinstance(v, dict):
            return {k: fix(x) for k, x in v.items()}
        return None if isinstance(v, float) and not math.isfinite(v) else v

    return fix(scores)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0 ok, 2 bad input)."""
    parser = argparse.ArgumentParser(  # prog: the command or script run
        description="Score LongBench prediction files PRED_DIR/<dataset>.jsonl into PRED_DIR/result.json.",
    )
    parser.add_argument("pred_dir", type=Path, metavar="PRED_DIR", help="folder of <dataset>.jsonl files")
    parser.add_argument("--e", action="store_true", help="LongBench-E: score per length bucket 0-4k/4-8k/8k+")
    parser.add_argument("--force", action="store_true", help=f"overwrite an existing PRED_DIR/{RESULT_FILE}")
    args = parser.parse_args(argv)
    try:
        out_path = args.pred_dir / RESULT_FILE
        if out_path.exists() and not args.force:
            raise PredictionFileError(f"{out_path} exists; pass --force to overwrite it")
        scores = strict_json(score_dir(args.pred_dir, longbench_e=args.e))
        try:
            with out_path.open("w", encoding="utf-8") as f:
                json.dump(scores, f, ensure_ascii=False, indent=4, allow_nan=False)
        except OSError as err:
            raise PredictionFileError(f"{out_path}: cannot write ({err.strerror or err})") from None
    except PredictionFileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(scores, ensure_ascii=False, indent=4, allow_nan=False))
    return 0
