"""The deep-search page step: fetchers (store, http against a page server on 127.0.0.1),
the summary helpers, the summariser against a scripted OpenAI-compatible server, and the
cache replay (servers stopped, miss_policy=fail -> identical results)."""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from appo.errors import AppoError
from appo.tools.executor import ToolCall, ToolExecutor
from appo.tools.page_step import PagesConfig
from appo.tools.pages import HttpFetcher, StoreFetcher, build_page_store, html_to_text
from appo.tools.search_tool import SearchTool
from appo.tools.summarise import (
    CANNOT_FETCH,
    PageDoc,
    extract_final_information,
    fill_prompt,
    format_documents,
    resolve_prompt,
    snippet_context,
    truncate_prev_reasoning,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from eval_server import Reply, ScriptedServer, chat  # noqa: E402

PAGE_A = """<html><head><title>Eiffel</title><style>p {color: red}</style>
<script>var hidden = "script text";</script></head>
<body><h1>Eiffel Tower</h1><p>The tower was finished in 1889.</p>
<p>It is 330 metres tall.</p></body></html>"""
PAGE_B = "<html><body><p>Paris is the capital of France.</p></body></html>"
HUGE = "<html><body>" + "<p>word word word word</p>" * 200_000 + "</body></html>"  # ~5 MB


class PageServer:
    """HTML pages, a slow page, a huge page, a 404 and a robots.txt that disallows
    /private/. Records each request's path and arrival time."""

    def __init__(self, slow_s: float = 3.0):
        self.hits: list[tuple[str, float]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, status: int, body: str, ctype: str = "text/html") -> None:
                data = body.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", f"{ctype}; charset=utf-8")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped reading (timeout, size limit)

            def do_GET(self) -> None:
                server.hits.append((self.path, time.monotonic()))
                if self.path == "/robots.txt":
                    self._send(200, "User-agent: *\nDisallow: /private/\n", "text/plain")
                elif self.path == "/a.html":
                    self._send(200, PAGE_A)
                elif self.path == "/b.html":
                    self._send(200, PAGE_B)
                elif self.path == "/slow.html":
                    time.sleep(slow_s)
                    self._send(200, PAGE_B)
                elif self.path == "/huge.html":
                    self._send(200, HUGE)
                elif self.path.startswith("/private/"):
                    self._send(200, PAGE_B)
                else:
                    self._send(404, "<html><body>not found</body></html>")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def paths(self) -> list[str]:
        return [p for p, _ in self.hits]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def pages():
    server = PageServer()
    yield server
    server.close()


@pytest.fixture(autouse=True)
def isolated_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("APPO_CACHE", str(tmp_path / "appo-cache"))


# ---------------------------------------------------------------------------------------------
# fetchers
# ---------------------------------------------------------------------------------------------


def test_html_to_text_keeps_visible_text_only():
    assert html_to_text(PAGE_A) == ("Eiffel Eiffel Tower The tower was finished in 1889. "
                                    "It is 330 metres tall.")


def test_http_fetcher_page_slow_huge_404_robots(pages):
    f = HttpFetcher(timeout=0.5, max_bytes=10_000, min_host_interval_s=0.0)
    ok = f.fetch(pages.url + "/a.html")
    assert ok.ok and "finished in 1889" in ok.text and "script text" not in ok.text

    slow = f.fetch(pages.url + "/slow.html")
    assert not slow.ok and slow.transient and "timed out" in slow.text

    huge = f.fetch(pages.url + "/huge.html")
    # only max_bytes were read: after the 12-byte "<html><body>", 9,988 bytes of 26-byte
    # "<p>word word word word</p>" blocks = 384 whole blocks (1536 words) + "<p>w" (1 more)
    assert huge.ok and len(huge.text.split()) == 1537

    missing = f.fetch(pages.url + "/missing.html")
    assert not missing.ok and not missing.transient and missing.text == "HTTP 404"

    private = f.fetch(pages.url + "/private/x.html")
    assert not private.ok and private.text == "disallowed by robots.txt"
    assert "/private/x.html" not in pages.paths()
    assert pages.paths().count("/robots.txt") == 1  # robots.txt read once per host

    assert not f.fetch("ftp://example.org/x").ok


def test_http_fetcher_spaces_requests_to_one_host(pages):
    f = HttpFetcher(timeout=5, min_host_interval_s=0.3, robots=False)
    threads = [threading.Thread(target=f.fetch, args=(pages.url + "/b.html",))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    times = sorted(t for p, t in pages.hits if p == "/b.html")
    assert len(times) == 3
    # three concurrent fetches to one host arrive at least min_host_interval_s apart
    assert min(b - a for a, b in zip(times, times[1:], strict=False)) >= 0.25


@pytest.mark.parametrize("suffix", [".jsonl", ".sqlite"])
def test_page_store_from_corpus(tmp_path, suffix):
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": "1", "title": "Eiffel Tower", "text": "Finished in 1889."},
            {"id": "2", "title": "Paris", "text": "Capital of France."},
            {"id": "3", "title": "Eiffel Tower", "text": "330 metres tall."},
            {"id": "4", "title": "", "text": "untitled passage"},
            {"id": "5", "title": "X", "text": "with a url", "url": "https://x.org/p"}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / f"pages{suffix}"
    assert build_page_store(corpus, out) == 4
    f = StoreFetcher(str(out), max_page_chars=1000)
    # passages of one title form one page, in corpus order
    assert f.fetch("corpus:Eiffel Tower").text == "Finished in 1889.\n330 metres tall."
    assert f.fetch("corpus:#4").text == "untitled passage"
    assert f.fetch("https://x.org/p").text == "with a url"
    assert not f.fetch("corpus:Nowhere").ok
    assert StoreFetcher(str(out), max_page_chars=5).fetch("corpus:Paris").text == "Capit"


def test_store_fetcher_bad_inputs(tmp_path):
    with pytest.raises(AppoError, match="needs pages.store"):
        StoreFetcher(None)
    with pytest.raises(AppoError, match="not found"):
        StoreFetcher(str(tmp_path / "none.jsonl"))
    bad = tmp_path / "bad.sqlite"
    bad.write_text("not a database")
    with pytest.raises(AppoError, match="pages\\(url, text\\)"):
        StoreFetcher(str(bad))


# ---------------------------------------------------------------------------------------------
# summary helpers
# ---------------------------------------------------------------------------------------------


def test_truncate_prev_reasoning_hand_example():
    assert truncate_prev_reasoning(["a", "b"]) == "Step 1: a\n\nStep 2: b"
    steps = ["q", "x", "<search>s</search>", "<result>r</result>", "y", "z", "1", "2", "3",
             "4"]
    # keep step 1, the search call (3) and its result (4), the last four (7-10); steps 2
    # and 5-6 become one "..." each
    assert truncate_prev_reasoning(steps) == (
        "Step 1: q\n\n...\n\nStep 3: <search>s</search>\n\nStep 4: <result>r</result>\n\n"
        "...\n\nStep 7: 1\n\nStep 8: 2\n\nStep 9: 3\n\nStep 10: 4")


def test_snippet_context_and_documents():
    text = "Intro line here. The tower was finished in 1889. Unrelated ending."
    # the middle sentence matches the snippet; 5 characters either side of it
    assert snippet_context(text, "tower finished 1889", 5) == \
        "ere. The tower was finished in 1889. Unre"
    assert snippet_context(text, "zebra", 5) is None
    docs = [PageDoc("T", "u1", "<b>tower</b> finished 1889", text), PageDoc("F", "u2", "s", None)]
    out = format_documents(docs, 5, 10_000)
    first = json.loads(out.split("**Web Page 1:**\n")[1].split("**Web Page 2:**")[0])
    assert first == {"id": 1, "title": "T", "url": "u1", "snippet": "tower finished 1889",
                     "context": "ere. The tower was finished in 1889. Unre"}
    assert json.loads(out.split("**Web Page 2:**\n")[1])["context"] == CANNOT_FETCH
    assert format_documents(docs, 5, 20) == out[:20] + "..."
    # the no-summary variant: no URL; a page without a matching sentence is cut, with "..."
    raw = format_documents([PageDoc("T", "u", "zebra", "abcdefgh")], 3, 1000, for_summary=False)
    assert json.loads(raw.split("\n", 1)[1]) == {"id": 1, "title": "T", "snippet": "zebra",
                                                 "context": "abc..."}


def test_prompt_and_answer_extraction():
    template = resolve_prompt("webpage_to_reasonchain")
    filled = fill_prompt(template, "Step 1: think", "eiffel height", "{page with braces}")
    assert "- **Current Search Query:**\neiffel height\n" in filled
    assert "{page with braces}" in filled and 'search query "eiffel height"' in filled
    with pytest.raises(AppoError, match="document"):
        resolve_prompt("my {prev_reasoning} {search_query}")
    assert extract_final_information("think...\n**Final Information**\n\n330 m\ntall\n") == \
        "330 mtall"  # the original removes newlines
    assert extract_final_information("no marker") == "no marker"


def test_pages_config_errors():
    with pytest.raises(AppoError, match="unknown search pages key"):
        PagesConfig.from_params({"enabled": True, "topk": 3})
    with pytest.raises(AppoError, match="summariser key"):
        PagesConfig.from_params({"summariser": {"url": "x"}})
    assert not PagesConfig.from_params(None).enabled


# ---------------------------------------------------------------------------------------------
# the search tool with pages: live, then replayed with the servers stopped
# ---------------------------------------------------------------------------------------------


def _corpus(tmp_path, base: str) -> Path:
    rows = [{"id": "1", "title": "Eiffel Tower", "text": "The tower was finished in 1889.",
             "url": f"{base}/a.html"},
            {"id": "2", "title": "Slow", "text": "The tower page that is slow.",
             "url": f"{base}/slow.html"},
            {"id": "3", "title": "Gone", "text": "A tower page that is gone.",
             "url": f"{base}/missing.html"},
            {"id": "4", "title": "Paris", "text": "Paris is the capital of France.",
             "url": f"{base}/b.html"}]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _summary_script(seen: list[str]):
    def script(body: dict) -> dict:
        prompt = body["messages"][0]["content"]
        seen.append(prompt)
        assert body["temperature"] == 0.6 and body["max_tokens"] == 4096
        n = prompt.count("**Web Page ")
        return chat(f"<think>hmm</think>\n**Final Information**\n\nsummary of {n} pages, "
                    f"call {len(seen)}")
    return script


def test_deep_search_live_then_replay(tmp_path, pages):
    corpus = _corpus(tmp_path, pages.url)
    prompts: list[str] = []
    summ = ScriptedServer(chat=_summary_script(prompts))
    cache = tmp_path / "cache.sqlite"
    pcfg = {"enabled": True, "top_k": 3, "fetcher": "http", "timeout": 0.5,
            "min_host_interval_s": 0.0,
            "summariser": {"base_url": summ.url, "model": "scripted-model"}}

    def run(miss_policy: str) -> list[tuple[str, bool]]:
        tool = SearchTool(backend="bm25", corpus=str(corpus), cache_file=str(cache),
                          miss_policy=miss_policy, pages=pcfg)
        with ToolExecutor({"search": tool}) as ex:
            calls = [ToolCall("search", "eiffel tower",
                              ("I need the year.", "<search>eiffel tower</search>")),
                     ToolCall("search", "capital of france", ("Now Paris.",))]
            return [(r.text, r.ok) for r in ex.execute_many(calls)]

    live = run("live")
    assert live == [("summary of 3 pages, call 1", True), ("summary of 1 pages, call 2", True)] \
        or live == [("summary of 3 pages, call 2", True), ("summary of 1 pages, call 1", True)]
    tower = next(p for p in prompts if "eiffel tower" in p)
    # page 1 fetched and cut around the snippet's sentence; the slow and the 404 page read
    # as unfetchable; the reasoning so far is in the prompt
    assert "finished in 1889" in tower and tower.count(CANNOT_FETCH) == 2
    assert "Step 1: I need the year.\n\nStep 2: <search>eiffel tower</search>" in tower
    summ.close()
    pages.close()  # both servers stopped: only the cache can answer now
    replay = run("fail")
    assert replay == live
    tool = SearchTool(backend="bm25", corpus=str(corpus), cache_file=str(cache),
                      miss_policy="fail", pages=pcfg)
    other = tool.execute("eiffel tower", context=("a different reasoning",))
    assert not other.ok and "no cached page summary" in other.text
    assert not tool.execute("unseen query").ok


def test_deep_search_store_fetcher_without_summary(tmp_path):
    corpus = _corpus(tmp_path, "https://example.org")
    store = tmp_path / "pages.sqlite"
    build_page_store(corpus, store)
    tool = SearchTool(backend="bm25", corpus=str(corpus), cache_file=str(tmp_path / "c.sqlite"),
                      pages={"enabled": True, "store": str(store), "summarise": False})
    out = tool.execute("capital of france")
    assert out.ok and out.text.startswith("**Web Page 1:**\n")
    assert json.loads(out.text.split("\n", 1)[1])["context"] == \
        "Paris is the capital of France."


def test_summariser_failure_is_an_infra_error_and_not_cached(tmp_path):
    corpus = _corpus(tmp_path, "https://example.org")
    store = tmp_path / "pages.jsonl"
    build_page_store(corpus, store)
    calls = []

    def failing(body):
        calls.append(body)
        return Reply(500, {"error": "boom"}) if len(calls) <= 3 else chat("**Final Information** ok")
    summ = ScriptedServer(chat=failing)
    try:
        tool = SearchTool(backend="bm25", corpus=str(corpus),
                          cache_file=str(tmp_path / "c.sqlite"),
                          pages={"enabled": True, "store": str(store),
                                 "summariser": {"base_url": summ.url}})
        tool.page_step.summariser.client.backoff_s = 0.0
        first = tool.execute("paris")
        assert not first.ok and first.error_kind == "infra" and "HTTP 500" in first.text
        assert tool.execute("paris").text == "ok"  # nothing was cached for the failure
    finally:
        summ.close()


def test_a_summariser_that_is_down_stops_the_run_instead_of_feeding_error_texts(tmp_path):
    """Issue 41 class 3: with the summariser down every search result was an error text the
    model trained on, with log warnings only. The executor built from the config stops at
    `tools.infra_failure_limit` consecutive infrastructure failures of one tool."""
    from appo.config import load_config
    from appo.errors import ToolFatalError
    from appo.tools.executor import ToolCall
    from appo.tools.registry import build_tools

    corpus = _corpus(tmp_path, "https://example.org")
    store = tmp_path / "pages.jsonl"
    build_page_store(corpus, store)
    summ = ScriptedServer(chat=lambda body: Reply(503, {"error": "down"}))
    try:
        yaml_file = tmp_path / "cfg.yaml"
        yaml_file.write_text(
            "tools:\n  enabled: [search]\n  retry_count: 0\n  infra_failure_limit: 3\n"
            "  tool_instances:\n    search:\n"
            "      class_path: appo.tools.search_tool.SearchTool\n"
            f"      params: {{backend: bm25, corpus: {corpus}, cache_file: "
            f"{tmp_path / 'c.sqlite'}, pages: {{enabled: true, store: {store}, "
            f"summariser: {{base_url: '{summ.url}'}}}}}}\n")
        cfg = load_config(yaml_file)
        tools = build_tools(cfg.tools)
        tools.tools["search"].page_step.summariser.client.backoff_s = 0.0
        tools.tools["search"].page_step.summariser.client.retries = 0
        first = tools.execute_many([ToolCall("search", "paris"), ToolCall("search", "france")])
        assert [r.error_kind for r in first] == ["infra", "infra"]  # still given to the model
        with pytest.raises(ToolFatalError) as e:
            tools.execute(ToolCall("search", "capital"))
        assert str(e.value).startswith("tool search: 3 calls in a row failed outside the "
                                       "model's control (last: Error: summariser failed")
        assert "tools.infra_failure_limit" in str(e.value)
        tools.close()
    finally:
        summ.close()


def test_pages_need_a_backend_with_urls(tmp_path):
    replay = tmp_path / "r.json"
    replay.write_text(json.dumps({"q": "Page 1: x"}))
    with pytest.raises(AppoError, match="does not record"):
        SearchTool(backend="replay", replay_file=str(replay),
                   cache_file=str(tmp_path / "c.sqlite"), pages={"enabled": True})


def test_cli_pages_build_and_query_with_config(tmp_path, capsys):
    from appo.cli import main as cli_main

    corpus = _corpus(tmp_path, "https://example.org")
    store = tmp_path / "pages.sqlite"
    assert cli_main(["search", "pages", "build", str(corpus), "--out", str(store)]) == 0
    assert "wrote 4 pages" in capsys.readouterr().out
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "tools:\n  tool_instances:\n    search:\n"
        "      class_path: appo.tools.search_tool.SearchTool\n"
        f"      params: {{backend: bm25, corpus: {corpus}, cache_file: {tmp_path / 'c.sqlite'},"
        f" pages: {{enabled: true, store: {store}, summarise: false}}}}\n")
    assert cli_main(["search", "query", "capital of france", "--config", str(cfg)]) == 0
    assert "Paris is the capital of France." in capsys.readouterr().out


@pytest.mark.parametrize("name", ["aepo_qwen3_14b_deepsearch.yaml",
                                  "appo_qwen3_8b_deepsearch.yaml"])
def test_published_deep_search_config_builds_the_page_step(tmp_path, name):
    """The configs' pages block is valid as written; turned on (as for the papers' eval),
    with a local corpus and page store instead of Bright Data and live pages, it runs."""
    from appo.config import load_config, to_container

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "configs" / name)
    params = to_container(cfg.tools.tool_instances["search"].params)
    corpus = _corpus(tmp_path, "https://example.org")
    store = tmp_path / "pages.jsonl"
    build_page_store(corpus, store)
    params.update(backend="bm25", corpus=str(corpus), cache_file=str(tmp_path / "c.sqlite"))
    params["pages"].update(enabled=True, fetcher="store", store=str(store), summarise=False)
    tool = SearchTool(**params)
    assert tool.page_step.cfg.context_chars == 3000
    assert "Paris is the capital" in tool.execute("capital of france").text


