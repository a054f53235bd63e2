"""A small JSON-over-HTTP client for OpenAI-compatible servers (vLLM, llama.cpp, hosted APIs).

Standard library only (urllib), so the evaluator needs no HTTP package. Failures become
`HttpError` with a one-line message (status, endpoint, the start of the server's reply);
the API key (from `$OPENAI_API_KEY`) goes into the Authorization header and nowhere else:
not into messages, logs or result files. Timeouts, connection failures, HTTP 408/429 and
5xx are retried with a short backoff; other 4xx replies are the request's fault, and a reply
that is not JSON is the server's, so neither is.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

from appo.errors import AppoError

API_KEY_ENV = "OPENAI_API_KEY"
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class HttpError(Exception):
    """A failed request. `status` is the HTTP status (None: no reply); `retryable` says
    whether trying again may help (timeouts, connection failures, 408/429/5xx)."""

    def __init__(self, message: str, status: int | None = None, retryable: bool = False):
        super().__init__(message)
        self.status = status
        self.retryable = retryable


def api_key_from_env() -> str | None:
    return os.environ.get(API_KEY_ENV) or None


def endpoint(base_url: str, path: str) -> str:
    """`{base_url}/v1/{path}`; a base URL that already ends in `/v1` is not doubled."""
    base = base_url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return f"{base}/{path.lstrip('/')}"


class JsonClient:
    def __init__(self, timeout: float = 120.0, retries: int = 2, backoff_s: float = 0.5,
                 api_key: str | None = None):
        self.timeout = float(timeout)
        self.retries = max(0, int(retries))
        self.backoff_s = backoff_s
        self._api_key = api_key if api_key is not None else api_key_from_env()

    def __repr__(self) -> str:  # never show the key
        return f"JsonClient(timeout={self.timeout}, retries={self.retries})"

    def _request(self, url: str, payload: dict | None) -> urllib.request.Request:
        headers = {"Accept": "application/json"}
        data = None
        if payload is not None:
            data = json.dumps(payload).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return urllib.request.Request(url, data=data, headers=headers,
                                      method="POST" if payload is not None else "GET")

    def _once(self, url: str, payload: dict | None, empty_ok: bool = False) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self._request(url, payload), timeout=self.timeout) as r:
                body = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode("utf-8", "replace").strip().replace("\n", " ")
            raise HttpError(f"HTTP {e.code} from {url}: {detail or e.reason}", e.code,
                            retryable=e.code in RETRY_STATUSES) from None
        except TimeoutError:
            raise HttpError(f"timed out after {self.timeout:g} s waiting for {url}",
                            retryable=True) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise HttpError(f"timed out after {self.timeout:g} s waiting for {url}",
                                retryable=True) from None
            raise HttpError(f"cannot reach {url}: {e.reason}", retryable=True) from None
        except (ConnectionError, OSError) as e:
            raise HttpError(f"connection to {url} failed: {type(e).__name__}: {e}",
                            retryable=True) from None
        if empty_ok and not body.strip():
            return {}  # a bare 200 (e.g. vLLM's /collective_rpc when no worker returns data)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            snippet = body[:200].decode("utf-8", "replace")
            raise HttpError(f"{url} returned non-JSON: {snippet!r}") from None
        if not isinstance(data, dict):
            raise HttpError(f"{url} returned JSON {type(data).__name__}, expected an object")
        return data

    def call(self, url: str, payload: dict | None = None,
             empty_ok: bool = False) -> dict[str, Any]:
        """POST `payload` (GET when None) and return the JSON reply; HttpError after retries.
        `empty_ok`: an empty reply body is `{}` rather than an error."""
        for attempt in range(self.retries + 1):
            try:
                return self._once(url, payload, empty_ok)
            except HttpError as e:
                if not e.retryable or attempt == self.retries:
                    raise
                time.sleep(self.backoff_s * (2**attempt))
        raise AssertionError("unreachable")


def served_model(client: JsonClient, base_url: str) -> str:
    """The first model an OpenAI-compatible server lists (`GET /v1/models`)."""
    url = endpoint(base_url, "models")
    try:
        data = client.call(url)
    except HttpError as e:
        raise AppoError(f"cannot list the models served at {base_url} ({e}); is the server "
                        "up? Name the model explicitly") from None
    models = data.get("data") or []
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise AppoError(f"{url} lists no models; name the model explicitly")
    return str(models[0]["id"])
