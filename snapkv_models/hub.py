"""The Hugging Face Hub seen from the harness: one fast reachability probe before any Hub download.

Why: huggingface_hub retries a file it cannot fetch five times with backoff (1 + 2 + 4 + 8 + 8 s,
no setting to turn it off), so an endpoint that refuses connections costs 23 s per file before the
error, and transformers asks for some files twice. `hub_unavailable()` probes the endpoint
once per process; callers then load from the local cache only (`cache_only_kwargs()`).
`origin_aware_redirects()` makes huggingface_hub 1.30-1.x follow redirects within one origin only,
as 2.x does (docs/pitfalls.md).
"""

from __future__ import annotations

import functools
import logging
import socket
import urllib.request
from urllib.parse import urlsplit

from huggingface_hub import constants, file_download
from huggingface_hub.utils import _http

logger = logging.getLogger(__name__)


def hub_unavailable() -> str | None:
    """Why the Hub cannot be used now (offline mode, or the endpoint refuses connections), else None.

    The endpoint is `huggingface_hub.constants.ENDPOINT` (read from `HF_ENDPOINT` when
    huggingface_hub is imported); the probe runs once per process and endpoint. It checks whether
    the endpoint (or the proxy that `HTTPS_PROXY` / `HTTP_PROXY` / `NO_PROXY` route it through)
    accepts a TCP connection, waiting at most `HF_HUB_ETAG_TIMEOUT` seconds (huggingface_hub's own
    setting, default 10). No HTTP request is sent, so an endpoint that answers slowly counts as
    reachable and the download then runs with huggingface_hub's usual timeouts and retries. The
    stdlib does the probe because huggingface_hub's HTTP library differs between the versions
    transformers accepts (httpx in 1.x, httpx2 in 2.x). Callers that get a reason pass
    `local_files_only=True`, so cached files still load and a missing one fails at once; a cached
    model needs it too (its tokenizer's `additional_chat_templates` listing is retried otherwise).
    """
    origin_aware_redirects()  # every Hub download path asks this first
    if constants.is_offline_mode():
        return "offline mode is on (HF_HUB_OFFLINE=1)"
    return _probe(constants.ENDPOINT, float(constants.HF_HUB_ETAG_TIMEOUT))


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def _origin(url: str) -> tuple[str, str, int]:
    """`(scheme, host, port)` of `url`, with the scheme's default port when none is written."""
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port or _default_port(parts.scheme)


def _same_origin_or_hub(url: str, target: str) -> bool:
    """huggingface_hub 2.x's `_is_same_or_hub_host`: `target` has the origin of `url` or of a Hub
    endpoint (huggingface.co, its staging host, hf.co, `HF_ENDPOINT`)."""
    hub = (
        constants._HF_DEFAULT_ENDPOINT,
        constants._HF_DEFAULT_STAGING_ENDPOINT,
        constants.ENDPOINT,
        "https://hf.co",
    )
    return _origin(target) in {_origin(url), *map(_origin, hub)}


@functools.cache
def origin_aware_redirects() -> bool:
    """Make huggingface_hub judge a `/resolve` redirect by its origin (scheme, host, port); True when
    the installed release needed it (1.30-1.x), False when it already does or has no such check.

    Why: a `HEAD /resolve/...` of an LFS file answers 302 to storage (the real Hub: huggingface.co ->
    cdn-lfs.hf.co / cas-bridge.xethub.hf.co) and carries the file's metadata itself (`X-Repo-Commit`,
    `X-Linked-Etag`, `X-Linked-Size`). From 1.30 huggingface_hub follows redirects that stay on the Hub
    (`utils._http._is_same_or_hub_host`), comparing host names only; a redirect to another port of the
    same host (e.g. `127.0.0.1:8000` -> `127.0.0.1:9000`) is followed, the metadata is read from the
    storage's answer, which has no `X-Repo-Commit`, and the download fails (`LocalEntryNotFoundError`:
    "missing the 'X-Repo-Commit' header"), with the auth header sent to the storage too.
    huggingface_hub 2.x compares origins. transformers 5.2.0 requires huggingface_hub >=1.3,<2 (pip
    picks 1.33) and 5.24.0 still accepts >=1.31, so this installs 2.x's check, which follows fewer
    redirects, never more (huggingface/huggingface_hub#4942). Idempotent.
    """
    try:  # a version probe: the check exists from huggingface_hub 1.30 on
        from huggingface_hub.utils._http import _is_same_or_hub_host as check
    except ImportError:  # before 1.30: only relative redirects are followed, nothing to fix
        return False
    if not check("https://hub.invalid:1/a", "https://hub.invalid:2/b"):
        return False  # 2.x: origins already
    _http._is_same_or_hub_host = _same_origin_or_hub  # the redirect loop of HEAD /resolve
    # file_download imported it by name; it decides whether the download keeps the auth header
    file_download._is_same_or_hub_host = _same_origin_or_hub
    logger.debug("huggingface_hub's redirect check now compares origins (scheme, host, port), as in 2.x")
    return True


@functools.cache
def _probe(endpoint: str, timeout: float) -> str | None:
    """Open (and close) a TCP connection to `endpoint`, or to its proxy: None if accepted, else why not."""
    url = urlsplit(endpoint)
    host, port, via = url.hostname or "", url.port or _default_port(url.scheme), ""
    proxy = urllib.request.getproxies().get(url.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = p.hostname or "", p.port or _default_port(p.scheme)
        via = f" through the proxy {host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except TimeoutError:
        reason = (
            f"the Hub endpoint {endpoint} did not accept a connection{via} within {timeout:g} s "
            "(HF_HUB_ETAG_TIMEOUT)"
        )
    except OSError as err:  # refused, no route, name resolution failed
        reason = f"the Hub endpoint {endpoint} cannot be reached{via} ({err.strerror or err})"
    logger.warning("%s: using the local Hugging Face cache only", reason)
    return reason


def cache_only_kwargs() -> dict[str, bool]:
    """`{"local_files_only": True}` when the Hub cannot be used, else `{}`: extra keyword arguments for
    transformers' `from_pretrained(repo_id, ...)` and huggingface_hub's `hf_hub_download`."""
    return {"local_files_only": True} if hub_unavailable() else {}
