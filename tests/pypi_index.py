"""A package index on 127.0.0.1 for tests of the wheel downloads (pip and the urllib fallback).

`LocalIndex` serves a PEP 503 simple index (`/simple/<project>/` pages with `#sha256=` links) and
the wheels under `/files/`, from a folder, in a background thread; `add_wheel` builds a minimal but
valid wheel in code. Point the code at it with `PIP_INDEX_URL` (both download paths read it).
"""

from __future__ import annotations

import hashlib
import http.server
import re
import threading
import zipfile
from functools import partial
from pathlib import Path


def build_wheel(folder: Path, project: str, version: str, files: dict[str, bytes]) -> Path:
    """A pure-Python wheel `<project>-<version>-py3-none-any.whl` holding `files` (path -> bytes)."""
    dist = re.sub(r"[-_.]+", "_", project)
    info = f"{dist}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{p},,\n" for p in files) + f"{info}/RECORD,,\n"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/RECORD", record)
    return path


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep test output clean
        pass

    def do_GET(self) -> None:
        self.server.requests.append(self.path)  # type: ignore[attr-defined]
        super().do_GET()


class LocalIndex:
    """A simple index served from `root`; `url` is its `/simple` address, `requests` the paths asked."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "files").mkdir(parents=True, exist_ok=True)
        self.server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), partial(_Handler, directory=str(root))
        )
        self.server.requests = []  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/simple"

    @property
    def requests(self) -> list[str]:
        return self.server.requests  # type: ignore[attr-defined]

    def add_wheel(self, project: str, version: str, files: dict[str, bytes]) -> Path:
        """Build a wheel and list it on the project's simple page (with its sha256)."""
        wheel = build_wheel(self.root / "files", project, version, files)
        page = self.root / "simple" / re.sub(r"[-_.]+", "-", project).lower()
        page.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        links = (page / "index.html").read_text() if (page / "index.html").exists() else ""
        links += f'<a href="../../files/{wheel.name}#sha256={digest}">{wheel.name}</a>\n'
        (page / "index.html").write_text(links)
        return wheel

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