def test_summariser_completions_api_and_exact_url_keys(tmp_path):
    from eval_server import completion

    from appo.tools.page_step import PageStep
    from appo.tools.search_backends import Hit
    from appo.tools.search_cache import SearchCache

    store = tmp_path / "pages.jsonl"
    store.write_text(json.dumps({"url": "https://x.org/A", "text": "upper page"}) + "\n"
                     + json.dumps({"url": "https://x.org/a", "text": "lower page"}) + "\n")
    server = ScriptedServer(completions=lambda body: completion(
        "**Final Information**\n" + body["prompt"].split('"context": "')[1].split('"')[0]))
    cache = SearchCache(tmp_path / "c.sqlite")
    try:
        cfg = PagesConfig.from_params({"enabled": True, "store": str(store), "summariser": {
            "base_url": server.url, "api": "completions", "model": "m"}})
        step = PageStep(cfg, cache, live=True)
        # URLs differing only in case are different pages (the search query key would
        # case-fold them)
        upper = step.run("q", [Hit("https://x.org/A", "t", "zebra")])
        lower = step.run("q", [Hit("https://x.org/a", "t", "zebra")])
    finally:
        server.close()
    assert (upper.text, lower.text) == ("upper page", "lower page")
    assert "messages" not in server.posts("/v1/completions")[0].body
    with pytest.raises(AppoError, match="summariser.api"):
        PagesConfig.from_params({"summariser": {"api": "responses"}})


