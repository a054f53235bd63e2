"""Search backends (bm25, replay, brightdata, http), the SearchTool cache policy, the CLI."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from appo.cli import main as cli_main
from appo.errors import AppoError
from appo.tools.executor import ToolCall, ToolExecutor
from appo.tools.search_backends import (
    NO_RESULTS,
    Bm25Index,
    BrightDataBackend,
    format_pages,
    load_or_build_index,
    read_corpus,
    split_pages,
)
from appo.tools.search_cache import SearchCache
from appo.tools.search_tool import SearchTool

REAL_CACHE = Path(__file__).resolve().parents[3] / "shared" / "data" / "arpo" / "search_cache.json"

CORPUS = [
    {"id": "a", "title": "Python", "text": "python sandbox runs code safely"},
    {"id": "b", "title": "", "text": "the sandbox is a box of sand for children"},
    {"id": "c", "title": "Snakes", "text": "a python is a large snake"},
    {"id": "d", "title": "", "text": "bm25 ranks passages by term frequency"},
]


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in CORPUS) + "\n")
    return path


@pytest.fixture(autouse=True)
def isolated_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("APPO_CACHE", str(tmp_path / "appo-cache"))


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------


def test_format_pages_hand_example():
    text = format_pages(["first\nsnippet", "second one", "third"], max_results=2, result_length=8)
    assert text == "Page 1: first sn\nPage 2: second o"
    assert format_pages([], 10, 100) == NO_RESULTS
    assert split_pages("Page 1: a b\nPage 2: c") == ["a b", "c"]


# ---------------------------------------------------------------------------------------------
# bm25
# ---------------------------------------------------------------------------------------------


def _lucene_bm25(query_terms, doc_tokens, all_docs, k1=1.5, b=0.75):
    """BM25 (Lucene variant, bm25s' default) computed by hand from its definition. Lucene >= 8
    drops the constant (k1 + 1) factor of the classic numerator (ranking unchanged)."""
    n = len(all_docs)
    avgdl = sum(len(d) for d in all_docs) / n
    score = 0.0
    for term in query_terms:
        df = sum(term in d for d in all_docs)
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        tf = doc_tokens.count(term)
        score += idf * tf / (tf + k1 * (1 - b + b * len(doc_tokens) / avgdl))
    return score


def test_bm25_scores_match_the_formula(corpus_file, tmp_path):
    index = load_or_build_index(corpus_file, tmp_path / "idx")
    hits = index.search("Python sandbox?", k=4)
    # Indexed text is "title: text"; tokens are lower-cased \w\w+ minus English stop words.
    docs = {
        "a": ["python", "python", "sandbox", "runs", "code", "safely"],
        "b": ["sandbox", "box", "sand", "children"],
        "c": ["snakes", "python", "large", "snake"],
        "d": ["bm25", "ranks", "passages", "term", "frequency"],
    }
    expected = {pid: _lucene_bm25(["python", "sandbox"], toks, list(docs.values()))
                for pid, toks in docs.items()}
    assert [p.id for p, _ in hits] == ["a", "b", "c"]  # d scores 0 and is left out
    for passage, score in hits:
        assert score == pytest.approx(expected[passage.id], rel=1e-5)


def test_query_tokenizer_matches_bm25s(corpus_file, tmp_path):
    import bm25s

    index = load_or_build_index(corpus_file, tmp_path / "idx")
    text = "The Python's sandbox -- runs CODE, safely; a box of sand!"
    ours = [t for t in index.tokenize(text)]
    theirs = [t for t in bm25s.tokenize(text, stopwords="en", return_ids=False,
                                        show_progress=False)[0] if t in index._vocab]
    assert ours == theirs


def test_index_is_saved_reloaded_and_rebuilt_when_the_corpus_changes(corpus_file, tmp_path):
    first = load_or_build_index(corpus_file, tmp_path / "idx")
    again = load_or_build_index(corpus_file, tmp_path / "idx")
    assert again.meta["built_at"] == first.meta["built_at"]  # loaded, not rebuilt
    assert Bm25Index.load(tmp_path / "idx").search("snake", 1)[0][0].id == "c"
    time.sleep(0.01)
    corpus_file.write_text(json.dumps({"id": "z", "title": "", "text": "zebra"}) + "\n")
    rebuilt = load_or_build_index(corpus_file, tmp_path / "idx")
    assert rebuilt.meta["built_at"] != first.meta["built_at"]
    assert rebuilt.search("zebra", 3)[0][0].id == "z"


def test_corpus_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "text": "ok"}\n{"id": 2, "title": "no text"}\n')
    with pytest.raises(AppoError, match=r"bad.jsonl:2: passage has no 'text'"):
        list(read_corpus(bad))
    with pytest.raises(AppoError, match="not found"):
        SearchTool(corpus=str(tmp_path / "missing.jsonl"))
    with pytest.raises(AppoError, match="needs params.corpus"):
        SearchTool(backend="bm25")


def test_search_r1_contents_format_is_read(tmp_path):
    path = tmp_path / "wiki.jsonl"
    path.write_text(json.dumps({"id": "1", "contents": '"Paris"\nParis is the capital.'}) + "\n")
    (passage,) = list(read_corpus(path))
    assert passage.title == "Paris" and passage.text == "Paris is the capital."


def test_search_tool_bm25_end_to_end_with_cache(corpus_file, tmp_path):
    tool = SearchTool(corpus=str(corpus_file), index_dir=str(tmp_path / "idx"), max_results=2,
                      result_length=20)
    first = tool.execute("python sandbox")
    assert first.ok and not first.cached
    # b and c tie (same length, one matching term each): corpus order decides.
    assert first.text == "Page 1: Python: python sandb\nPage 2: the sandbox is a box"
    second = tool.execute('  Python   "sandbox" ')
    assert second.cached and second.text == first.text
    assert tool.execute("zzzz unknown words").text == NO_RESULTS
    empty = tool.execute("   ")
    assert not empty.ok and empty.error_kind == "error"
    tool.close()


# ---------------------------------------------------------------------------------------------
# replay and miss policy
# ---------------------------------------------------------------------------------------------


def test_replay_backend_returns_recorded_text(tmp_path):
    recorded = tmp_path / "recorded.json"
    recorded.write_text(json.dumps({"Capital of France": "Page 1: Paris is the capital."}))
    tool = SearchTool(backend="replay", replay_file=str(recorded))
    hit = tool.execute('capital of "France"')
    assert hit.ok and hit.text == "Page 1: Paris is the capital."
    miss = tool.execute("capital of Spain")
    assert not miss.ok and miss.error_kind == "error" and "no recorded result" in miss.text
    jsonl = tmp_path / "recorded.jsonl"
    jsonl.write_text(json.dumps({"query": "q1", "result": "Page 1: r1"}) + "\n")
    assert SearchTool(backend="replay", replay_file=str(jsonl),
                      cache=False).execute("Q1").text == "Page 1: r1"


def test_miss_policy_fail_answers_only_from_the_cache(corpus_file, tmp_path):
    cache_file = str(tmp_path / "c.sqlite")
    live = SearchTool(corpus=str(corpus_file), index_dir=str(tmp_path / "idx"),
                      cache_file=cache_file)
    recorded = live.execute("large snake")
    offline = SearchTool(corpus=str(corpus_file), cache_file=cache_file, miss_policy="fail")
    assert offline.backend is None  # nothing started: no index build, no network
    replayed = offline.execute("Large  Snake")
    assert replayed.cached and replayed.text == recorded.text
    miss = offline.execute("something never searched")
    assert not miss.ok and miss.error_kind == "error" and "miss_policy" in miss.text
    with pytest.raises(AppoError, match="miss_policy"):
        SearchTool(corpus=str(corpus_file), miss_policy="sometimes")


@pytest.mark.skipif(not REAL_CACHE.is_file(), reason=f"real data not present: {REAL_CACHE}")
def test_original_config_with_json_cache_file_replays_offline(tmp_path, monkeypatch):
    """The original's config: brightdata + cache_file=search_cache.json. With
    miss_policy=fail every recorded query answers from the cache, no key, no network."""
    tool = SearchTool(backend="brightdata", cache_file=str(REAL_CACHE), miss_policy="fail")
    original = json.loads(REAL_CACHE.read_text(encoding="utf-8"))
    for query, text in list(original.items())[:200]:
        result = tool.execute(query)
        assert result.cached and result.text == text
    assert len(SearchCache()) == 1000  # imported into $APPO_CACHE/search/cache.sqlite


# ---------------------------------------------------------------------------------------------
# HTTP backends against local servers
# ---------------------------------------------------------------------------------------------


class FakeServer:
    """127.0.0.1 server recording requests; answers with `status`, `body`, after `delay`."""

    def __init__(self):
        self.requests: list[dict] = []
        self.status, self.body, self.delay = 200, b"{}", 0.0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length", 0))
                outer.requests.append({"path": self.path, "headers": dict(self.headers),
                                       "body": json.loads(self.rfile.read(length))})
                time.sleep(outer.delay)
                try:
                    self.send_response(outer.status)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(outer.body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,),
                                       daemon=True)
        self.thread.start()

    def answer(self, status=200, body=None, delay=0.0):
        self.status, self.delay = status, delay
        self.body = body if isinstance(body, bytes) else json.dumps(body or {}).encode()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = FakeServer()
    yield s
    s.close()


def test_brightdata_request_shape_and_result_format(server, monkeypatch):
    monkeypatch.setenv("MY_BD_KEY", "secret-key-123")
    server.answer(body={"organic": [
        {"link": "u1", "title": "t1", "description": "  Amy Smart made her debut in 1996. "},
        {"link": "u2", "title": "t2", "description": "Amy Smart made her debut in 1996."},  # dup
        {"link": "u3", "title": "t3", "description": ""},  # empty: skipped
        {"link": "u4", "title": "t4", "description": "Campfire Tales is a 1997 film."},
        {"link": "u5", "title": "t5"},  # no description
    ]})
    tool = SearchTool(backend="brightdata", api_key_env="MY_BD_KEY", zone="serp_zone",
                      url=server.url + "/request", result_length=20, cache=False)
    result = tool.execute('Amy Smart "film debut"')
    assert result.ok
    # Snippets cut to 20 characters by a plain slice, as in the original (trailing space kept).
    assert result.text == "Page 1: Amy Smart made her d\nPage 2: Campfire Tales is a "
    (req,) = server.requests
    assert req["path"] == "/request"
    assert req["headers"]["Authorization"] == "Bearer secret-key-123"
    assert req["headers"]["Content-Type"] == "application/json"
    body = req["body"]
    assert body["zone"] == "serp_zone" and body["format"] == "raw"
    target = urlparse(body["url"])
    assert (target.scheme, target.netloc, target.path) == ("https", "www.bing.com", "/search")
    q = parse_qs(target.query)
    assert q == {"q": ["Amy Smart film debut"], "mkt": ["en-US"], "setLang": ["en"],
                 "brd_json": ["1"], "cc": ["cn"]}


def test_brightdata_market_for_chinese_queries(monkeypatch):
    monkeypatch.setenv("BRIGHTDATA_API_KEY", "k")
    backend = BrightDataBackend(zone="z", location="us")
    assert parse_qs(urlparse(backend.bing_url("甄嬛传导演")).query) == {
        "q": ["甄嬛传导演"], "mkt": ["zh-CN"], "setLang": ["zh"], "brd_json": ["1"], "cc": ["us"]}


def test_brightdata_no_results_and_missing_key(server, monkeypatch):
    monkeypatch.setenv("BRIGHTDATA_API_KEY", "k")
    server.answer(body={"general": {}})  # no "organic": the original's empty answer
    tool = SearchTool(backend="brightdata", zone="z", url=server.url, cache=False)
    assert tool.execute("anything").text == NO_RESULTS
    monkeypatch.delenv("BRIGHTDATA_API_KEY")
    with pytest.raises(AppoError, match="BRIGHTDATA_API_KEY"):
        SearchTool(backend="brightdata", zone="z", url=server.url)


@pytest.mark.parametrize("status,kind", [(500, "infra"), (503, "infra"), (429, "infra"),
                                         (401, "error"), (404, "error")])
def test_brightdata_http_errors(server, monkeypatch, status, kind):
    monkeypatch.setenv("BRIGHTDATA_API_KEY", "k")
    server.answer(status=status, body={"error": "nope"})
    tool = SearchTool(backend="brightdata", zone="z", url=server.url, cache=True,
                      cache_file=None)
    result = tool.execute("q")
    assert not result.ok and result.error_kind == kind
    assert f"HTTP {status}" in result.text
    assert len(tool.cache) == 0  # errors are never cached


def test_server_errors_are_retried_by_the_executor(server, monkeypatch):
    monkeypatch.setenv("BRIGHTDATA_API_KEY", "k")
    server.answer(status=502, body={})
    tool = SearchTool(backend="brightdata", zone="z", url=server.url, cache=False)
    ex = ToolExecutor({"search": tool}, retry_count=2)
    result = ex.execute(ToolCall("search", "q"))
    assert result.error_kind == "infra"
    assert len(server.requests) == 3
    ex.close()


def test_http_timeout_and_non_json(server, monkeypatch):
    monkeypatch.setenv("BRIGHTDATA_API_KEY", "k")
    server.answer(body={"organic": []}, delay=10.0)
    tool = SearchTool(backend="brightdata", zone="z", url=server.url, timeout=0.2, cache=False)
    start = time.monotonic()
    result = tool.execute("slow")
    assert result.error_kind == "timeout" and "0.2 s" in result.text
    assert time.monotonic() - start < 5  # the 0.2 s timeout, not the server's 10 s
    server.answer(body=b"<html>not json</html>")
    result = tool.execute("html")
    assert result.error_kind == "infra" and "non-JSON" in result.text


def test_http_backend_unreachable_server():
    tool = SearchTool(backend="http", url="http://127.0.0.1:9/retrieve", timeout=1.0,
                      cache=False)
    result = tool.execute("q")
    assert result.error_kind == "infra" and "cannot reach" in result.text


def test_search_r1_retriever_request_and_formatting(server):
    server.answer(body={"result": [[
        {"document": {"id": "1", "contents": '"Eiffel Tower"\nA tower in Paris.'},
         "score": 12.5},
        {"document": {"id": "2", "title": "Paris", "text": "Capital of\nFrance."}, "score": 9.0},
    ]]})
    tool = SearchTool(backend="http", url=server.url + "/retrieve", max_results=3, cache=False)
    result = tool.execute("eiffel tower")
    assert result.ok
    assert result.text == "Page 1: Eiffel Tower: A tower in Paris.\nPage 2: Paris: Capital of France."
    (req,) = server.requests
    assert req["path"] == "/retrieve"
    assert req["body"] == {"queries": ["eiffel tower"], "topk": 3, "return_scores": True}
    server.answer(body={"unexpected": True})
    bad = tool.execute("x")
    assert bad.error_kind == "infra" and "unexpected retriever answer" in bad.text


def test_live_results_are_cached_and_not_requested_again(server):
    server.answer(body={"result": [[{"document": {"contents": '"T"\nbody'}}]]})
    tool = SearchTool(backend="http", url=server.url)
    a, b = tool.execute("Same query"), tool.execute("same   QUERY")
    assert not a.cached and b.cached and a.text == b.text == "Page 1: T: body"
    assert len(server.requests) == 1


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def test_cli_index_query_and_cache(corpus_file, tmp_path, capsys):
    idx = tmp_path / "cli-idx"
    assert cli_main(["search", "index", str(corpus_file), "--out", str(idx)]) == 0
    assert "indexed 4 passages" in capsys.readouterr().out
    assert cli_main(["search", "query", "large snake", "--index-dir", str(idx),
                     "--max-results", "1"]) == 0
    assert capsys.readouterr().out == "Page 1: Snakes: a python is a large snake\n"

    original = tmp_path / "orig.json"
    original.write_text(json.dumps({"q one": "Page 1: one", "q two": "Page 1: two"}))
    cache_file = str(tmp_path / "cli.sqlite")
    assert cli_main(["search", "cache", "import", str(original), "--cache-file",
                     cache_file]) == 0
    assert "imported 2 new entries" in capsys.readouterr().out
    assert cli_main(["search", "cache", "stats", "--cache-file", cache_file]) == 0
    assert capsys.readouterr().out.startswith("2 entries in ")
    exported = tmp_path / "out.json"
    assert cli_main(["search", "cache", "export", str(exported), "--cache-file",
                     cache_file]) == 0
    assert json.loads(exported.read_text()) == json.loads(original.read_text())
    assert cli_main(["search", "query", "Q ONE", "--backend", "brightdata", "--miss-policy",
                     "fail", "--cache-file", cache_file]) == 0
    assert capsys.readouterr().out.endswith("Page 1: one\n")
    assert cli_main(["search", "cache", "import", str(tmp_path / "none.json")]) == 2
    assert "not found" in capsys.readouterr().err


def test_cli_tool_python_prints_what_the_model_sees(capsys):
    assert cli_main(["tool", "python", "x = 20\nx + 22"]) == 0
    assert capsys.readouterr().out == "42\n"
    assert cli_main(["tool", "python", "1/0"]) == 1
    out = capsys.readouterr().out
    assert out.rstrip().endswith("ZeroDivisionError: division by zero")


def test_real_cache_as_bm25_corpus(tmp_path):
    if not REAL_CACHE.is_file():
        pytest.skip(f"real data not present: {REAL_CACHE}")
    tool = SearchTool(corpus=str(REAL_CACHE), index_dir=str(tmp_path / "real-idx"),
                      max_results=3, cache=False)
    assert tool.backend.index.meta["passages"] > 8000
    text = tool.execute("Amy Smart film debut").text
    assert text.startswith("Page 1: ") and "Amy Smart" in text.splitlines()[0]
