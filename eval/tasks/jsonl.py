"""JSON-lines files the tasks read (LongBench records, RULER files, reasoning problems): one JSON
object per line, blank lines skipped, every error naming the file and line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def numbered_records(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield `(line number, record)` for each JSON object of a jsonl file; ValueError
    `"{path}:{line}: ..."` for a malformed line or a line that is not an object."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: malformed JSON line ({err.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            yield lineno, record


def read_jsonl(path: str | os.PathLike, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """Yield the records of a jsonl file (blank lines skipped), at most `limit` of them."""
    if limit is not None and limit <= 0:
        return
    for count, (_, record) in enumerate(numbered_records(path), start=1):
        yield record
        if limit is not None and count >= limit:
            return
