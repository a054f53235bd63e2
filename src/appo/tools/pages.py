"""Page fetchers for the deep-search page step: a result's URL -> the page's text.

The original's deep-search tool (ARPO/AEPO evaluation, `SerperSearchToolSDS`) fetched every
result URL with `requests` (20 s timeout), turned HTML into text with BeautifulSoup
(`get_text(separator=" ", strip=True)`) and kept the first 20,000 characters. Here:

- `store` (default): a local page store, url -> text, so the whole pipeline runs offline and
  reproducibly. A JSONL file of `{url, text}` (read into memory) or an SQLite file with a
  `pages(url, text)` table (queried per page). `build_page_store` makes one from a search
  corpus: the passages of one page (`Passage.page_url()`: the row's `url`, else
  `corpus:{title}`) joined in corpus order.
- `http`: live pages through urllib. Deviations from the original, all for users with
  internet: `robots.txt` is obeyed (urllib.robotparser, cached per host), requests to one
  host are spaced `min_host_interval_s` apart, bodies are read up to `max_bytes` (the rest is
  dropped, not downloaded), and PDFs are not parsed (the original used pdfplumber).
  BeautifulSoup (the `pages` extra) does the HTML-to-text as in the original.

A fetch returns a `Fetched` record; `ok=False` with `transient=True` (timeout, 5xx,
connection failure) is not cached, every other outcome is (a 404 stays a 404 on replay).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import urllib.robotparser
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from appo.errors import AppoError
from appo.jsonl import iter_objects

USER_AGENT = "appo-deep-search/1 (+robots.txt respected)"


@dataclass
class Fetched:
    """A page fetch outcome. `text` is the page text (ok) or a short reason (not ok)."""

    ok: bool
    text: str
    transient: bool = False  # a retry later may succeed: never cached

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, raw: str) -> Fetched:
        return cls(**json.loads(raw))


class Fetcher(Protocol):
    name: str

    def identity(self) -> dict: ...

    def fetch(self, url: str) -> Fetched: ...


# ---------------------------------------------------------------------------------------------
# store
# ---------------------------------------------------------------------------------------------


class StoreFetcher:
    """Pages from a local store (JSONL `{url, text}` or SQLite `pages(url, text)`)."""

    name = "store"

    def __init__(self, store: str | None = None, max_page_chars: int = 20000, **_):
        if not store:
            raise AppoError("the store page fetcher needs pages.store (a JSONL file of "
                            "{url, text} or an SQLite page store; build one from the search "
                            "corpus with `appo search pages build CORPUS --out FILE`)")
        self.path = Path(store).expanduser()
        if not self.path.is_file():
            raise AppoError(f"page store not found: {self.path}")
        self.max_page_chars = int(max_page_chars)
        self._pages: dict[str, str] | None = None
        self._local = threading.local()
        if self.path.suffix == ".jsonl":
            self._pages = {}
            for lineno, row in iter_objects(self.path, "an object {url, text}"):
                url, text = row.get("url"), row.get("text")
                if not isinstance(url, str) or not isinstance(text, str):
                    raise AppoError(f"{self.path}:{lineno}: a page needs 'url' and 'text' "
                                    "strings")
                self._pages[url] = text
        else:
            self._query("SELECT 1 FROM pages LIMIT 1")  # a clear error now, not per fetch

    def identity(self) -> dict:
        from appo.tools.search_backends import file_fingerprint

        return {"store": file_fingerprint(self.path), "max_page_chars": self.max_page_chars}

    def _query(self, sql: str, args: tuple = ()) -> list:
        conn = getattr(self._local, "conn", None)
        try:
            if conn is None:
                conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True,
                                       check_same_thread=False)
                self._local.conn = conn
            return conn.execute(sql, args).fetchall()
        except sqlite3.DatabaseError as e:
            raise AppoError(f"page store {self.path} is not a JSONL file or an SQLite page "
                            f"store with a pages(url, text) table ({e})") from None

    def fetch(self, url: str) -> Fetched:
        if self._pages is not None:
            text = self._pages.get(url)
        else:
            rows = self._query("SELECT text FROM pages WHERE url=?", (url,))
            text = rows[0][0] if rows else None
        if text is None:
            return Fetched(False, "not in the page store")
        return Fetched(True, text[: self.max_page_chars])


def build_page_store(corpus: str | Path, out: str | Path) -> int:
    """Group a search corpus's passages into pages (by `Passage.page_url()`, texts joined in
    corpus order) and write them to `out` (`.jsonl` or SQLite). Returns the page count."""
    from appo.tools.search_backends import load_passages

    pages: dict[str, list[str]] = {}
    for p in load_passages(corpus):
        pages.setdefault(p.page_url(), []).append(p.text)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.unlink(missing_ok=True)
    rows = ((url, "\n".join(texts)) for url, texts in pages.items())
    if out.suffix == ".jsonl":
        with open(tmp, "w", encoding="utf-8") as f:
            for url, text in rows:
                f.write(json.dumps({"url": url, "text": text}, ensure_ascii=False) + "\n")
    else:
        conn = sqlite3.connect(tmp)
        with conn:
            conn.execute("CREATE TABLE pages (url TEXT PRIMARY KEY, text TEXT NOT NULL)")
            conn.executemany("INSERT INTO pages VALUES (?, ?)", rows)
        conn.close()
    tmp.replace(out)  # a store is complete or absent, never half written
    return len(pages)


# ---------------------------------------------------------------------------------------------
# http
# ---------------------------------------------------------------------------------------------


def html_to_text(html: str) -> str:
    """Visible text of an HTML page, as the original (BeautifulSoup, words joined by one
    space); script and style contents are dropped first."""
    try:
        from bs4 import BeautifulSoup
    except ImportError:
        raise AppoError("the http page fetcher needs BeautifulSoup: pip install "
                        "'appo[pages]' (beautifulsoup4)") from None
    soup = BeautifulSoup(html, "html.parser")
    for tag in soup(["script", "style", "noscript", "template"]):
        tag.decompose()
    return soup.get_text(separator=" ", strip=True)


class HttpFetcher:
    """Live pages over HTTP(S), polite by default (robots.txt, per-host spacing)."""

    name = "http"

    def __init__(self, timeout: float = 20.0, max_bytes: int = 5_000_000,
                 max_page_chars: int = 20000, robots: bool = True,
                 min_host_interval_s: float = 1.0, user_agent: str = USER_AGENT, **_):
        html_to_text("")  # fail at start-up, not per page, without BeautifulSoup
        self.timeout = float(timeout)
        self.max_bytes = int(max_bytes)
        self.max_page_chars = int(max_page_chars)
        self.robots = bool(robots)
        self.min_host_interval_s = float(min_host_interval_s)
        self.user_agent = user_agent
        self._lock = threading.Lock()
        self._next_slot: dict[str, float] = {}  # host -> earliest time of its next request
        self._robots: dict[str, urllib.robotparser.RobotFileParser | None] = {}

    def identity(self) -> dict:
        return {"max_page_chars": self.max_page_chars, "max_bytes": self.max_bytes}

    def _wait_turn(self, host: str) -> None:
        """Reserve the host's next request slot, then sleep until it (outside the lock)."""
        with self._lock:
            now = time.monotonic()
            slot = max(now, self._next_slot.get(host, 0.0))
            self._next_slot[host] = slot + self.min_host_interval_s
        if slot > now:
            time.sleep(slot - now)

    def _robots_for(self, scheme: str, host: str) -> urllib.robotparser.RobotFileParser | None:
        key = f"{scheme}://{host}"
        with self._lock:
            if key in self._robots:
                return self._robots[key]
        parser: urllib.robotparser.RobotFileParser | None = urllib.robotparser.RobotFileParser()
        try:
            self._wait_turn(host)
            req = urllib.request.Request(f"{key}/robots.txt",
                                         headers={"User-Agent": self.user_agent})
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                parser.parse(r.read(512_000).decode("utf-8", "replace").splitlines())
        except urllib.error.HTTPError as e:
            # RFC 9309: 4xx -> no rules (allowed); 5xx -> treat as disallowed for now
            if e.code >= 500:
                return None
            parser.parse([])
        except (OSError, ValueError):
            return None  # unreachable: not cached, so a later call tries again
        with self._lock:
            self._robots[key] = parser
        return parser

    def fetch(self, url: str) -> Fetched:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return Fetched(False, "not an http(s) URL")
        host = parts.netloc
        if self.robots:
            parser = self._robots_for(parts.scheme, host)
            if parser is None:
                return Fetched(False, "robots.txt unavailable", transient=True)
            if not parser.can_fetch(self.user_agent, url):
                return Fetched(False, "disallowed by robots.txt")
        self._wait_turn(host)
        req = urllib.request.Request(url, headers={
            "User-Agent": self.user_agent,
            "Accept": "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.5"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                ctype = r.headers.get("Content-Type", "")
                body = r.read(self.max_bytes)  # the rest of a larger page is never read
                charset = r.headers.get_content_charset() or "utf-8"
        except urllib.error.HTTPError as e:
            return Fetched(False, f"HTTP {e.code}", transient=e.code >= 500 or e.code == 429)
        except (TimeoutError, urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError) or isinstance(e, TimeoutError):
                return Fetched(False, f"timed out after {self.timeout:g} s", transient=True)
            return Fetched(False, f"cannot fetch ({reason})", transient=True)
        if "pdf" in ctype:
            return Fetched(False, "PDF pages are not read")
        try:
            text = body.decode(charset, "replace")
        except LookupError:  # a charset name Python does not know
            text = body.decode("utf-8", "replace")
        if "html" in ctype or text.lstrip()[:1] == "<":
            text = html_to_text(text)
        return Fetched(True, text[: self.max_page_chars])


FETCHERS: dict[str, type] = {"store": StoreFetcher, "http": HttpFetcher}


def make_fetcher(name: str, params: dict) -> Fetcher:
    if name not in FETCHERS:
        raise AppoError(f"unknown page fetcher {name!r} (choose from {', '.join(FETCHERS)})")
    return FETCHERS[name](**params)

