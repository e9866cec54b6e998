"""A Hugging Face Hub look-alike on 127.0.0.1 for tests: in-memory repos served to huggingface_hub.

huggingface_hub ships no test server or mocking helper (its own tests run against the staging Hub,
hub-ci.huggingface.co), so this implements the routes that the harness's download paths use
(transformers `from_pretrained` by Hub id, `hf_hub_download` of a dataset file), with the headers
huggingface_hub checks:

- `HEAD|GET /{repo}/resolve/{revision}/{path}` (models) and `/datasets/{repo}/resolve/...`:
  `X-Repo-Commit`, `ETag` (git blob sha1), `Content-Length`. "LFS" files (`.safetensors`, `.zip`,
  `.bin`, `.gguf`) answer with a 302 to `/lfs/<sha256>` on a second port (another origin, as the
  Hub redirects to its CDN host) carrying `X-Linked-Etag` / `X-Linked-Size`: huggingface_hub takes
  the metadata from the redirect itself and downloads from the CDN without the auth header.
  `cdn_host` names the CDN in that redirect: "127.0.0.1" (default: the Hub's host on another port,
  as a local or on-prem Hub whose storage listens on a port of its own) or "localhost" (another
  host name, as huggingface.co -> cdn-lfs.hf.co). huggingface_hub 1.30-1.x took the first for a
  redirect within the Hub and followed it (fixed by `snapkv_models.hub.origin_aware_redirects`).
- A missing file: 404 `X-Error-Code: EntryNotFound` (with `X-Repo-Commit`); a missing repo: 401
  `RepoNotFound` (what the Hub answers for missing, private and gated repos alike); an unknown
  revision: 404 `RevisionNotFound`.
- `GET /api/{models|datasets}/{repo}[/revision/{rev}]` (repo info with `sha` and `siblings`) and
  `GET /api/{models|datasets}/{repo}/tree/{rev}[/{path}]` (file listings), and
  `GET /api/agent-harnesses` (huggingface_hub's user-agent registry; served empty).

Every request is recorded in `HubServer.requests`; requests this server does not understand get a
404 and are also recorded in `HubServer.unhandled`, so that a test can assert there were none.
`delay` seconds are slept before every answer (a slow but answering endpoint).

    with HubServer({("model", "org/tiny"): {"config.json": b"{...}"}}) as hub:
        env["HF_ENDPOINT"] = hub.url
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".zip", ".gguf")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob: what the Hub returns as the ETag of a non-LFS file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Repo:
    """One repo's files at one commit (the commit id is derived from the contents)."""

    def __init__(self, files: dict[str, bytes]):
        self.files = dict(files)
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + b"\0" + git_blob_sha1(self.files[name]).encode())
        self.commit = digest.hexdigest()

    @classmethod
    def from_dir(cls, directory: str | Path) -> Repo:
        root = Path(directory)
        return cls({p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()})


