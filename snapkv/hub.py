"""The Hugging Face Hub seen from the harness: one fast reachability probe before any Hub download.

Why: when huggingface_hub cannot fetch a file that is not cached, it retries it five times with
backoff (1 + 2 + 4 + 8 + 8 s, `_hf_hub_download_to_cache_dir(..., retry_on_errors=True)`), per
file, and has no setting to turn that off. transformers asks for a model's `config.json` twice
(tokenizer, then model) before giving up, so an endpoint that refuses connections cost ~50 s
before the error for a model id and ~25 s for LongBench's `data.zip`.

What: `hub_unavailable()` probes the endpoint once per process (`HEAD {HF_ENDPOINT}/`, any HTTP
answer counts, however slow) and, when nothing answers, says why; callers then pass
`local_files_only=True` (`cache_only_kwargs()`), so cached files still load and a missing one fails
at once. The probe
goes through huggingface_hub's own HTTP client (proxies, certificates and `set_client_factory`
apply) and waits at most `HF_HUB_ETAG_TIMEOUT` seconds (huggingface_hub's own setting, default 10)
to connect. An endpoint that accepts the connection but answers slowly is reachable: the probe
stops waiting after `PROBE_READ_TIMEOUT` seconds and the download itself then runs with
huggingface_hub's usual timeouts and retries.
"""

from __future__ import annotations

import functools
import logging

logger = logging.getLogger(__name__)

# Seconds the probe waits for an answer once connected; waiting longer proves nothing more.
PROBE_READ_TIMEOUT = 1.0


def hub_unavailable() -> str | None:
    """Why the Hub cannot be used now (offline mode, or the endpoint does not answer), else None.

    The endpoint is `huggingface_hub.constants.ENDPOINT` (read from `HF_ENDPOINT` when
    huggingface_hub is imported); the probe runs once per process and endpoint.
    """
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return "offline mode is on (HF_HUB_OFFLINE=1)"
    return _probe(constants.ENDPOINT, float(constants.HF_HUB_ETAG_TIMEOUT))


@functools.cache
def _probe(endpoint: str, connect_timeout: float) -> str | None:
    """`HEAD {endpoint}/`: None when anything answers (any status, or a slow answer), else the reason."""
    import httpx2
    from huggingface_hub import get_session

    timeout = httpx2.Timeout(PROBE_READ_TIMEOUT, connect=connect_timeout)
    try:
        get_session().head(f"{endpoint}/", timeout=timeout, follow_redirects=False)
    except (httpx2.ReadTimeout, httpx2.RemoteProtocolError):
        return None  # connected, the server is slow or odd: let huggingface_hub deal with it
    except httpx2.ConnectTimeout:
        reason = (
            f"the Hub endpoint {endpoint} did not answer within {connect_timeout:g} s (HF_HUB_ETAG_TIMEOUT)"
        )
    except httpx2.ConnectError as err:
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
        reason = f"the Hub endpoint {endpoint} cannot be reached ({detail})"
    else:
        return None
    logger.warning("%s: using the local Hugging Face cache only", reason)
    return reason


def cache_only_kwargs() -> dict[str, bool]:
    """`{"local_files_only": True}` when the Hub cannot be used, else `{}`: extra keyword arguments for
    transformers' `from_pretrained(repo_id, ...)` and huggingface_hub's `hf_hub_download`."""
    return {"local_files_only": True} if hub_unavailable() else {}
