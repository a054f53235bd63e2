"""The deep-search page step behind the search tool: fetch the top result pages, summarise
them for the current search, return the summary as the tool result.

Configured by `tools.tool_instances.search.params.pages` (off by default: ARPO's reasoning
setting returns snippets only; the deep-search configs turn it on). What the original did
and where appo deviates: `appo.tools.pages` (fetching) and `appo.tools.summarise` (prompt,
limits). Every fetch and every summary goes through the search tool's persistent cache
(`appo.tools.search_cache`: several processes, `kill -9` safe), with the search tool's
`miss_policy`; with `fail` a run replays offline exactly:

- the search hits (with URLs) are cached under backend `{backend}:hits`;
- each fetch under `pages:{fetcher}`, keyed by the exact URL (transient failures such as
  timeouts are not stored; a page missing from the cache under `fail` reads as one that
  could not be fetched, which is what the live run put into the prompt for it);
- each summary under `summary`, keyed by a hash of the model name, the sampling parameters
  and the whole prompt.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields

from appo.config_ranges import COUNT, Range, above, at_least, check_dataclass, within
from appo.errors import AppoError
from appo.tools.base import ToolResult
from appo.tools.pages import Fetched, make_fetcher
from appo.tools.search_backends import Hit
from appo.tools.search_cache import SearchCache
from appo.tools.summarise import (
    APIS,
    PageDoc,
    Summariser,
    SummariserError,
    extract_final_information,
    fill_prompt,
    format_documents,
    resolve_prompt,
    truncate_prev_reasoning,
)


@dataclass
class SummariserConfig:
    base_url: str | None = None
    model: str | None = None  # None: the first model the server lists
    api_key_env: str = "OPENAI_API_KEY"
    prompt: str = "webpage_to_reasonchain"  # a name in summarise.PROMPTS or a template
    api: str = "chat"  # chat | completions (the prompt as is, for models without a template)
    temperature: float = 0.6
    top_p: float = 0.95
    max_tokens: int = 4096
    timeout: float = 300.0


# The ranges of `params.pages` (appo.config_ranges: floats finite unless stated).
PAGES_RANGES: dict[str, Range] = {
    "top_k": COUNT, "timeout": above(0.0, "seconds"), "max_bytes": COUNT,
    "min_host_interval_s": at_least(0.0), "max_page_chars": COUNT, "context_chars": COUNT,
    "max_documents_chars": at_least(0), "raw_context_chars": at_least(0),
    "fetch_workers": COUNT, "summariser.temperature": at_least(0.0, "0 is greedy"),
    "summariser.top_p": within(0.0, 1.0), "summariser.max_tokens": COUNT,
    "summariser.timeout": above(0.0, "seconds"),
}


@dataclass
class PagesConfig:
    """`params.pages` of the search tool. Defaults: the original deep-search tool's."""

    enabled: bool = False
    top_k: int = 10  # pages fetched per search (the original: every result, max_results 10)
    fetcher: str = "store"  # store | http
    store: str | None = None  # store fetcher: JSONL {url, text} or SQLite pages(url, text)
    timeout: float = 20.0  # http fetcher
    max_bytes: int = 5_000_000  # http fetcher: bytes read per page
    robots: bool = True  # http fetcher
    min_host_interval_s: float = 1.0  # http fetcher: spacing of requests to one host
    max_page_chars: int = 20000  # page text kept per fetch
    context_chars: int = 3000  # the original's max_doc_len: text kept around the snippet
    max_documents_chars: int = 20000  # the original's max_sequence_length
    summarise: bool = True  # false: the pages' text itself is the result (no model)
    raw_context_chars: int = 1000  # summarise=false: the original's no-summary page cut
    fetch_workers: int = 10
    summariser: SummariserConfig = field(default_factory=SummariserConfig)

    @classmethod
    def from_params(cls, params: Mapping | None) -> PagesConfig:
        params = dict(params or {})
        summ = params.pop("summariser", None) or {}
        known = {f.name for f in fields(cls)}
        bad = sorted(set(params) - known)
        if bad:
            raise AppoError(f"unknown search pages key(s) {', '.join(bad)} "
                            f"(known: {', '.join(sorted(known))})")
        sknown = {f.name for f in fields(SummariserConfig)}
        sbad = sorted(set(summ) - sknown)
        if sbad:
            raise AppoError(f"unknown search pages.summariser key(s) {', '.join(sbad)} "
                            f"(known: {', '.join(sorted(sknown))})")
        cfg = cls(**params, summariser=SummariserConfig(**summ))
        check_dataclass(cfg, PAGES_RANGES, "search pages.")
        if cfg.summariser.api not in APIS:
            raise AppoError(f"bad search pages.summariser.api {cfg.summariser.api!r} "
                            f"(choose from {', '.join(APIS)})")
        return cfg


