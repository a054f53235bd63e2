"""The search tool's page step inside the tool loop: the loop hands the row's steps so far to
the tool, the summary prompt carries them, and the summary is the forced `<result>`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rollout_fakes import ScriptedEngine, Step, tiny_tokenizer

from appo.rollout import RolloutPrompt, RolloutSettings, rollout
from appo.tools.executor import ToolExecutor
from appo.tools.pages import build_page_store
from appo.tools.search_tool import SearchTool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from eval_server import ScriptedServer, chat  # noqa: E402


def test_deep_search_in_the_tool_loop(tmp_path, monkeypatch):
    monkeypatch.setenv("APPO_CACHE", str(tmp_path / "appo-cache"))
    tok = tiny_tokenizer()
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": "1", "title": "Eiffel Tower", "text": "The tower was finished in 1889."},
            {"id": "2", "title": "Paris", "text": "Paris is the capital of France."}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "pages.jsonl"
    build_page_store(corpus, store)
    prompts: list[str] = []

    def summarise(body):
        prompts.append(body["messages"][0]["content"])
        return chat("**Final Information**\n\nfinished in 1889")

    server = ScriptedServer(chat=summarise)
    try:
        tool = SearchTool(backend="bm25", corpus=str(corpus),
                          cache_file=str(tmp_path / "cache.sqlite"),
                          pages={"enabled": True, "store": str(store),
                                 "summariser": {"base_url": server.url}})

        def script(engine, rid, ids):
            if engine.count(ids, "<result>") == 0:
                return Step("<think>when</think><search>eiffel tower finished</search>")
            return Step("<answer>1889</answer>", finish="eos")

        with ToolExecutor({"search": tool}) as tools:
            batch = rollout([RolloutPrompt("q", tok.encode("When?"))],
                            ScriptedEngine(tok, script), tools,
                            RolloutSettings(n=1, initial_rollouts=1, max_response_length=400,
                                            call_limit=3), strategy="grpo")
    finally:
        server.close()
    [traj] = batch.trajectories
    assert [c.result for c in traj.tool_calls] == ["finished in 1889"]
    [p] = prompts
    # the row's one step so far (the model segment with the call) is the previous reasoning
    step = tok.decode(tok.encode("<think>when</think><search>eiffel tower finished</search>"))
    assert f"- **Previous Reasoning Steps:**\nStep 1: {step}\n" in p
    assert '"url": "corpus:Eiffel Tower"' in p and "finished in 1889." in p
