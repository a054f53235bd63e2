"""The `search` tool: a search backend behind a persistent cache.

`<search>query</search>` -> `Page {i}: {snippet}` lines (the original's format). Every
backend sits behind the SQLite cache (`appo.tools.search_cache`), keyed by backend, its
identity (corpus version, server URL), `max_results`, `result_length` and the normalised
query. `miss_policy="fail"` turns a cache miss into an error result instead of a backend
call, so a run can be replayed offline exactly.

Compatibility with the original config: `cache_file` pointing at a `.json` file (the
original's cache format) is imported into the SQLite cache at start-up.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from appo.errors import AppoError
from appo.tools.base import ToolResult
from appo.tools.search_backends import BACKENDS, BackendError
from appo.tools.search_cache import SearchCache, default_cache_path

log = logging.getLogger(__name__)

MISS_POLICIES = ("live", "fail")


class SearchTool:
    enforces_timeout = True  # backends use network timeouts; bm25 and the cache are local
    retry_timeouts = True  # a server that did not answer in time may answer a retry
    # The function schema of native call formats (appo.tools.formats.function_schema).
    description = "Search for documents about a query and return the best pages' snippets."
    argument = "query"
    argument_description = "The search query."

    def __init__(
        self,
        name: str = "search",
        tag: str | None = None,
        backend: str = "bm25",
        max_results: int = 10,
        result_length: int = 1000,
        cache: bool = True,
        cache_file: str | None = None,
        miss_policy: str = "live",
        timeout: float = 30.0,
        # bm25
        corpus: str | None = None,
        index_dir: str | None = None,
        # replay
        replay_file: str | None = None,
        # brightdata / http
        api_key_env: str = "BRIGHTDATA_API_KEY",
        zone: str | None = None,
        location: str = "cn",
        url: str | None = None,
    ):
        if backend not in BACKENDS:
            raise AppoError(f"unknown search backend {backend!r} "
                            f"(choose from {', '.join(sorted(BACKENDS))})")
        if miss_policy not in MISS_POLICIES:
            raise AppoError(f"bad search miss_policy {miss_policy!r} "
                            f"(choose from {', '.join(MISS_POLICIES)})")
        if max_results < 1 or result_length < 1:
            raise AppoError("search max_results and result_length must be >= 1")
        self.name = name
        self.tag = tag or name
        self.backend_name = "replay" if backend == "cache" else backend
        self.max_results = int(max_results)
        self.result_length = int(result_length)
        self.miss_policy = miss_policy
        original_json = None
        if cache_file is not None and Path(cache_file).suffix == ".json":
            original_json, cache_file = cache_file, None
            if backend in ("replay", "cache") and replay_file is None:
                replay_file = original_json
        if not cache and miss_policy == "fail":
            raise AppoError("search miss_policy 'fail' needs the cache (cache: true)")
        self.cache = SearchCache(cache_file or default_cache_path()) if cache else None
        backend_params = dict(corpus=corpus, index_dir=index_dir, replay_file=replay_file,
                              api_key_env=api_key_env, zone=zone, location=location, url=url,
                              timeout=timeout)
        backend_cls = BACKENDS[backend]
        # With miss_policy "fail" the backend is never called: do not start it (no index
        # build, no API key needed), but key entries exactly as a live run would.
        self.backend = None
        if miss_policy == "live":
            self.backend = backend_cls(**backend_params)
        self.key_params = {"max_results": self.max_results, "result_length": self.result_length,
                           **backend_cls.identity(**backend_params)}
        if original_json is not None and self.cache is not None:
            read, stored = self.cache.import_json(original_json, self.backend_name,
                                                  self.key_params)
            log.info("imported %d of %d entries from %s into %s", stored, read, original_json,
                     self.cache.path)

    def execute(self, content: str) -> ToolResult:
        start = time.monotonic()
        query = content.strip().replace('"', "")  # the original dropped double quotes
        if not query:
            return ToolResult("Error: empty search query.", ok=False, error_kind="error",
                              latency_s=time.monotonic() - start)
        if self.cache is not None:
            hit = self.cache.get(self.backend_name, self.key_params, query)
            if hit is not None:
                return ToolResult(hit, cached=True, latency_s=time.monotonic() - start)
        if self.backend is None:  # miss_policy == "fail"
            return ToolResult("Error: no cached search result for this query "
                              "(search miss_policy is 'fail').", ok=False, error_kind="error",
                              latency_s=time.monotonic() - start)
        try:
            text = self.backend.search(query, self.max_results, self.result_length)
        except BackendError as e:
            return ToolResult(f"Error: search failed ({e}).", ok=False, error_kind=e.kind,
                              latency_s=time.monotonic() - start)
        if self.cache is not None:
            self.cache.put(self.backend_name, self.key_params, query, text)
        return ToolResult(text, latency_s=time.monotonic() - start)

    def close(self) -> None:
        if self.cache is not None:
            self.cache.close()
