"""The bm25 search index: a JSONL passage corpus, bm25s' arrays and a meta.json in one
directory, built once per corpus version and reloaded (`appo.tools.search_backends`' bm25
backend searches it; `appo search index` builds one)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from appo.errors import AppoError
from appo.jsonl import iter_objects

log = logging.getLogger(__name__)

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


