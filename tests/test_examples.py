"""The tutorial's example files (docs/tutorial.md, examples/) run as the tutorial says.

`examples/tutorial.yaml` with its own data (`reverse_*.jsonl`), reward (`reward.py`) and tool
(`reverse_tool.py`) trains through the command line on the tiny random model, with the
overrides the tutorial's five-minute check gives, and through the Python API the README shows.
The CLI run also checks that docs/metrics.md lists every key the training writes.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from cli_runner import run_cli

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
# The tutorial's five-minute check, shortened to one step.
TINY = ["model.path=tiny-test", "data.max_prompt_length=1024", "trainer.total_steps=1",
        "data.val_files=[]", "data.max_response_length=16", "rollout.n=2",
        "rollout.initial_rollouts=1"]


def test_example_reward_and_tool(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))  # examples/ is not a package
    from reverse_tool import ReverseTool

    from appo.rewards.router import RewardRouter

    tool = ReverseTool(max_chars=6)
    assert tool.execute(" banana ").text == "ananab"
    assert not tool.execute("").ok and not tool.execute("bananas").ok
    router = RewardRouter(custom_path=EXAMPLES / "reward.py", custom_name="compute_score")
    score = router.custom(solution_str="<answer> \\boxed{ananab} </answer>", ground_truth="ananab")
    assert score["score"] == 1.0
    assert router.custom(solution_str="ananab", ground_truth="ananab")["score"] == -1.0


def test_the_system_prompt_teaches_the_example_tool():
    from appo.config import load_config
    from appo.data.templates import render_system_prompt, tools_from_config

    cfg = load_config(EXAMPLES / "tutorial.yaml")
    tags = tools_from_config(cfg)
    assert tags == ["reverse"]
    assert "<reverse>" in render_system_prompt(cfg.data.template, tags)


def test_tutorial_trains_from_the_command_line(tmp_path):
    env = dict(os.environ, APPO_CACHE=str(tmp_path / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(EXAMPLES), str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
    out = tmp_path / "run"
    cwd = os.getcwd()
    os.chdir(REPO)  # the YAML's paths are relative to the repository root, as documented
    try:
        r = run_cli("train", "--config", "examples/tutorial.yaml", *TINY,
                    f"trainer.default_local_dir={out}", env=env, timeout=120)
    finally:
        os.chdir(cwd)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]
    # reward.py's score: -1 without an <answer> block, else 0 or 1; the random model's
    # responses score -1 or 0, never a built-in reward's value outside that set.
    assert rows[0]["reward/mean"] <= 1.0
    assert (out / "global_step_1" / "manifest.json").is_file()
    assert undocumented_metrics(rows) == []


def undocumented_metrics(rows: list[dict]) -> list[str]:
    """Keys of `metrics.jsonl` rows that docs/metrics.md does not list (`<tool>`-style
    placeholders in a documented key match any name)."""
    documented = set(re.findall(r"`([a-z_]+/[^`\s]+|step)`",
                                (REPO / "docs" / "metrics.md").read_text(encoding="utf-8")))
    patterns = [re.compile("^" + re.sub(r"<[a-z]+>", "[^/]+", re.escape(k).replace(r"\<", "<")
                                        .replace(r"\>", ">")) + "$")
                for k in documented if "<" in k]
    keys = sorted({k for row in rows for k in row})
    return [k for k in keys if k not in documented and not any(p.match(k) for p in patterns)]


def test_undocumented_metrics_are_found():
    rows = [{"step": 1, "reward/mean": 0.0, "rollout/calls_reverse_per_traj": 1.0,
             "rollout/new_thing": 2.0}]
    assert undocumented_metrics(rows) == ["rollout/new_thing"]


def test_tutorial_trains_from_python(tmp_path, monkeypatch):
    """The README's Python API snippet, with the tiny model."""
    monkeypatch.chdir(REPO)
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("APPO_CACHE", str(tmp_path / "cache"))
    import appo

    cfg = appo.load_config("examples/tutorial.yaml",
                           overrides=[*TINY, "trainer.logger=[]",
                                      f"trainer.default_local_dir={tmp_path / 'run'}"])
    trainer = appo.RLTrainer(cfg, progress=False)
    history = trainer.fit()
    assert [h["step"] for h in history] == [1]
    assert -1.0 <= history[-1]["reward/mean"] <= 1.0
    assert trainer.out_dir == tmp_path / "run"


@pytest.mark.parametrize("name", ["reverse_train.jsonl", "reverse_eval.jsonl"])
def test_example_data_rows(name):
    rows = [json.loads(line) for line in (EXAMPLES / name).read_text().splitlines()]
    assert rows and all(set(row) == {"question", "answer"} for row in rows)
