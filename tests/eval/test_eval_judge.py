"""The judge: the original's verdict rule, requests, caching, failures."""

from __future__ import annotations

import pytest
from eval_server import Reply, ScriptedServer, chat

from appo.eval.judge import Judge, JudgeRequest, parse_verdict
from appo.http import JsonClient


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [
        ("Correct", "Correct"),
        ("correct.", "Correct"),
        ("**Correct**", "Correct"),
        ("<think>The answers differ... or do they? Incorrect?</think>\nCorrect", "Correct"),
        ("The predicted answer is correct.", "Correct"),
        ("Incorrect", "Incorrect"),
        ("INCORRECT", "Incorrect"),
        ("Not correct", "Incorrect"),
        ("Correct? No, wrong.", "Incorrect"),
        ("<think>Correct</think>", "Incorrect"),  # only the reasoning said it
        ("", "Incorrect"),
        ("I cannot tell", "Incorrect"),
    ],
)
def test_verdict_rule(reply, verdict):
    assert parse_verdict(reply) == verdict


@pytest.fixture
def server():
    s = ScriptedServer()
    yield s
    s.close()


def make(server, tmp_path, **kw):
    return Judge(server.url, kw.pop("model", "judge-x"), cache_path=tmp_path / "judge.sqlite",
                 client=JsonClient(timeout=2, retries=0, backoff_s=0), **kw)


def test_requests_and_cache(server, tmp_path):
    def script(body):
        prompt = body["messages"][0]["content"]
        assert body["model"] == "judge-x" and body["temperature"] == 0.0
        return chat("Correct" if "Predicted Answer: forty-two" in prompt else "Incorrect")

    server.chat = script
    judge = make(server, tmp_path)
    reqs = [JudgeRequest("What is 6*7?", "42", "forty-two"),
            JudgeRequest("What is 6*7?", ["42", "42.0"], "41")]
    verdicts = judge(reqs)
    assert [v.verdict for v in verdicts] == ["Correct", "Incorrect"]
    prompts = [p.body["messages"][0]["content"] for p in server.posts("/v1/chat/completions")]
    assert any("Labeled Answer: 42 / 42.0" in p for p in prompts)  # a list of accepted answers
    assert (judge.calls, judge.cache_hits) == (2, 0)
    judge.close()

    again = make(server, tmp_path)  # a new process would see the same file
    assert [v.verdict for v in again(reqs)] == ["Correct", "Incorrect"]
    assert (again.calls, again.cache_hits) == (0, 2)
    assert len(server.posts("/v1/chat/completions")) == 2
    # Another judge model does not reuse these verdicts.
    other = make(server, tmp_path, model="judge-y")
    server.chat = lambda body: chat("Correct")
    assert [v.verdict for v in other(reqs)] == ["Correct", "Correct"]


def test_failures_are_errors_and_not_cached(server, tmp_path):
    server.chat = lambda body: Reply(503, {"error": "judge overloaded"})
    judge = make(server, tmp_path)
    [v] = judge([JudgeRequest("q", "1", "2")])
    assert v.verdict is None and "HTTP 503" in v.error and judge.errors == 1
    server.chat = lambda body: {"choices": [{"message": {}}]}
    [v] = judge([JudgeRequest("q", "1", "2")])
    assert v.verdict is None and "unexpected reply" in v.error
    server.chat = lambda body: chat("Correct")
    [v] = judge([JudgeRequest("q", "1", "2")])
    assert v.verdict == "Correct" and not v.cached


def test_model_name_from_the_server(server, tmp_path):
    server.models = ("served-judge",)
    judge = make(server, tmp_path, model=None)
    assert judge.model == "served-judge" and judge.backend == "judge:served-judge"
