"""Reproducibility (issue 41, class 7): a step with no learning signal can leave the weights
alone (`actor.skip_zero_advantage_steps`), the micro-batch budget from a memory target is
derived once and reused, and a resumed eval continues the uninterrupted one's samples."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from appo.config import ActorConfig
from appo.models import load_model
from appo.trainer.update import update_policy

sys.path.insert(0, str(Path(__file__).parent / "trainer"))
from test_trainer_rl import _batch, _fixed_lists  # noqa: E402


def _adamw_steps(skip: bool, zero_uids: set[str]) -> tuple[dict, list[torch.Tensor],
                                                              list[torch.Tensor], int]:
    """One AdamW update with signal, then one whose rows of `zero_uids` have advantage 0;
    returns the second update's metrics, the weights after each update and the scheduler's
    step count."""
    torch.manual_seed(0)
    lm = load_model("tiny-test")
    opt = torch.optim.AdamW(lm.model.parameters(), lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    actor = ActorConfig(ppo_mini_batch_size=2, skip_zero_advantage_steps=skip)
    rows = _fixed_lists(lm.tokenizer)
    update_policy(lm.model, opt, _batch(**rows, pad_id=lm.tokenizer.pad_token_id), actor,
                  max_response_length=384, scheduler=sched)
    first = [p.detach().clone() for p in lm.model.parameters()]
    rows["advantages"] = [[0.0] * len(a) if u in zero_uids else a
                          for a, u in zip(rows["advantages"], rows["uids"], strict=True)]
    metrics = update_policy(lm.model, opt, _batch(**rows, pad_id=lm.tokenizer.pad_token_id),
                            actor, max_response_length=384, scheduler=sched)
    second = [p.detach().clone() for p in lm.model.parameters()]
    return metrics, first, second, sched.last_epoch


def test_adamw_moves_the_weights_at_grad_norm_zero_by_default():
    metrics, first, second, sched_steps = _adamw_steps(False, {"u0", "u1", "u2"})
    assert metrics["actor/grad_norm"] == 0.0  # no signal at all ...
    assert any(not torch.equal(a, b) for a, b in zip(first, second, strict=True))  # ... moves
    assert "actor/skipped_steps" not in metrics and sched_steps == 4  # 2 updates x 2 minis


def test_a_step_without_learning_signal_is_skipped_with_its_scheduler_step():
    metrics, first, second, sched_steps = _adamw_steps(True, {"u0", "u1", "u2"})
    assert metrics["actor/grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))
    assert metrics["actor/skipped_steps"] == 2.0 and metrics["actor/optimizer_steps"] == 2.0
    assert sched_steps == 2  # the first update's two steps only


def test_only_the_mini_batch_without_signal_is_skipped():
    # mini-batches of 2 groups: {u0, u1} (no signal) and {u2} (signal)
    metrics, first, second, sched_steps = _adamw_steps(True, {"u0", "u1"})
    assert metrics["actor/skipped_steps"] == 1.0 and sched_steps == 3
    assert any(not torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_the_skip_is_off_by_default_and_documented():
    from appo.config import load_config

    assert load_config(overrides=[]).actor.skip_zero_advantage_steps is False
    reference = (Path(__file__).parents[1] / "docs" / "reference" / "config.md").read_text()
    assert "`actor.skip_zero_advantage_steps`" in reference and "actor/skipped_steps" in reference



EVAL = ["eval", "--model", "tiny-test", "--data", "synth:arith?split=eval&n=8", "--k", "2",
        "--batch-size", "2", "eval.max_response_length=12"]


def _samples(out: Path) -> dict[tuple[str, int], str]:
    from appo.eval.records import latest, read_samples

    records = latest(read_samples(out / "arith" / "samples.jsonl"))
    return {key: rec.prediction for key, rec in records.items()}


def _trajectories(out: Path) -> dict[str, list[int]]:
    import json

    rows = [json.loads(line) for line in (out / "arith" / "trajectories.jsonl").open()]
    return {r["traj_id"]: r["response_ids"] for r in rows}


def test_an_eval_resumed_after_kill_9_equals_the_uninterrupted_one(tmp_path, monkeypatch):
    import os
    import signal
    import subprocess
    import time

    from cli_runner import run_cli

    monkeypatch.setenv("APPO_CACHE", str(tmp_path / "cache"))
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    r = run_cli(*EVAL, "--out", str(straight))
    assert r.returncode == 0, r.stderr[-2000:]
    expected = _samples(straight)
    assert len(expected) == 16 and len(set(expected.values())) > 8  # sampled, mostly distinct

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-m", "appo.cli", *EVAL, "--out", str(killed)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples = killed / "arith" / "samples.jsonl"
    deadline = time.monotonic() + 600
    while child.poll() is None and time.monotonic() < deadline:
        if samples.is_file() and len(samples.read_text().splitlines()) >= 4:  # 2 chunks
            break
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    written = len(samples.read_text().splitlines())
    assert 4 <= written < 16, written  # killed part-way
    r = run_cli(*EVAL, "--out", str(killed))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming" in r.stdout + r.stderr
    assert _samples(killed) == expected
    assert _trajectories(killed) == _trajectories(straight)
