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

import hashlib
import json
import logging
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from appo.errors import AppoError
from appo.jsonl import iter_lines, iter_objects

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


_PAGE = re.compile(r"^Page \d+: ", re.MULTILINE)


def split_pages(text: str) -> list[str]:
    """Inverse of `format_pages` (used to turn recorded results into a corpus)."""
    parts = _PAGE.split(text)
    return [p.strip() for p in parts[1:] if p.strip()]


def file_fingerprint(path: str | os.PathLike) -> str:
    """Identity of a file's version without reading it: path, size, mtime."""
    p = Path(path).resolve()
    st = p.stat()
    return hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# bm25
# ---------------------------------------------------------------------------------------------

# bm25s' default tokenisation (lower-case, \w\w+ tokens, English stop words, no stemming),
# re-implemented for queries: bm25s.tokenize() costs ~1 ms of set-up per call.
_TOKEN = re.compile(r"(?u)\b\w\w+\b")


@dataclass
class Passage:
    id: str
    title: str
    text: str
    url: str = ""  # the page the passage comes from; empty: `page_url()` names one

    def page_url(self) -> str:
        """The passage's page: its `url`, else `corpus:{title}` (passages of one article
        share it), else `corpus:#{id}`."""
        if self.url:
            return self.url
        return f"corpus:{self.title}" if self.title else f"corpus:#{self.id}"

    def snippet(self) -> str:
        if self.title and not self.text.startswith(self.title):
            return f"{self.title}: {self.text}"
        return self.text


def read_corpus(path: str | os.PathLike) -> Iterator[Passage]:
    """JSONL passages `{id, title, text}` (Search-R1's `{id, contents}` with a quoted title
    line is accepted too). Bad lines raise AppoError naming the line."""
    path = Path(path)
    if not path.is_file():
        raise AppoError(f"search corpus not found: {path}")
    for lineno, row in iter_objects(path, "an object {id, title, text}"):
        title, text = row.get("title") or "", row.get("text")
        if text is None and "contents" in row:
            title, text = _split_contents(str(row["contents"]))
        if not isinstance(text, str):
            raise AppoError(f"{path}:{lineno}: passage has no 'text' string")
        yield Passage(str(row.get("id", lineno - 1)), str(title), text,
                      str(row.get("url") or ""))


def _split_contents(contents: str) -> tuple[str, str]:
    """Search-R1 / DPR wiki passages: first line is the title in double quotes."""
    head, sep, rest = contents.partition("\n")
    if sep and len(head) < 300:
        return head.strip().strip('"'), rest.strip()
    return "", contents.strip()


def passages_from_search_cache(data: dict[str, str]) -> list[Passage]:
    """The original's recorded results, split into unique `Page` snippets: a small real
    corpus for the bm25 backend."""
    seen: set[str] = set()
    out = []
    for text in data.values():
        for snippet in split_pages(text):
            if snippet not in seen:
                seen.add(snippet)
                out.append(Passage(str(len(out)), "", snippet))
    return out


def write_corpus(passages: Iterable[Passage], path: str | os.PathLike) -> int:
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for p in passages:
            row = {"id": p.id, "title": p.title, "text": p.text}
            if p.url:
                row["url"] = p.url
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n


# What an index directory holds (bm25s' arrays, the passages, appo's meta.json).
INDEX_FILES = frozenset({"data.csc.index.npy", "indices.csc.index.npy", "indptr.csc.index.npy",
                         "params.index.json", "vocab.index.json", "nonoccurrence_array.index.npy",
                         "passages.jsonl", "meta.json"})


