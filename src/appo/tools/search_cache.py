"""Persistent search cache: SQLite in WAL mode, shared by threads and processes.

The original kept a JSON file `{query: text}` rewritten whole by a background thread under a
file lock: concurrent writers could lose entries, a crash mid-write could lose the file, and
the key was the raw query. Here each entry is one row keyed by (backend, parameters,
normalised query); every write is its own SQLite transaction, so several processes may write
at once (writers queue on SQLite's lock, `busy_timeout`), a process killed with `kill -9`
leaves every committed row intact (the WAL is replayed on the next open), and readers never
block writers. The first result stored for a key is kept (`INSERT OR IGNORE`), so a replay
returns what the run first saw. Import and export speak the original JSON format.

Do not put the file on a network filesystem (NFS): SQLite's WAL needs local shared memory.

A damaged file (a disk error, a copy cut short) is a `ToolFatalError` naming the file: at
open (`PRAGMA quick_check` reads every page once, about a second per GB) and at any later
read or write. It is not rebuilt or bypassed, because with `miss_policy: fail` the cache *is*
the run's search data: a silently fresh cache would turn every search into an error text
the model trains on. Delete the file (or restore a copy) to go on. A healthy file that cannot
be written is not called damaged: on a read-only mount (or without write permission) the
cache opens read-only (replays work; new results are not stored, said once), and a full
disk is "no space left on device".
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from appo.errors import AppoError, ToolFatalError, warn_once
from appo.fsutil import existing_parent
from appo.jsonl import read_text

SCHEMA = """
CREATE TABLE IF NOT EXISTS search_cache (
    backend TEXT NOT NULL,
    params TEXT NOT NULL,
    query_key TEXT NOT NULL,
    query TEXT NOT NULL,
    result TEXT NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (backend, params, query_key)
) WITHOUT ROWID
"""

# Parameters under which the original's search_cache.json was recorded (Bright Data, ARPO
# defaults); `appo search cache import` files entries under them unless told otherwise.
ORIGINAL_BACKEND = "brightdata"
ORIGINAL_PARAMS = {"max_results": 10, "result_length": 1000}


def normalise_query(query: str) -> str:
    """Cache key of a query: NFKC, case-folded, double quotes dropped (the original stripped
    them before searching), whitespace collapsed."""
    text = unicodedata.normalize("NFKC", query).replace('"', "")
    return " ".join(text.split()).casefold()


def canonical_params(params: Mapping | None) -> str:
    return json.dumps(dict(params or {}), sort_keys=True, separators=(",", ":"), default=str)


def _read_only_mount(path: Path) -> bool:
    try:
        return bool(os.statvfs(existing_parent(path)).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _not_writable(path: Path) -> bool:
    """The cache file (or, before it exists, the nearest existing directory) cannot be
    written: a read-only mount, or no permission (`access` says EROFS for root too)."""
    if _read_only_mount(path):
        return True
    if path.exists():  # SQLite writes its journal files beside the database
        return not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK))
    return not os.access(existing_parent(path), os.W_OK)


def default_cache_path() -> Path:
    from appo.paths import cache_dir

    return cache_dir("search") / "cache.sqlite"


@dataclass
class CacheStats:
    path: str
    entries: int
    by_backend: dict[str, int]
    size_bytes: int


class SearchCache:
    """get/put of search results; safe to share across threads, processes and forks."""

    def __init__(self, path: str | os.PathLike | None = None, busy_timeout_s: float = 60.0):
        self.path = Path(path).expanduser() if path is not None else default_cache_path()
        if self.path.suffix == ".json":
            raise AppoError(f"{self.path} is a JSON file; the search cache is an SQLite file. "
                            f"Import the JSON with `appo search cache import {self.path}`")
        self.read_only = _not_writable(self.path)
        if self.read_only and not self.path.is_file():
            raise AppoError(f"search cache {self.path} does not exist and cannot be created "
                            "there (read-only); give a writable search cache path")
        if not self.read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        with self._guard():  # create the schema now, and fail early on a bad file
            verdict = self._connect().execute("PRAGMA quick_check(1)").fetchone()[0]
        if verdict != "ok":
            raise self._damaged(verdict)

    def _damaged(self, detail: object) -> ToolFatalError:
        # quick_check reports "*** in database main ***\nPage 2: ..."; keep the page part
        what = " ".join(str(detail).replace("*** in database main ***", "").split())
        return ToolFatalError(f"search cache {self.path} is damaged ({what}); delete it to "
                              "start a fresh cache, or restore it from a copy")

    def _not_damaged(self, e: sqlite3.DatabaseError) -> ToolFatalError | None:
        """The error of a healthy file that cannot be written or reached, named as such."""
        text = str(e).lower()
        if "disk is full" in text:
            return ToolFatalError(f"search cache {self.path}: could not write: no space left "
                                  "on device")
        if "readonly" in text or "read-only" in text:
            return ToolFatalError(f"search cache {self.path}: could not write: read-only")
        if "unable to open" in text and not os.access(self.path.parent, os.R_OK | os.X_OK):
            return ToolFatalError(f"search cache {self.path}: cannot read its directory")
        return None

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """SQLite's errors on a damaged file as one `ToolFatalError` naming the file."""
        try:
            yield
        except sqlite3.DatabaseError as e:
            if isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "busy" in str(e)):
                raise ToolFatalError(f"search cache {self.path}: still locked by another "
                                     f"process after {self.busy_timeout_s:.0f} s") from None
            raise (self._not_damaged(e) or self._damaged(e)) from None

    def _skip_write(self) -> bool:
        """A read-only cache stores nothing: say so once, and let the run go on."""
        if self.read_only:
            warn_once(f"search cache {self.path} is read-only: new results are not stored")
        return self.read_only

    def _connect(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            return conn
        # Processes opening a new file at the same moment race to switch it to WAL and to
        # create the schema; SQLite can answer that race with "database is locked" at once,
        # without waiting on the busy timeout, so the open is retried until the timeout.
        deadline = time.monotonic() + self.busy_timeout_s
        delay = 0.005
        while True:
            try:
                conn = self._open()
                break
            except sqlite3.DatabaseError as e:
                locked = isinstance(e, sqlite3.OperationalError) and (
                    "locked" in str(e) or "busy" in str(e))
                if not locked:
                    raise (self._not_damaged(e) or self._damaged(e)) from None
                if time.monotonic() > deadline:
                    raise ToolFatalError(f"cannot open search cache {self.path}: still locked "
                                         f"by another process after {self.busy_timeout_s:.0f} s"
                                         ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
        self._local.conn, self._local.pid = conn, os.getpid()
        return conn

    def _open(self) -> sqlite3.Connection:
        if self.read_only:
            # On a read-only mount SQLite cannot create the WAL's shared-memory file: with
            # a WAL left beside the file (a run killed before its checkpoint) plain
            # read-only reads both; without one, `immutable` (nothing can change the file
            # there). Without write permission only: plain read-only, since another
            # process may still write it.
            wal = self.path.with_name(self.path.name + "-wal")
            flags = ("immutable=1" if _read_only_mount(self.path) and not wal.exists()
                     else "mode=ro")
            uri = f"file:{quote(str(self.path.resolve()))}?{flags}"
            return sqlite3.connect(uri, uri=True, timeout=self.busy_timeout_s,
                                   isolation_level=None, check_same_thread=False)
        # isolation_level=None: autocommit; each statement is its own transaction.
        conn = sqlite3.connect(self.path, timeout=self.busy_timeout_s,
                               isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: a committed transaction survives a process crash (only a
            # power loss may roll back the last commits); far fewer fsyncs than FULL.
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute(SCHEMA)
        except BaseException:
            conn.close()
            raise
        return conn

    # -- single entries -------------------------------------------------------------------

    # `key`: an exact key instead of the normalised query (page fetches key on the URL,
    # summaries on a hash of the prompt; `query` is then only a readable label).

    def get(self, backend: str, params: Mapping | None, query: str,
            key: str | None = None) -> str | None:
        with self._guard():
            row = self._connect().execute(
                "SELECT result FROM search_cache WHERE backend=? AND params=? AND query_key=?",
                (backend, canonical_params(params), key or normalise_query(query)),
            ).fetchone()
        return row[0] if row else None

    def put(self, backend: str, params: Mapping | None, query: str, result: str,
            key: str | None = None) -> bool:
        """Store a result unless the key already has one. Returns True if it was stored."""
        if self._skip_write():
            return False
        with self._guard():
            cur = self._connect().execute(
                "INSERT OR IGNORE INTO search_cache VALUES (?, ?, ?, ?, ?, ?)",
                (backend, canonical_params(params), key or normalise_query(query), query,
                 result, time.time()),
            )
        return cur.rowcount == 1

    # -- bulk ---------------------------------------------------------------------------

    def put_many(self, backend: str, params: Mapping | None,
                 items: Iterable[tuple[str, str]], overwrite: bool = False) -> int:
        """Store (query, result) pairs in one transaction; returns how many were stored."""
        verb = "INSERT OR REPLACE" if overwrite else "INSERT OR IGNORE"
        p, now = canonical_params(params), time.time()
        rows = [(backend, p, normalise_query(q), q, r, now) for q, r in items]
        if self.read_only:  # an import into a read-only cache is a mistake, not a skip
            raise AppoError(f"search cache {self.path} is read-only: cannot store entries")
        with self._guard():
            conn = self._connect()
            before = conn.total_changes
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany(f"{verb} INTO search_cache VALUES (?, ?, ?, ?, ?, ?)", rows)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            return conn.total_changes - before

    def import_json(self, path: str | os.PathLike, backend: str = ORIGINAL_BACKEND,
                    params: Mapping | None = None, overwrite: bool = False) -> tuple[int, int]:
        """Import the original `{query: text}` file. Returns (entries read, entries stored)."""
        data = load_original_json(path)
        params = ORIGINAL_PARAMS if params is None else params
        stored = self.put_many(backend, params, data.items(), overwrite=overwrite)
        return len(data), stored

    def export_json(self, path: str | os.PathLike, backend: str | None = None,
                    params: Mapping | None = None) -> int:
        """Write entries as the original `{query: text}` JSON; returns how many."""
        out = self.entries(backend, params)
        from appo.fsutil import output_file

        with output_file(path) as tmp:
            tmp.write_text(json.dumps(out, ensure_ascii=False, indent=2), encoding="utf-8")
        return len(out)

    def entries(self, backend: str | None = None, params: Mapping | None = None
                ) -> dict[str, str]:
        sql, args = "SELECT query, result FROM search_cache", []
        where = []
        if backend is not None:
            where.append("backend=?")
            args.append(backend)
        if params is not None:
            where.append("params=?")
            args.append(canonical_params(params))
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at, query"
        with self._guard():
            return {q: r for q, r in self._connect().execute(sql, args)}

    def stats(self) -> CacheStats:
        with self._guard():
            by_backend = dict(self._connect().execute(
                "SELECT backend, COUNT(*) FROM search_cache GROUP BY backend ORDER BY backend"))
        size = sum(p.stat().st_size for p in self.path.parent.glob(self.path.name + "*")
                   if p.is_file())
        return CacheStats(str(self.path), sum(by_backend.values()), by_backend, size)

    def __len__(self) -> int:
        with self._guard():
            return self._connect().execute("SELECT COUNT(*) FROM search_cache").fetchone()[0]

    def integrity_check(self) -> str:
        return self._connect().execute("PRAGMA integrity_check").fetchone()[0]

    def close(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None and self._local.pid == os.getpid():
            conn.close()
        self._local = threading.local()


def load_original_json(path: str | os.PathLike) -> dict[str, str]:
    """Read the original's `{query: text}` cache file, with clear errors."""
    path = Path(path)
    if not path.is_file():
        raise AppoError(f"search cache file not found: {path}")
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise AppoError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise AppoError(f"{path} must hold one JSON object mapping query strings to result "
                        "strings (the original search_cache.json format)")
    return data