def _deep_in_child(corpus, store, cache, url, out, query="capital of france") -> None:
    tool = SearchTool(backend="bm25", corpus=str(corpus), cache_file=str(cache),
                      pages={"enabled": True, "store": str(store),
                             "summariser": {"base_url": url, "model": "m"}})
    out.put(tool.execute(query).text)


def test_page_step_cache_across_processes_and_kill9(tmp_path):
    """Two processes summarising the same search at once get one answer (the first stored,
    what a replay returns); a process killed with SIGKILL while waiting for its summary
    leaves the cache sound."""
    import multiprocessing as mp
    import os
    import signal

    corpus = _corpus(tmp_path, "https://example.org")
    store = tmp_path / "pages.jsonl"
    build_page_store(corpus, store)
    cache = tmp_path / "cache.sqlite"
    calls: list[int] = []
    lock = threading.Lock()

    def slow_summary(body):
        with lock:
            calls.append(1)
            n = len(calls)
        # the first request is answered last: if the second child's request comes while it
        # waits, "answer 2" is stored first and the first child must return it too
        return Reply(body=chat(f"**Final Information** answer {n}"),
                     delay=2.0 if n == 1 else 0.0)

    server = ScriptedServer(chat=slow_summary)
    ctx = mp.get_context("fork")
    try:
        out = ctx.Queue()
        procs = [ctx.Process(target=_deep_in_child, args=(corpus, store, cache, server.url, out))
                 for _ in range(2)]
        for p in procs:
            p.start()
        texts = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
        # under load the second child may start after the first stored its answer (one
        # call, a cache hit); either way both return the stored text
        expected = "answer 2" if len(calls) == 2 else "answer 1"
        print(f"summary calls: {len(calls)}")
        assert texts == [expected, expected]

        # kill -9 a process waiting for its summary (a new query: a cache miss)
        server.chat = lambda body: Reply(body=chat("**Final Information** late"), delay=30)
        victim = ctx.Process(target=_deep_in_child, args=(corpus, store, cache, server.url,
                                                          ctx.Queue(), "eiffel tower"))
        n_before = len(server.posts("/v1/chat/completions"))
        cache_tool = SearchTool(backend="bm25", corpus=str(corpus), cache_file=str(cache),
                                miss_policy="fail",
                                pages={"enabled": True, "store": str(store),
                                       "summariser": {"model": "m"}})
        victim.start()
        deadline = time.monotonic() + 30
        while len(server.posts("/v1/chat/completions")) == n_before:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
    finally:
        server.close()
    assert cache_tool.cache.integrity_check() == "ok"
    assert cache_tool.execute("capital of france").text == expected  # replayed offline
