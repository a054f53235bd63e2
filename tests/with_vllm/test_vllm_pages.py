"""The deep-search page step summarising with a real `vllm serve` of SmolLM2-135M on
127.0.0.1 (marker `vllm`), then replayed with the server out of reach and
miss_policy=fail: identical results.

SmolLM2-135M's tokenizer has no chat template, so the summariser sends the prompt as is
(`api: completions`); greedy and short, so the model's (poor) summary is quick. What is
checked is the plumbing on a real server: the request is accepted, the text after
`**Final Information**` (or the whole output) becomes the result, and the cache replays it.
"""

from __future__ import annotations

import json

import pytest

from appo.tools.executor import ToolCall, ToolExecutor
from appo.tools.pages import build_page_store
from appo.tools.search_tool import SearchTool

pytestmark = pytest.mark.vllm


def test_page_step_summarises_with_vllm_and_replays(vllm_server, tmp_path, monkeypatch):
    monkeypatch.setenv("APPO_CACHE", str(tmp_path / "appo-cache"))
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": "1", "title": "Eiffel Tower", "text": "The Eiffel Tower was finished in "
             "1889. It is 330 metres tall."},
            {"id": "2", "title": "Paris", "text": "Paris is the capital of France."}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "pages.sqlite"
    build_page_store(corpus, store)
    summariser = {"base_url": vllm_server.url, "model": vllm_server.model,
                  "api": "completions", "temperature": 0.0, "max_tokens": 24}

    def run(miss_policy: str, base_url: str) -> list:
        tool = SearchTool(backend="bm25", corpus=str(corpus),
                          cache_file=str(tmp_path / "cache.sqlite"), miss_policy=miss_policy,
                          pages={"enabled": True, "store": str(store), "top_k": 2,
                                 "summariser": {**summariser, "base_url": base_url}})
        with ToolExecutor({"search": tool}) as ex:
            calls = [ToolCall("search", "eiffel tower height",
                              ("<think>How tall?</think><search>eiffel tower height</search>",))]
            return [(r.ok, r.text, r.error_kind) for r in ex.execute_many(calls)]

    live = run("live", vllm_server.url)
    [(ok, text, kind)] = live
    assert ok and kind is None and text.strip(), live
    print(f"\nSmolLM2 summary: {text!r}")
    # the replay cannot reach any server (a closed port) and must not need one
    replay = run("fail", "http://127.0.0.1:9")
    assert replay == live
