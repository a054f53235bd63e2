"""The `search` tool: a search backend behind a persistent cache.

`<search>query</search>` -> `Page {i}: {snippet}` lines (the original's format). Every
backend sits behind the SQLite cache (`appo.tools.search_cache`), keyed by backend, its
identity (corpus version, server URL), `max_results`, `result_length` and the normalised
query. `miss_policy="fail"` turns a cache miss into an error result instead of a backend
call, so a run can be replayed offline exactly.

With `pages: {enabled: true, ...}` (`appo.tools.page_step`) the tool runs the original's
deep-search step instead: the top result pages are fetched and summarised for the current
search by a separate model, and the summary is the result. Off by default (ARPO's
reasoning setting and the snippet-only search); the deep-search configs turn it on.

Compatibility with the original config: `cache_file` pointing at a `.json` file (the
original's cache format) is imported into the SQLite cache at start-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from appo.config_ranges import COUNT, above, check_value
from appo.errors import AppoError
from appo.tools.base import ToolResult
from appo.tools.page_step import PagesConfig, PageStep, hits_from_json, hits_to_json
from appo.tools.search_backends import BACKENDS, NO_RESULTS, BackendError
from appo.tools.search_cache import SearchCache, default_cache_path

log = logging.getLogger(__name__)

MISS_POLICIES = ("live", "fail")


class SearchTool:
    enforces_timeout = True  # backends use network timeouts; bm25 and the cache are local
    retry_timeouts = True  # a server that did not answer in time may answer a retry
    takes_context = True  # the page step's summary prompt reads the reasoning so far
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
        # the deep-search page step (appo.tools.page_step.PagesConfig)
        pages: dict | None = None,
    ):
        if backend not in BACKENDS:
            raise AppoError(f"unknown search backend {backend!r} "
                            f"(choose from {', '.join(sorted(BACKENDS))})")
        if miss_policy not in MISS_POLICIES:
            raise AppoError(f"bad search miss_policy {miss_policy!r} "
                            f"(choose from {', '.join(MISS_POLICIES)})")
        for key, value, rng in (("max_results", max_results, COUNT),
                                ("result_length", result_length, COUNT),
                                ("timeout", timeout, above(0.0, "seconds"))):
            check_value(f"tools.tool_instances.{name}.params.{key}", value, rng)
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
        self.page_step = None
        pages_cfg = PagesConfig.from_params(pages)
        if pages_cfg.enabled:
            if not hasattr(backend_cls, "hits"):
                raise AppoError(f"search pages need result URLs, which the {backend!r} "
                                "backend does not record; use bm25, brightdata or http")
            self.page_step = PageStep(pages_cfg, self.cache, live=miss_policy == "live",
                                      tool_tag=self.tag)
        if original_json is not None and self.cache is not None:
            read, stored = self.cache.import_json(original_json, self.backend_name,
                                                  self.key_params)
            log.info("imported %d of %d entries from %s into %s", stored, read, original_json,
                     self.cache.path)

    def execute(self, content: str, context: Sequence[str] = ()) -> ToolResult:
        """`context`: the rollout's steps so far (model segments and tool results), read by
        the page step's summary prompt; the snippet search ignores it."""
        start = time.monotonic()
        query = content.strip().replace('"', "")  # the original dropped double quotes
        if not query:
            return ToolResult("Error: empty search query.", ok=False, error_kind="error",
                              latency_s=time.monotonic() - start)
        if self.page_step is not None:
            result = self._deep(query, context)
            result.latency_s = time.monotonic() - start
            return result
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

    def _deep(self, query: str, context: Sequence[str]) -> ToolResult:
        """Search hits with URLs (cached like snippet results), then the page step."""
        backend = f"{self.backend_name}:hits"
        raw = None if self.cache is None else self.cache.get(backend, self.key_params, query)
        if raw is None:
            if self.backend is None:
                return ToolResult("Error: no cached search result for this query "
                                  "(search miss_policy is 'fail').", ok=False,
                                  error_kind="error")
            try:
                hits = self.backend.hits(query, self.max_results)
            except BackendError as e:
                return ToolResult(f"Error: search failed ({e}).", ok=False, error_kind=e.kind)
            if self.cache is not None and not self.cache.put(backend, self.key_params, query,
                                                             hits_to_json(hits)):
                raw = self.cache.get(backend, self.key_params, query)  # first one wins
                hits = hits_from_json(raw) if raw is not None else hits
        else:
            hits = hits_from_json(raw)
        if not hits:
            return ToolResult(NO_RESULTS)
        return self.page_step.run(query, hits, context)

    def close(self) -> None:
        if self.page_step is not None:
            self.page_step.close()
        if self.cache is not None:
            self.cache.close()
