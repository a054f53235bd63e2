"""Search backends behind one interface: `search(query, max_results, result_length) -> text`.

- `bm25` (default): a local JSONL corpus `{id, title, text}` indexed with bm25s; the index
  is saved to disk and reloaded (rebuilt if the corpus file changed).
- `replay` (alias `cache`): recorded results, e.g. the original's `search_cache.json`
  (`{query: text}`) or JSONL `{query, result}`; returned exactly as recorded.
- `brightdata`: Bing through Bright Data, the original's request (POST with a bearer key and
  zone, `brd_json=1`) and result format (de-duplicated organic snippets). Deviation: the
  original picked the Bing market with `langid`; here a query with CJK characters uses
  zh-CN, any other en-US.
- `http`: a Search-R1-style retriever server (POST `{"queries": [q], "topk": k,
  "return_scores": true}`, answer `{"result": [[{"document": {...}, "score": s}, ...]]}`).

Results are `Page {i}: {snippet}` lines as in the original, at most `max_results` pages,
each snippet cut to `result_length` characters. Failures raise `BackendError` with the
`error_kind` the executor uses ("infra" is retried, "timeout" and "error" are not).
`hits()` returns the same results as `Hit` records with their page URLs, for the page step
(`appo.tools.pages`); the replay backend has no URLs and no `hits()`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from appo.errors import AppoError
from appo.jsonl import iter_lines

log = logging.getLogger(__name__)

NO_RESULTS = "No search results found."


class BackendError(Exception):
    def __init__(self, message: str, kind: str = "infra"):
        super().__init__(message)
        self.kind = kind


class SearchBackend(Protocol):
    """`identity(**params)` is a classmethod: what besides the query identifies a result
    (corpus version, server URL); computed without starting the backend, so an offline
    replay (`miss_policy="fail"`) finds the keys a live run stored."""

    name: str

    @classmethod
    def identity(cls, **params) -> dict: ...

    def search(self, query: str, max_results: int, result_length: int) -> str: ...


@dataclass
class Hit:
    """One search result: the page's URL (a `corpus:` URL for a local corpus), title and
    snippet (whole, not cut to `result_length`)."""

    url: str
    title: str
    snippet: str


def format_pages(snippets: Iterable[str], max_results: int, result_length: int) -> str:
    """The original's result text: `Page {i}: {snippet}` lines."""
    lines = []
    for i, snippet in enumerate(snippets, 1):
        if i > max_results:
            break
        # A newline inside a snippet would break the one-page-per-line format.
        lines.append(f"Page {i}: {' '.join(snippet.split())[:result_length]}")
    return "\n".join(lines) if lines else NO_RESULTS


# ---------------------------------------------------------------------------------------------
# bm25
# ---------------------------------------------------------------------------------------------

from appo.tools.bm25_index import (  # noqa: E402 - the backend below is built on them
    INDEX_FILES,
    Bm25Index,
    Passage,
    _split_contents,
    file_fingerprint,
    load_or_build_index,
    load_passages,
    passages_from_search_cache,
    read_corpus,
    split_pages,
    write_corpus,
)

__all__ = ["INDEX_FILES", "Bm25Index", "Passage", "file_fingerprint", "load_or_build_index",
           "load_passages", "passages_from_search_cache", "read_corpus", "split_pages",
           "write_corpus"]


class Bm25Backend:
    name = "bm25"

    def __init__(self, corpus: str | None = None, index_dir: str | None = None, **_):
        if corpus is None and index_dir is None:
            raise AppoError("the bm25 search backend needs params.corpus (a JSONL file of "
                            "{id, title, text}) or params.index_dir (an index built with "
                            "`appo search index`)")
        if corpus is not None:
            self.index = load_or_build_index(corpus, index_dir)
        else:
            self.index = Bm25Index.load(index_dir)

    @classmethod
    def identity(cls, corpus: str | None = None, index_dir: str | None = None, **_) -> dict:
        if corpus is not None and Path(corpus).is_file():
            return {"corpus": file_fingerprint(corpus)}
        if index_dir is not None:
            meta = Path(index_dir) / "meta.json"
            if meta.is_file():
                return {"corpus": json.loads(meta.read_text()).get("fingerprint", "")}
        return {"corpus": str(corpus or index_dir)}

    def hits(self, query: str, max_results: int) -> list[Hit]:
        return [Hit(p.page_url(), p.title, p.snippet())
                for p, _ in self.index.search(query, max_results)]

    def search(self, query: str, max_results: int, result_length: int) -> str:
        return format_pages((h.snippet for h in self.hits(query, max_results)), max_results,
                            result_length)


# ---------------------------------------------------------------------------------------------
# replay
# ---------------------------------------------------------------------------------------------


def load_recorded(path: str | os.PathLike) -> dict[str, str]:
    """`{query: text}` JSON, or JSONL lines `{query, result|text}`."""
    path = Path(path)
    if not path.is_file():
        raise AppoError(f"replay file not found: {path}")
    if path.suffix == ".jsonl":
        out = {}
        for lineno, line in iter_lines(path):
            if line.strip():
                try:
                    row = json.loads(line)
                    out[row["query"]] = row.get("result", row.get("text"))
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise AppoError(f"{path}:{lineno}: expected {{query, result}}") from None
        return out
    from appo.tools.search_cache import load_original_json

    return load_original_json(path)