class HubServer:
    """Serves `repos` ({(repo_type, repo_id): {path: bytes}}, repo_type "model" or "dataset")."""

    def __init__(
        self,
        repos: dict[tuple[str, str], dict[str, bytes] | Repo],
        delay: float = 0.0,
        cdn_host: str = "127.0.0.1",
    ):
        if cdn_host not in ("127.0.0.1", "localhost"):  # both reach the CDN's 127.0.0.1 socket
            raise ValueError(f"cdn_host must be '127.0.0.1' or 'localhost', got cdn_host={cdn_host!r}")
        self.repos = {key: r if isinstance(r, Repo) else Repo(r) for key, r in repos.items()}
        self.delay = delay
        self.cdn_host = cdn_host
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        self.blobs = {
            hashlib.sha256(data).hexdigest(): data
            for repo in self.repos.values()
            for data in repo.files.values()
        }
        self._servers: list[ThreadingHTTPServer] = []  # the Hub, then its "CDN"

    @property
    def url(self) -> str:
        """The endpoint, for `HF_ENDPOINT`."""
        return self._address(0)

    @property
    def cdn_url(self) -> str:
        """The CDN as the Hub's LFS redirects name it: `cdn_host` and the CDN's port."""
        return f"http://{self.cdn_host}:{urlsplit(self._address(1)).port}"

    def _address(self, i: int) -> str:
        if not self._servers:
            raise RuntimeError("HubServer is not running; use it as a context manager or call start()")
        host, port = self._servers[i].server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        server = self

        class Handler(_Handler):
            hub = server

        for name in ("hub-server", "hub-cdn"):
            httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            httpd.daemon_threads = True
            threading.Thread(target=httpd.serve_forever, name=name, daemon=True).start()
            self._servers.append(httpd)
        return self

    def stop(self) -> None:
        """Stop answering: the port refuses connections afterwards (an unreachable endpoint)."""
        for httpd in self._servers:
            httpd.shutdown()
            httpd.server_close()
        self._servers = []

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def paths_requested(self, method: str | None = None) -> list[str]:
        return [p for m, p in self.requests if method is None or m == method]


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args) -> None:  # quiet: requests are recorded in hub.requests
        pass

    def do_HEAD(self) -> None:
        self._dispatch(body=False)

    def do_GET(self) -> None:
        self._dispatch(body=True)

    # ----------------------------------------------------------------------------------- routing
    def _dispatch(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.requests.append((self.command, path))
        if self.hub.delay:
            time.sleep(self.hub.delay)
        parts = [p for p in path.split("/") if p]
        if parts[:1] == ["lfs"] and len(parts) == 2:
            return self._lfs(parts[1], body)
        if parts == ["api", "agent-harnesses"]:
            return self._send_json(200, {}, {"standardEnvVars": [], "harnesses": {}}, body)
        if parts[:1] == ["api"] and len(parts) >= 4 and parts[1] in ("models", "datasets"):
            return self._api("model" if parts[1] == "models" else "dataset", parts[2:], body)
        repo_type = "model"
        if parts[:1] == ["datasets"]:
            repo_type, parts = "dataset", parts[1:]
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(repo_type, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        self.hub.unhandled.append((self.command, path))
        self._send(404, {"X-Error-Message": "not served by tests/hub_server.py"}, b"", body)

    def _repo(self, repo_type: str, repo_id: str, revision: str) -> Repo | None:
        repo = self.hub.repos.get((repo_type, repo_id))
        if repo is None:
            self._send(
                401, {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"}, b"", True
            )
            return None
        if revision not in ("main", repo.commit):
            self._send(
                404, {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"}, b"", True
            )
            return None
        return repo

    def _resolve(self, repo_type: str, repo_id: str, revision: str, filename: str, body: bool) -> None:
        repo = self._repo(repo_type, repo_id, revision)
        if repo is None:
            return
        headers = {"X-Repo-Commit": repo.commit}
        data = repo.files.get(filename)
        if data is None:
            headers.update({"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"})
            return self._send(404, headers, b"", body)
        if filename.endswith(LFS_SUFFIXES):
            sha256 = hashlib.sha256(data).hexdigest()
            headers.update(
                {
                    "Location": f"{self.hub.cdn_url}/lfs/{sha256}",
                    "X-Linked-Etag": f'"{sha256}"',
                    "X-Linked-Size": str(len(data)),
                    "ETag": f'"{git_blob_sha1(data)}"',
                }
            )
            return self._send(302, headers, b"", body)
        headers["ETag"] = f'"{git_blob_sha1(data)}"'
        self._send(200, headers, data, body, content_type="application/octet-stream")

    def _lfs(self, sha256: str, body: bool) -> None:
        data = self.hub.blobs.get(sha256)
        if data is None:
            return self._send(404, {}, b"", body)
        self._send(200, {"ETag": f'"{sha256}"'}, data, body, content_type="application/octet-stream")

    def _api(self, repo_type: str, parts: list[str], body: bool) -> None:
        repo_id, rest = "/".join(parts[:2]), parts[2:]
        revision = "main"
        if rest[:1] in (["revision"], ["tree"]) and len(rest) >= 2:
            revision = rest[1]
        repo = self._repo(repo_type, repo_id, revision)
        if repo is None:
            return
        headers = {"X-Repo-Commit": repo.commit}
        if not rest or rest[0] == "revision":
            info = {
                "id": repo_id,
                "sha": repo.commit,
                "private": False,
                "gated": False,
                "disabled": False,
                "siblings": [{"rfilename": name} for name in sorted(repo.files)],
            }
            return self._send_json(200, headers, info, body)
        if rest[0] == "tree":
            prefix = "/".join(rest[2:])
            entries = _tree(repo, prefix)
            if entries is None:
                headers.update({"X-Error-Code": "EntryNotFound", "X-Error-Message": "Entry not found"})
                return self._send(404, headers, b"", body)
            return self._send_json(200, headers, entries, body)
        self.hub.unhandled.append((self.command, self.path))
        self._send(404, {}, b"", body)

    # ----------------------------------------------------------------------------------- answers
    def _send_json(self, status: int, headers: dict[str, str], obj, body: bool) -> None:
        self._send(status, headers, json.dumps(obj).encode(), body, content_type="application/json")

    def _send(
        self, status: int, headers: dict[str, str], data: bytes, body: bool, content_type: str = ""
    ) -> None:
        try:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            if content_type:
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body and data:
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped waiting (a probe of a slow server)


def _tree(repo: Repo, prefix: str) -> list[dict] | None:
    """The Hub's tree listing of the folder `prefix` (not recursive); None when it does not exist."""
    prefix = prefix.strip("/")
    under = [n for n in repo.files if not prefix or n.startswith(prefix + "/")]
    if prefix and not under:
        return None
    entries, folders = [], set()
    for name in sorted(under):
        rel = name[len(prefix) + 1 :] if prefix else name
        if "/" in rel:
            folders.add(rel.split("/", 1)[0])
            continue
        data = repo.files[name]
        entry = {"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": name}
        if name.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        entries.append(entry)
    for folder in sorted(folders):
        path = f"{prefix}/{folder}" if prefix else folder
        entries.append(
            {"type": "directory", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": 0, "path": path}
        )
    return entries