def _fetch_params(cfg: PagesConfig) -> dict:
    return {"store": cfg.store, "timeout": cfg.timeout, "max_bytes": cfg.max_bytes,
            "robots": cfg.robots, "min_host_interval_s": cfg.min_host_interval_s,
            "max_page_chars": cfg.max_page_chars}


class PageStep:
    """Hits -> fetched pages -> one summary (or the formatted pages), through the cache."""

    def __init__(self, cfg: PagesConfig, cache: SearchCache | None, live: bool,
                 tool_tag: str = "search"):
        self.cfg = cfg
        self.cache = cache
        self.live = live
        self.tool_tag = tool_tag
        self.fetcher = make_fetcher(cfg.fetcher, _fetch_params(cfg))
        self.fetch_key = {"fetcher": cfg.fetcher, **self.fetcher.identity()}
        self.template = resolve_prompt(cfg.summariser.prompt)
        s = cfg.summariser
        self.summariser = None
        if cfg.summarise:
            if live:
                self.summariser = Summariser(s.base_url, s.model, s.api_key_env,
                                             s.temperature, s.top_p, s.max_tokens, s.timeout,
                                             api=s.api)
            elif s.model is None:
                raise AppoError("search pages.summariser.model must be named for a replay "
                                "(miss_policy 'fail'): summaries are cached under it")
        self._pool = ThreadPoolExecutor(max_workers=max(1, cfg.fetch_workers),
                                        thread_name_prefix="appo-page")

    # -- fetch ---------------------------------------------------------------------------

    def _fetch(self, url: str) -> Fetched:
        backend = f"pages:{self.cfg.fetcher}"
        if self.cache is not None:
            hit = self.cache.get(backend, self.fetch_key, url, key=url)
            if hit is not None:
                return Fetched.from_json(hit)
        if not self.live:
            return Fetched(False, "not in the cache (miss_policy 'fail')", transient=True)
        got = self.fetcher.fetch(url)
        if self.cache is not None and not got.transient and not self.cache.put(
                backend, self.fetch_key, url, got.to_json(), key=url):
            stored = self.cache.get(backend, self.fetch_key, url, key=url)  # first one wins
            return Fetched.from_json(stored) if stored is not None else got
        return got

    def fetch_all(self, hits: Sequence[Hit]) -> list[PageDoc]:
        top = list(hits)[: self.cfg.top_k]
        fetched = list(self._pool.map(lambda h: self._fetch(h.url) if h.url else None, top))
        return [PageDoc(h.title, h.url, h.snippet, f.text if f is not None and f.ok else None)
                for h, f in zip(top, fetched, strict=True)]

    # -- summary -------------------------------------------------------------------------

    def _summary_key(self, prompt: str) -> tuple[dict, str]:
        s = self.cfg.summariser
        model = s.model if s.model is not None else self.summariser.model_name()
        params = {"model": model, "api": s.api, "temperature": s.temperature,
                  "top_p": s.top_p, "max_tokens": s.max_tokens}
        return params, hashlib.sha256(prompt.encode("utf-8")).hexdigest()

    def run(self, query: str, hits: Sequence[Hit], steps: Sequence[str] = ()) -> ToolResult:
        docs = self.fetch_all(hits)
        if not self.cfg.summarise:
            return ToolResult(format_documents(docs, self.cfg.raw_context_chars,
                                               self.cfg.max_documents_chars, for_summary=False))
        document = format_documents(docs, self.cfg.context_chars, self.cfg.max_documents_chars)
        prompt = fill_prompt(self.template, truncate_prev_reasoning(steps, self.tool_tag),
                             query, document)
        params, key = self._summary_key(prompt)
        if self.cache is not None:
            hit = self.cache.get("summary", params, query, key=key)
            if hit is not None:
                return ToolResult(extract_final_information(hit), cached=True)
        if self.summariser is None:
            return ToolResult("Error: no cached page summary for this search "
                              "(search miss_policy is 'fail').", ok=False, error_kind="error")
        try:
            output = self.summariser.complete(prompt)
        except SummariserError as e:
            return ToolResult(f"Error: {e}.", ok=False,
                              error_kind="infra" if e.retryable else "error")
        if self.cache is not None and not self.cache.put("summary", params, query, output,
                                                         key=key):
            # another process stored this summary first: use its text, which is what a
            # replay will return
            output = self.cache.get("summary", params, query, key=key) or output
        return ToolResult(extract_final_information(output))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def hits_to_json(hits: Sequence[Hit]) -> str:
    return json.dumps([[h.url, h.title, h.snippet] for h in hits], ensure_ascii=False)


def hits_from_json(raw: str) -> list[Hit]:
    return [Hit(*row) for row in json.loads(raw)]