class ReplayBackend:
    name = "replay"

    def __init__(self, replay_file: str | None = None, **_):
        if replay_file is None:
            raise AppoError("the replay search backend needs params.replay_file (e.g. the "
                            "original's search_cache.json)")
        from appo.tools.search_cache import normalise_query

        self._normalise = normalise_query
        self.records = {normalise_query(q): t for q, t in load_recorded(replay_file).items()}

    @classmethod
    def identity(cls, replay_file: str | None = None, **_) -> dict:
        exists = replay_file is not None and Path(replay_file).is_file()
        return {"file": file_fingerprint(replay_file) if exists else str(replay_file)}

    def search(self, query: str, max_results: int, result_length: int) -> str:
        text = self.records.get(self._normalise(query))
        if text is None:
            raise BackendError("no recorded result for this query (replay backend)", "error")
        return text


# ---------------------------------------------------------------------------------------------
# HTTP backends
# ---------------------------------------------------------------------------------------------


def post_json(url: str, payload: dict, headers: dict, timeout: float) -> object:
    """POST JSON, return the decoded JSON answer; failures become BackendError."""
    body = json.dumps(payload).encode()
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read(300).decode(errors="replace").strip()
        kind = "infra" if e.code >= 500 or e.code == 429 else "error"
        raise BackendError(f"search server returned HTTP {e.code}: {detail}", kind) from None
    except TimeoutError:
        raise BackendError(f"search server did not answer within {timeout:g} s",
                           "timeout") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise BackendError(f"search server did not answer within {timeout:g} s",
                               "timeout") from None
        raise BackendError(f"cannot reach search server {url}: {e.reason}") from None
    except (ConnectionError, OSError) as e:
        raise BackendError(f"connection to search server {url} failed: {e}") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BackendError(f"search server answered with non-JSON: {raw[:200]!r}") from None


_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")


class BrightDataBackend:
    name = "brightdata"
    DEFAULT_URL = "https://api.brightdata.com/request"

    def __init__(self, zone: str | None = None, api_key_env: str = "BRIGHTDATA_API_KEY",
                 location: str = "cn", url: str | None = None, timeout: float = 30.0, **_):
        self.api_key = os.environ.get(api_key_env, "")
        if not self.api_key:
            raise AppoError(f"the brightdata search backend reads its API key from the "
                            f"environment variable {api_key_env}, which is not set")
        self.zone = zone or os.environ.get("BRIGHTDATA_ZONE")
        if not self.zone:
            raise AppoError("the brightdata search backend needs params.zone (or the "
                            "BRIGHTDATA_ZONE environment variable)")
        self.location = location
        self.url = url or self.DEFAULT_URL
        self.timeout = timeout

    @classmethod
    def identity(cls, **_) -> dict:
        # As in the original, the cache ignores zone and location: recorded results stay
        # valid across accounts (and the original search_cache.json imports as is).
        return {}

    def bing_url(self, query: str) -> str:
        mkt, lang = ("zh-CN", "zh") if _CJK.search(query) else ("en-US", "en")
        params = urllib.parse.urlencode({"q": query, "mkt": mkt, "setLang": lang})
        return f"https://www.bing.com/search?{params}&brd_json=1&cc={self.location}"

    def hits(self, query: str, max_results: int) -> list[Hit]:
        payload = {"zone": self.zone, "url": self.bing_url(query), "format": "raw"}
        data = post_json(self.url, payload, {"Authorization": f"Bearer {self.api_key}"},
                         self.timeout)
        if not isinstance(data, dict):
            raise BackendError("unexpected Bright Data answer (not a JSON object)")
        out: list[Hit] = []
        for item in data.get("organic") or []:
            if not isinstance(item, dict):
                continue
            snippet = str(item.get("description") or "").strip()
            if snippet and all(h.snippet != snippet for h in out):
                out.append(Hit(str(item.get("link") or ""), str(item.get("title") or ""),
                               snippet))
        return out[:max_results]

    def search(self, query: str, max_results: int, result_length: int) -> str:
        return format_pages((h.snippet for h in self.hits(query, max_results)), max_results,
                            result_length)


class HttpRetrieverBackend:
    name = "http"

    def __init__(self, url: str | None = None, timeout: float = 30.0, **_):
        if not url:
            raise AppoError("the http search backend needs params.url (a Search-R1-style "
                            "retriever, e.g. http://127.0.0.1:8000/retrieve)")
        self.url = url
        self.timeout = timeout

    @classmethod
    def identity(cls, url: str | None = None, **_) -> dict:
        return {"url": url}

    def search(self, query: str, max_results: int, result_length: int) -> str:
        return format_pages((h.snippet for h in self.hits(query, max_results)), max_results,
                            result_length)

    def hits(self, query: str, max_results: int) -> list[Hit]:
        payload = {"queries": [query], "topk": max_results, "return_scores": True}
        data = post_json(self.url, payload, {}, self.timeout)
        try:
            hits = data["result"][0]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            raise BackendError("unexpected retriever answer: expected "
                               "{\"result\": [[...passages...]]}") from None
        out = []
        for i, hit in enumerate(hits or []):
            doc = hit.get("document", hit) if isinstance(hit, dict) else {"contents": str(hit)}
            if "text" in doc:
                title, text = str(doc.get("title") or ""), str(doc["text"])
            else:
                title, text = _split_contents(str(doc.get("contents", "")))
            p = Passage(str(doc.get("id", i)), title, text, str(doc.get("url") or ""))
            out.append(Hit(p.page_url(), title, p.snippet()))
        return out


BACKENDS: dict[str, type] = {
    "bm25": Bm25Backend,
    "replay": ReplayBackend,
    "cache": ReplayBackend,  # the original's name for replay (docs/algorithms.md §5.3)
    "brightdata": BrightDataBackend,
    "http": HttpRetrieverBackend,
}
