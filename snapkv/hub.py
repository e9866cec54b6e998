"""The Hugging Face Hub seen from the harness: one fast reachability probe before any Hub download.

Why: when huggingface_hub cannot fetch a file that is not cached, it retries it five times with
backoff (1 + 2 + 4 + 8 + 8 s, `_hf_hub_download_to_cache_dir(..., retry_on_errors=True)`), per
file, and has no setting to turn that off. transformers' `AutoTokenizer.from_pretrained` asks for
`config.json` twice (`AutoConfig`, then `PreTrainedConfig` after the OSError), so an endpoint that
refuses connections cost 2 x 23 s before the error for a model id and 23 s for LongBench's
`data.zip`. A cached model paid too: its tokenizer's `additional_chat_templates` listing is retried.

What: `hub_unavailable()` checks once per process whether the endpoint (`HF_ENDPOINT`, or the
proxy that `HTTPS_PROXY` / `HTTP_PROXY` / `NO_PROXY` route it through) accepts a TCP connection, and
when it does not, says why; callers then pass `local_files_only=True` (`cache_only_kwargs()`), so
cached files still load and a missing one fails at once. A connection is all it asks for: no HTTP
request is sent, so an endpoint that answers slowly counts as reachable and the download then runs
with huggingface_hub's usual timeouts and retries. The connect waits at most `HF_HUB_ETAG_TIMEOUT`
seconds (huggingface_hub's own setting, default 10). The stdlib does the probe because
huggingface_hub's HTTP library changed between the versions transformers accepts (httpx in 1.x,
httpx2 in 2.x).
"""

from __future__ import annotations

import functools
import logging
import socket
import urllib.request
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)


def hub_unavailable() -> str | None:
    """Why the Hub cannot be used now (offline mode, or the endpoint refuses connections), else None.

    The endpoint is `huggingface_hub.constants.ENDPOINT` (read from `HF_ENDPOINT` when
    huggingface_hub is imported); the probe runs once per process and endpoint.
    """
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return "offline mode is on (HF_HUB_OFFLINE=1)"
    return _probe(constants.ENDPOINT, float(constants.HF_HUB_ETAG_TIMEOUT))


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


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
