"""`appo rollout` end to end on tiny-test (subprocess), and its user errors."""

from __future__ import annotations

import json

from appo.rollout import read_jsonl
from cli_runner import run_cli


def test_rollout_cli_prints_the_tree_and_writes_jsonl(tmp_path):
    out = tmp_path / "traj.jsonl"
    proc = run_cli(
        "rollout", "--model", "tiny-test", "--strategy", "arpo", "--no-tools",
        "rollout.n=4", "rollout.initial_rollouts=2", "data.max_response_length=24",
        "data.max_prompt_length=4096", "What", "is", "2+2?", "--out", str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "prompt q0" in proc.stdout and "q0-0 [root]" in proc.stdout
    assert "finish=" in proc.stdout and "stats: 4 trajectories" in proc.stdout
    lines = out.read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line)["uid"] == "q0" for line in lines)
    assert all("What is 2+2?" in json.loads(line)["prompt_text"] for line in lines)
    trajs = read_jsonl(out)
    assert all(t.extra["question"] == "What is 2+2?" for t in trajs)
    assert all(len(t.response_ids) <= 24 for t in trajs)


def test_rollout_cli_user_errors():
    proc = run_cli("rollout", "--model", "tiny-test", "rollout.n=2")
    assert proc.returncode == 2 and "give a question" in proc.stderr
    proc = run_cli("rollout", "--model", "tiny-test", "--strategy", "ppo", "hi")
    assert proc.returncode == 2 and "rollout.strategy" in proc.stderr
    proc = run_cli("rollout", "--model", "tiny-test", "--no-tools", "data.max_prompt_length=16",
                   "hi")
    assert proc.returncode == 2 and "max_prompt_length" in proc.stderr


def test_rollout_cli_bf16_weights(tmp_path):
    # rollout.cpu_weights=bfloat16 end to end: rows where the CPU has bf16 dot-product
    # instructions, else one line naming what is missing (never a traceback).
    from appo.rollout.cpu import onednn

    out = tmp_path / "traj.jsonl"
    proc = run_cli("rollout", "--model", "tiny-test", "--strategy", "grpo", "--no-tools",
                   "rollout.n=2", "data.max_response_length=8", "rollout.cpu_weights=bfloat16",
                   "What", "is", "2+2?", "--out", str(out))
    if onednn.bf16_available():
        assert proc.returncode == 0, proc.stderr
        assert len(read_jsonl(out)) == 2
    else:
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert "rollout.cpu_weights=bfloat16" in proc.stderr and "avx512_bf16" in proc.stderr
    proc = run_cli("rollout", "--model", "tiny-test", "rollout.cpu_weights=int8", "hi")
    assert proc.returncode == 2 and "rollout.cpu_weights" in proc.stderr
