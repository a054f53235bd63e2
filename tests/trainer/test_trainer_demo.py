"""`appo demo`: its config file stays in sync, the table is right, and a tiny run writes the report."""

from __future__ import annotations

import json
from pathlib import Path

from appo.cli import main
from appo.config import load_config, to_container
from appo.trainer.demo import LevelScore, StageResult, demo_config, results_table

ROOT = Path(__file__).resolve().parents[2]


def test_configs_demo_yaml_is_the_demo_config():
    from_file = to_container(load_config(str(ROOT / "configs" / "demo.yaml")))
    assert from_file == to_container(demo_config())


def test_results_table_hand_built():
    stages = [
        StageResult("base", 1.0, [LevelScore(1, 4, 0.0, 0.0), LevelScore(2, 4, 0.0, 0.25)]),
        StageResult("sft", 1.0, [LevelScore(1, 4, 1.0, 1.0), LevelScore(2, 4, 0.25, 1.0)]),
    ]
    lines = results_table(stages).splitlines()
    assert lines[0] == "| level | questions | base acc | sft acc | base calls/answer | sft calls/answer |"
    assert lines[2] == "| 1 | 4 | 0.0% | 100.0% | 0.00 | 1.00 |"
    assert lines[3] == "| 2 | 4 | 0.0% | 25.0% | 0.25 | 1.00 |"


def test_tiny_demo_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # A previous demo's stages: a rerun replaces them (the demo sets trainer.overwrite=true)
    # instead of refusing their non-empty run directories.
    for stage in ("sft", "rl"):
        old = tmp_path / "runs" / "demo" / stage
        (old / "global_step_99").mkdir(parents=True)
        (old / "metrics.jsonl").write_text('{"step": 99}\n')
    rc = main([
        "demo", "model.path=tiny-test", "sft.max_steps=2", "sft.max_length=4096",
        "trainer.total_steps=1", "data.max_prompt_length=2048", "data.max_response_length=24",
        "eval.max_response_length=24",
        "data.val_files=[synth:arith?split=eval&levels=1&n=2,synth:arith?split=eval&levels=2&n=3]",
        "rollout.n=4", "rollout.initial_rollouts=2", "data.train_batch_size=2",
        # In process: the demo's memory target (2.5 GB) would count what earlier tests in
        # this worker left resident, so whether it fits depended on the test order.
        "actor.max_memory_gb=null",
    ])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| level | questions | base acc | sft acc | rl acc |" in out
    report = tmp_path / "runs" / "demo"
    summary = json.loads((report / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == ["base", "sft", "rl"]
    assert [lv["questions"] for lv in summary["stages"][0]["levels"]] == [2, 3]
    assert summary["sft"]["steps"] == 2 and summary["rl"]["steps"] == 1
    for name in ("report.md", "eval_base.jsonl", "eval_sft.jsonl", "eval_rl.jsonl",
                 "rl/metrics.jsonl"):
        assert (report / name).is_file(), name
    assert len((report / "eval_rl.jsonl").read_text().splitlines()) == 5
    assert list((report / "rl" / "rollouts").glob("step_*.jsonl"))
    assert list((report / "rl" / "plots").glob("*.png"))
    assert not list(report.glob("*/global_step_99"))
    assert "removed the previous run in runs/demo/rl" in out
