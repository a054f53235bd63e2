"""SQLite search cache: keys, concurrency across processes, crash safety, original format."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appo.errors import AppoError, ToolFatalError
from appo.tools.search_cache import (
    ORIGINAL_PARAMS,
    SearchCache,
    canonical_params,
    normalise_query,
)
from mounts import read_only, small_tmpfs

REAL_CACHE = Path(__file__).resolve().parents[3] / "shared" / "data" / "arpo" / "search_cache.json"

WRITER = """
import sys, time
from appo.tools.search_cache import SearchCache
path, worker, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cache = SearchCache(path)
if len(sys.argv) > 4:  # start together, so that the writers really contend
    time.sleep(max(0.0, float(sys.argv[4]) - time.time()))
for i in range(n):
    cache.put("bm25", {"max_results": 10}, f"worker {worker} query {i}", f"result {worker}/{i}")
    if n > 10_000:  # the kill -9 test: report each committed key
        print(i, flush=True)
"""


def test_normalise_query_hand_examples():
    assert normalise_query('  Who  is "Amy"\tSmart? ') == "who is amy smart?"
    assert normalise_query("ＡＢＣ") == "abc"  # NFKC folds full-width letters
    assert normalise_query("Straße") == "strasse"  # casefold, not lower
    assert canonical_params({"b": 1, "a": 2}) == canonical_params({"a": 2, "b": 1})


def test_get_put_first_result_wins_and_params_are_part_of_the_key(tmp_path):
    cache = SearchCache(tmp_path / "c.sqlite")
    assert cache.get("bm25", {"k": 1}, "q") is None
    assert cache.put("bm25", {"k": 1}, "Capital of France", "Paris")
    assert not cache.put("bm25", {"k": 1}, "capital  of france", "Lyon")  # same key: kept
    assert cache.get("bm25", {"k": 1}, 'CAPITAL of "France"') == "Paris"
    assert cache.get("bm25", {"k": 2}, "capital of france") is None
    assert cache.get("http", {"k": 1}, "capital of france") is None
    assert len(cache) == 1


def test_default_location_is_under_appo_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("APPO_CACHE", str(tmp_path / "root"))
    cache = SearchCache()
    assert cache.path == tmp_path / "root" / "search" / "cache.sqlite"
    cache.put("bm25", {}, "q", "r")
    assert cache.path.is_file()


def test_bad_files_give_clear_errors(tmp_path):
    with pytest.raises(AppoError, match="JSON file.*cache import"):
        SearchCache(tmp_path / "cache.json")
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"this is not a database" * 100)
    with pytest.raises(AppoError, match="garbage.sqlite is damaged .*delete it"):
        SearchCache(garbage)
    cache = SearchCache(tmp_path / "ok.sqlite")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(AppoError, match="query strings to result strings"):
        cache.import_json(bad)
    with pytest.raises(AppoError, match="not found"):
        cache.import_json(tmp_path / "missing.json")


def test_four_processes_write_concurrently(tmp_path):
    path = tmp_path / "shared.sqlite"
    start_at = str(time.time() + 2.0)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(w), "200", start_at],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for w in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
    cache = SearchCache(path)
    assert len(cache) == 800
    assert cache.integrity_check() == "ok"
    assert cache.get("bm25", {"max_results": 10}, "worker 3 query 199") == "result 3/199"


def test_kill_9_during_writes_keeps_every_committed_entry(tmp_path):
    path = tmp_path / "crash.sqlite"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "0", "1000000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    committed = []
    deadline = time.monotonic() + 60
    while len(committed) < 300 and time.monotonic() < deadline:
        committed.append(int(proc.stdout.readline()))
    os.kill(proc.pid, signal.SIGKILL)  # mid-loop, quite possibly mid-transaction
    proc.wait()
    committed += [int(line) for line in proc.stdout.read().split()]
    assert len(committed) >= 300
    cache = SearchCache(path)
    assert cache.integrity_check() == "ok"
    missing = [i for i in committed
               if cache.get("bm25", {"max_results": 10}, f"worker 0 query {i}") is None]
    assert missing == []
    assert len(cache) >= len(committed)
    cache.put("bm25", {}, "after the crash", "still writable")
    assert cache.get("bm25", {}, "after the crash") == "still writable"


def test_import_export_round_trip_of_the_original_format(tmp_path):
    original = {"Who wrote \"Hamlet\"?": "Page 1: Shakespeare", "capital of France": "Page 1: Paris"}
    src = tmp_path / "original.json"
    src.write_text(json.dumps(original))
    cache = SearchCache(tmp_path / "c.sqlite")
    assert cache.import_json(src) == (2, 2)
    assert cache.import_json(src) == (2, 0)  # idempotent
    out = tmp_path / "exported.json"
    assert cache.export_json(out, backend="brightdata") == 2
    assert json.loads(out.read_text()) == original
    assert cache.get("brightdata", ORIGINAL_PARAMS, "who wrote hamlet?") == "Page 1: Shakespeare"
    stats = cache.stats()
    assert stats.entries == 2 and stats.by_backend == {"brightdata": 2}


@pytest.mark.skipif(not REAL_CACHE.is_file(), reason=f"real data not present: {REAL_CACHE}")
def test_real_search_cache_round_trips(tmp_path):
    original = json.loads(REAL_CACHE.read_text(encoding="utf-8"))
    assert len(original) == 1000
    cache = SearchCache(tmp_path / "real.sqlite")
    assert cache.import_json(REAL_CACHE) == (1000, 1000)
    assert len(cache) == 1000 and cache.integrity_check() == "ok"
    out = tmp_path / "real_export.json"
    cache.export_json(out)
    assert json.loads(out.read_text(encoding="utf-8")) == original
    for query, text in list(original.items())[::97]:
        assert cache.get("brightdata", ORIGINAL_PARAMS, query) == text


def _open_at_barrier(path, barrier, errors):
    barrier.wait()
    try:
        SearchCache(path)
    except AppoError as e:
        errors.put(str(e))


def test_processes_opening_a_new_file_at_the_same_instant_all_succeed(tmp_path):
    # Regression: SQLite may answer the race to switch a fresh file to WAL / create the
    # schema with an immediate "database is locked" (no busy wait). Before the retry,
    # 5 of 320 such opens failed here (40 rounds of 8 processes released by a barrier).
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    for round_ in range(25):
        path = tmp_path / f"fresh{round_}.sqlite"
        barrier = ctx.Barrier(8)
        procs = [ctx.Process(target=_open_at_barrier, args=(path, barrier, errors))
                 for _ in range(8)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    assert errors.empty(), errors.get()


def test_a_healthy_cache_on_a_read_only_mount_replays_and_stores_nothing(tmp_path, caplog):
    """Issue 41 class 3: a read-only cache was called "damaged ... delete it" (which would
    delete the run's search data) and could not be used; an offline replay
    (`miss_policy: fail`) must read it."""
    from appo.tools.search_tool import SearchTool

    live = SearchTool(backend="replay", cache_file=str(tmp_path / "c" / "cache.sqlite"),
                      miss_policy="fail")
    live.cache.put(live.backend_name, live.key_params, "capital of france", "Page 1: Paris")
    # Still open: the entry is in the WAL beside the file, as after a run killed with -9.
    assert (tmp_path / "c" / "cache.sqlite-wal").is_file()
    with read_only(tmp_path / "c"):
        tool = SearchTool(backend="replay", cache_file=str(tmp_path / "c" / "cache.sqlite"),
                          miss_policy="fail")
        assert tool.cache.read_only
        assert tool.cache.get(tool.backend_name, tool.key_params,
                              "capital of France") == "Page 1: Paris"
        assert tool.cache.put(tool.backend_name, tool.key_params, "q", "r") is False
        assert tool.cache.put(tool.backend_name, tool.key_params, "q2", "r") is False
        said = [r.getMessage() for r in caplog.records]
        assert sum("is read-only: new results are not stored" in m for m in said) == 1, said
        with pytest.raises(AppoError, match="is read-only: cannot store entries"):
            tool.cache.put_many("b", {}, [("q", "r")])
        with pytest.raises(AppoError, match="does not exist and cannot be created there"):
            SearchCache(tmp_path / "c" / "other.sqlite")
        assert sorted(p.name for p in (tmp_path / "c").iterdir())[0] == "cache.sqlite"
        tool.cache._connect().close()
    # A cache closed cleanly (no WAL left) on a read-only mount reads too.
    live.cache._connect().close()
    assert not (tmp_path / "c" / "cache.sqlite-wal").exists()
    with read_only(tmp_path / "c"):
        again = SearchCache(tmp_path / "c" / "cache.sqlite")
        assert again.get(live.backend_name, live.key_params, "capital of france") == (
            "Page 1: Paris")
        again._connect().close()


def test_a_full_disk_is_named_not_called_damage(tmp_path):
    with small_tmpfs(tmp_path / "full", "64k") as full:
        cache = SearchCache(full / "cache.sqlite")
        cache.put("b", {}, "kept", "r")
        with pytest.raises(ToolFatalError) as e:
            for i in range(2000):
                cache.put("b", {}, f"q{i}", "x" * 2000)
        assert str(e.value) == (f"search cache {full / 'cache.sqlite'}: could not write: no "
                                "space left on device")
        assert cache.get("b", {}, "kept") == "r"  # the file is whole
