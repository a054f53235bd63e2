"""docs/metrics.md lists every key `appo eval` (summary.json) and `appo compare` (each pair's
result.json and pair.json) write, checked against what a run writes: an eval against the
scripted server of tests/eval (no model weights), and the `eval.start` pair of a tiny-test
comparison (an evaluation, no training). The trainer's keys: tests/test_examples.py.

A key is a JSON path (`run.sampling.temperature`, `benchmarks[].pass_at_1`); a documented
`<name>` matches any one path part (a benchmark, tool or eval set name).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "metrics.md"


def section(title: str) -> str:
    """The text of the `## <title>` section of docs/metrics.md (up to the next `## `)."""
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def json_paths(value, prefix: str = "") -> set[str]:
    """Every leaf path of a JSON value: dicts by key, lists of dicts as `name[]`."""
    if isinstance(value, dict):
        out: set[str] = set()
        for key, item in value.items():
            out |= json_paths(item, f"{prefix}.{key}" if prefix else key)
        return out
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return set().union(*(json_paths(v, prefix + "[]") for v in value))
    return {prefix}


def undocumented(paths: set[str], doc: str) -> list[str]:
    documented = set(re.findall(r"`([a-z0-9_\[\]<>.]+)`", doc))
    patterns = [re.compile("^" + re.escape(k).replace("<name>", "[^.]+") + "$")
                for k in documented if "<name>" in k]
    return sorted(p for p in paths
                  if p not in documented and not any(pat.match(p) for pat in patterns))


def test_the_key_check_finds_what_is_missing():
    doc = "| `run.k` | | `sets.<name>.greedy` | | `benchmarks[].pass_at_1` |"
    paths = json_paths({"run": {"k": 1, "new": 2}, "sets": {"toy": {"greedy": [1.0]}},
                        "benchmarks": [{"pass_at_1": 0.5, "other": 1}]})
    assert paths == {"run.k", "run.new", "sets.toy.greedy", "benchmarks[].pass_at_1",
                     "benchmarks[].other"}
    assert undocumented(paths, doc) == ["benchmarks[].other", "run.new"]


def test_every_key_of_an_eval_summary_is_documented(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tests" / "eval"))
    monkeypatch.setenv("APPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    from eval_server import ScriptedServer, completion

    from appo.cli import main

    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a}+{a}?", "answer": str(2 * a)})
                            + "\n" for a in range(3)))
    server = ScriptedServer(completions=lambda body: completion(
        "<think>x</think> <answer>\\boxed{2}</answer>", stop_reason=None))
    try:
        out = tmp_path / "eval"
        assert main(["eval", "--base-url", server.url, "--model", "tiny-test", "--data",
                     f"toy={data}", "--out", str(out), "--k", "2"]) == 0
    finally:
        server.close()
    summary = json.loads((out / "summary.json").read_text())
    # `overall` is a row like the benchmarks' (the doc lists its fields once).
    assert set(summary["overall"]) == set(summary["benchmarks"][0])
    paths = json_paths({"run": summary["run"], "benchmarks": summary["benchmarks"]})
    assert "benchmarks[].pass_at_1" in paths and "run.sampling.temperature" in paths
    assert undocumented(paths, section("`appo eval`")) == []


def test_every_key_of_a_compare_pair_is_documented(tmp_path):
    from appo.compare.runner import PAIR_FILE, RESULT_FILE, run_pair
    from appo.compare.spec import load_spec
    from appo.config import flatten, load_config, to_container

    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}?", "answer": "7"}) + "\n"
                            for i in range(3)))
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump({
        "output_dir": str(tmp_path / "out"),
        "base": {"overrides": ["model.path=tiny-test", f"data.train_files=[{data}]",
                               "data.val_files=[]", "data.max_response_length=8",
                               "data.max_prompt_length=1024", "trainer.total_steps=1"]},
        "variants": {"grpo": ["rollout.strategy=grpo"]},
        "seeds": [1],
        "eval": {"sets": {"toy": str(data)}, "k": 2, "temperature": 1.0, "start": True,
                 "max_response_length": 8},
    }))
    spec = load_spec(spec_file)
    run_pair(spec, "start", 1, progress=False)
    run_dir = spec.run_dir("start", 1)
    result = json.loads((run_dir / RESULT_FILE).read_text())
    paths = json_paths(result)
    assert "sets.toy.greedy" in paths and "eval_seconds" in paths
    doc = section("`appo compare`")
    assert undocumented(paths, doc) == []
    pair = json.loads((run_dir / PAIR_FILE).read_text())
    config_keys = set(flatten(to_container(load_config())))
    extra = {k for k in pair if k not in config_keys}
    assert extra <= set(re.findall(r"`(eval\.[a-z_]+)`", doc)), extra
