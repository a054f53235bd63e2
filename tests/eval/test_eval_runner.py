"""`appo eval` end to end against a scripted completions server (and a scripted judge).

The server plays a model that uses the real python tool: it reads the question and any tool
result from the prompt it is sent and answers accordingly, so every number in the summary is
known in advance. Runs go through `appo.cli.main` in-process.
"""

from __future__ import annotations

import json
import re
import threading

import pytest
from eval_server import Reply, ScriptedServer, chat, completion

from appo.cli import main
from appo.eval.records import read_samples
from appo.models.tiny import build_tiny_tokenizer

QUESTIONS = [
    {"question": "What is 6*7?", "answer": "42"},
    {"question": "What is 2+3?", "answer": 5},
    {"question": "What is 10-1?", "answer": "9"},
]
TOK = build_tiny_tokenizer()


class ToyModel:
    """q0: python, then the tool's result; q1: answers at once; q2: python, then answers
    right the first time and wrong the second (so pass@1 != pass@2)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.q2_answers = 0
        self.fail_q1: Reply | None = None

    def __call__(self, body):
        text = TOK.decode(body["prompt"])
        response = text.rsplit("<|im_start|>assistant\n", 1)[1]
        result = re.findall(r"<result>\n(.*?)\n</result>", response, re.DOTALL)
        if "What is 2+3?" in text:
            if self.fail_q1 is not None:
                return self.fail_q1
            return completion("<think>easy</think> <answer>\\boxed{5}</answer>", stop_reason=None)
        code = "print(6*7)" if "What is 6*7?" in text else "print(10-1)"
        if not result:
            return completion(f"<think>compute</think> <python>{code}", stop_reason="</python>")
        answer = result[-1].strip()
        if "10-1" in code:
            with self.lock:
                self.q2_answers += 1
                if self.q2_answers % 2 == 0:
                    answer = "8"
        return completion(f"<think>done</think> <answer>\\boxed{{{answer}}}</answer>",
                          stop_reason=None)


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


@pytest.fixture
def server(monkeypatch, tmp_path):
    monkeypatch.setenv("APPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    s = ScriptedServer(completions=ToyModel())
    yield s
    s.close()


def run_eval(server, data_file, out, *extra):
    return main(["eval", "--base-url", server.url, "--model", "tiny-test",
                 "--data", f"toy={data_file}", "--out", str(out), *extra])


def summary(out):
    return json.loads((out / "summary.json").read_text())


def test_eval_summary_resume_and_files(server, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_eval(server, data_file, out, "--k", "2") == 0
    printed = capsys.readouterr().out
    assert "toy" in printed and "pass@2" in printed

    s = summary(out)
    [toy] = s["benchmarks"]
    assert (toy["questions"], toy["samples"], toy["failed_samples"]) == (3, 6, 0)
    # c = (2, 2, 1) of n = 2: pass@1 = (1 + 1 + 1/2) / 3; pass@2 = (1 + 1 + 1) / 3.
    assert toy["pass_at_1"] == pytest.approx(2.5 / 3)
    assert toy["pass_at_k"] == pytest.approx(1.0)
    # q0 and q2 make one python call per sample, q1 none: 4 calls over 6 answers.
    assert toy["tool_calls_per_answer"] == pytest.approx(4 / 6)
    assert toy["tool_calls_per_tool"] == {"python": pytest.approx(4 / 6)}
    assert toy["tool_usage_rate"] == pytest.approx(4 / 6)
    assert toy["tool_error_rate"] == 0.0 and toy["format_failure_rate"] == 0.0
    assert s["overall"]["pass_at_1"] == pytest.approx(toy["pass_at_1"])
    assert s["run"]["sampling"] == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                    "repetition_penalty": 1.1}
    assert s["run"]["tool_call_limits"] == {"python": 5}
    assert "| toy | 3 | 6 |" in (out / "summary.md").read_text()

    records = read_samples(out / "toy" / "samples.jsonl")
    assert sorted(r.key for r in records) == [(str(q), s) for q in range(3) for s in range(2)]
    q0 = [r for r in records if r.question_id == "0"][0]
    assert q0.answer == "42" and q0.correct and q0.tool_calls == {"python": 1}
    assert "<python>print(6*7)</python> <result>\n42\n</result>" in q0.prediction
    trajs = (out / "toy" / "trajectories.jsonl").read_text().splitlines()
    assert len(trajs) == 6
    first = json.loads(trajs[0])
    assert "token_text" in first["extra"] and first["reward"] in (0.0, 1.0)

    # A rerun finds every sample finished: no request reaches the model.
    before = len(server.posts())
    assert run_eval(server, data_file, out, "--k", "2") == 0
    assert len(server.posts()) == before
    assert summary(out)["run"]["samples_resumed"] == 6
    assert len(read_samples(out / "toy" / "samples.jsonl")) == 6

    # Asking for more samples generates only the missing ones.
    assert run_eval(server, data_file, out, "--k", "3") == 0
    assert summary(out)["run"]["samples_generated"] == 3
    assert summary(out)["benchmarks"][0]["samples"] == 9


def test_failed_generations_are_reported_and_retried(server, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    server.completions.fail_q1 = Reply(400, {"error": "maximum context length exceeded"})
    assert run_eval(server, data_file, out, "--k", "2") == 1  # finished, with failures
    captured = capsys.readouterr()
    assert "2 failed" in captured.out and "rerun" in captured.out
    toy = summary(out)["benchmarks"][0]
    assert (toy["samples"], toy["failed_samples"]) == (4, 2)
    failed = [r for r in read_samples(out / "toy" / "samples.jsonl") if r.error]
    assert len(failed) == 2 and all("maximum context length" in r.error for r in failed)
    # pass@k leaves out the question without k finished samples.
    assert toy["incomplete_questions"] == 1

    server.completions.fail_q1 = None
    assert run_eval(server, data_file, out, "--k", "2") == 0
    s = summary(out)
    assert s["run"]["samples_generated"] == 2 and s["run"]["samples_resumed"] == 4
    assert (s["benchmarks"][0]["samples"], s["benchmarks"][0]["failed_samples"]) == (6, 0)


def test_per_tool_call_limit(server, data_file, tmp_path):
    def python_twice(body):
        text = TOK.decode(body["prompt"])
        if "python may be called at most 1 times" in text:
            return completion("<answer>\\boxed{0}</answer>", stop_reason=None)
        return completion("<python>print(1)", stop_reason="</python>")

    server.completions = python_twice
    two_tools = ["tools.tool_instances.echo.class_path=eval_server.EchoTool",
                 "eval.tool_call_limits.python=1"]
    out = tmp_path / "run"
    assert run_eval(server, data_file, out, "--limit", "1", *two_tools) == 0
    [rec] = read_samples(out / "toy" / "samples.jsonl")
    # The second python call is refused by python's own limit (1), well before the total
    # (1 python + 3 echo, the default tools.call_limit for a tool without an eval limit).
    assert rec.tool_calls == {"python": 1} and rec.limit_hits == 1
    assert "Tool call limit reached: python may be called at most 1 times" in rec.prediction
    assert rec.finish_reason == "eos" and rec.answer == "0"
    assert summary(out)["run"]["tool_call_limits"] == {"python": 1, "echo": 3}

    def python_forever(body):
        return completion("<python>print(1)", stop_reason="</python>")

    server.completions = python_forever
    out2 = tmp_path / "run-stop"
    assert run_eval(server, data_file, out2, "--limit", "1", *two_tools,
                    "rollout.on_limit=stop") == 0
    [rec] = read_samples(out2 / "toy" / "samples.jsonl")
    assert rec.tool_calls == {"python": 1} and rec.finish_reason == "call_limit"


def test_judge_after_the_verifier_and_cached(server, data_file, tmp_path):
    asked = []

    def judge(body):
        prompt = body["messages"][-1]["content"]
        asked.append(prompt)
        assert body["model"] == "judge-x"
        return chat("<think>8 is close enough</think> Correct")

    server.chat = judge
    out = tmp_path / "run"
    args = ["--k", "2", "--judge-base-url", server.url, "--judge-model", "judge-x"]
    assert run_eval(server, data_file, out, *args) == 0
    # Only the sample the verifier rejected (q2's "8") goes to the judge, which accepts it.
    assert len(asked) == 1
    assert "Labeled Answer: 9" in asked[0] and "Predicted Answer: 8" in asked[0]
    toy = summary(out)["benchmarks"][0]
    assert toy["pass_at_1"] == pytest.approx(1.0) and toy["judged"] == 1
    judged = [r for r in read_samples(out / "toy" / "samples.jsonl") if r.judge]
    assert [(r.answer, r.correct_rule, r.correct, r.judge) for r in judged] == [
        ("8", False, True, "Correct")]

    # A second evaluation of the same predictions: the verdict comes from the cache.
    assert run_eval(server, data_file, tmp_path / "run2", *args) == 0
    assert len(asked) == 1
    assert summary(tmp_path / "run2")["run"]["judge"]["cache_hits"] == 1


def test_output_dir_of_another_dataset_is_refused(server, data_file, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_eval(server, data_file, out, "--limit", "1") == 0
    data_file.write_text(json.dumps({"question": "What is 1+1?", "answer": "2"}) + "\n")
    assert run_eval(server, data_file, out, "--limit", "1") == 2
    assert "another run" in capsys.readouterr().err


def test_bad_arguments_name_the_problem(tmp_path, capsys):
    assert main(["eval", "--model", "tiny-test", "--data", str(tmp_path / "missing.jsonl"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "not found" in capsys.readouterr().err
    assert main(["eval", "--model", "tiny-test", "--limit", "0"]) == 2
    assert main(["eval", "--base-url", "http://127.0.0.1:9", "--model", "tiny-test",
                 "--data", "synth:arith?split=eval&n=1", "--out", str(tmp_path / "o")]) == 2
    assert "cannot list the models" in capsys.readouterr().err


def test_local_engine_smoke(tmp_path, monkeypatch):
    """The local hf engine path with the random tiny model: runs, writes, summarises."""
    monkeypatch.setenv("APPO_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    assert main(["eval", "--model", "tiny-test", "--data", "synth:arith?split=eval&n=2",
                 "--k", "2", "--out", str(out), "eval.max_response_length=24"]) == 0
    s = summary(out)
    [arith] = s["benchmarks"]
    assert arith["name"] == "arith" and (arith["questions"], arith["samples"]) == (2, 4)
    assert s["run"]["backend"] == "hf" and s["run"]["tokens_decoded"] > 0
    records = read_samples(out / "arith" / "samples.jsonl")
    assert all(r.response_tokens <= 24 for r in records)


def test_native_calls_in_eval(server, data_file, tmp_path, capsys):
    # tools.format=hermes: the prompt declares the tool to the chat template, the model's
    # <tool_call> turn ends at <|im_end|> and the result comes back in a <tool_response>.
    prompts = []

    def native(body):
        text = TOK.decode(body["prompt"])
        prompts.append(text)
        if "<tool_response>\n" not in text:
            call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call>'
            return completion(call, stop_reason=None)
        result = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.DOTALL)[-1]
        return completion(f"<answer>\\boxed{{{result.strip()}}}</answer>", stop_reason=None)

    server.completions = native
    out = tmp_path / "run"
    assert run_eval(server, data_file, out, "--limit", "1", "tools.format=hermes") == 0
    assert "template check (hermes): ok" in capsys.readouterr().err
    [rec] = read_samples(out / "toy" / "samples.jsonl")
    assert rec.tool_calls == {"python": 1} and rec.answer == "42" and rec.finish_reason == "eos"
    assert '"name": "python"' in prompts[0] and "<python>" not in prompts[0]
    assert prompts[1].endswith("<tool_response>\n42\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n")