class Bm25Index:
    """A bm25s index over a passage corpus, stored in a directory:
    bm25s' arrays + `passages.jsonl` + `meta.json` (corpus fingerprint, size)."""

    def __init__(self, retriever, passages: list[Passage], meta: dict):
        self.retriever = retriever
        self.passages = passages
        self.meta = meta
        self._vocab = retriever.vocab_dict
        from bm25s.stopwords import STOPWORDS_EN

        self._stopwords = set(STOPWORDS_EN)

    @classmethod
    def build(cls, passages: list[Passage], out_dir: str | os.PathLike,
              fingerprint: str = "") -> Bm25Index:
        import bm25s

        if not passages:
            raise AppoError("cannot build a search index from an empty corpus")
        from appo.fsutil import atomic_dir, is_write_failure, write_error

        out = Path(out_dir)
        foreign = sorted(p.name for p in out.iterdir() if p.name not in INDEX_FILES) if (
            out.is_dir()) else []
        if foreign:  # the directory is replaced whole: never delete what is not an index
            raise AppoError(f"{out} holds files that are not a search index ({foreign[0]}, "
                            "...): give the index a directory of its own")
        texts = [p.snippet() for p in passages]
        tokens = bm25s.tokenize(texts, stopwords="en", show_progress=False)
        retriever = bm25s.BM25()
        retriever.index(tokens, show_progress=False)
        meta = {"fingerprint": fingerprint, "passages": len(passages), "built_at": time.time(),
                "format": 1}
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            # Built aside and swapped in: a full disk leaves the old index (or none), never
            # a half one; meta.json last all the same (its presence marks a complete index).
            with atomic_dir(out) as tmp:
                retriever.save(str(tmp), show_progress=False)
                write_corpus(passages, tmp / "passages.jsonl")
                (tmp / "meta.json").write_text(json.dumps(meta))
        except Exception as exc:
            if is_write_failure(exc):
                raise write_error(exc, out) from exc
            raise
        return cls(retriever, passages, meta)

    @classmethod
    def load(cls, index_dir: str | os.PathLike) -> Bm25Index:
        import bm25s

        d = Path(index_dir)
        if not (d / "meta.json").is_file():
            raise AppoError(f"{d} is not a search index (no meta.json); build one with "
                            "`appo search index CORPUS.jsonl --out DIR`")
        meta = json.loads((d / "meta.json").read_text())
        retriever = bm25s.BM25.load(str(d), mmap=False, show_progress=False)
        passages = list(read_corpus(d / "passages.jsonl"))
        return cls(retriever, passages, meta)

    def tokenize(self, query: str) -> list[str]:
        return [t for t in _TOKEN.findall(query.lower())
                if t not in self._stopwords and t in self._vocab]

    def search(self, query: str, k: int) -> list[tuple[Passage, float]]:
        import numpy as np

        tokens = self.tokenize(query)
        if not tokens:
            return []
        scores = self.retriever.get_scores(tokens)
        n = len(scores)
        k = min(k, n)
        # Top k by score, ties broken by corpus order (argpartition alone would pick tied
        # passages arbitrarily, and a replayed run must see the same pages).
        if k < n:
            kth = np.partition(scores, n - k)[n - k]
            candidates = np.flatnonzero(scores >= kth)
        else:
            candidates = np.arange(n)
        top = candidates[np.lexsort((candidates, -scores[candidates]))][:k]
        return [(self.passages[i], float(scores[i])) for i in top if scores[i] > 0]


def load_or_build_index(corpus: str | os.PathLike, index_dir: str | os.PathLike | None = None
                        ) -> Bm25Index:
    """Reuse the index in `index_dir` (default: under the appo cache) if it was built from
    this version of the corpus; otherwise build it there."""
    corpus = Path(corpus)
    if not corpus.is_file():
        raise AppoError(f"search corpus not found: {corpus} (tools.tool_instances.search."
                        "params.corpus must be a JSONL file of {id, title, text})")
    fp = file_fingerprint(corpus)
    if index_dir is None:
        from appo.paths import cache_dir

        index_dir = cache_dir("bm25") / f"{corpus.stem}-{fp}"
    index_dir = Path(index_dir)
    meta_file = index_dir / "meta.json"
    if meta_file.is_file() and json.loads(meta_file.read_text()).get("fingerprint") == fp:
        return Bm25Index.load(index_dir)
    log.info("building bm25 index of %s in %s", corpus, index_dir)
    return Bm25Index.build(load_passages(corpus), index_dir, fingerprint=fp)


def load_passages(path: str | os.PathLike) -> list[Passage]:
    """A corpus file: JSONL passages, or the original's search_cache.json (split into pages)."""
    path = Path(path)
    if path.suffix == ".json":
        from appo.tools.search_cache import load_original_json

        return passages_from_search_cache(load_original_json(path))
    return list(read_corpus(path))


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
