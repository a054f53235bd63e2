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


FIRST_BUDGET, BUDGET_STEP = 200, 60  # tokens; tiny-test's groups here are ~90 tokens each


class _OneRank:
    enabled, is_main, world, rank = False, True, 1, 0

    def max_int(self, value: int) -> int:
        return value


class _Held:
    """What the process "holds" (`appo.trainer.memory.rss_bytes`): a fixed 1 GiB plus what
    a test adds, so a budget's dependence on it is exact rather than the machine's noise."""

    def __init__(self, monkeypatch):
        self.extra = 0
        monkeypatch.setattr("appo.trainer.memory.rss_bytes", lambda: 2**30 + self.extra)


def _target_for(tokens: int, model) -> float:
    """A memory target that leaves `tokens` tokens of activations at 1 GiB held, the
    gradients and AdamW states (12 bytes per float32 weight) still to come."""
    from appo.trainer.memory import GIB, MARGIN, activation_bytes_per_token

    states = sum(p.numel() * 12 for p in model.parameters())
    per_token = activation_bytes_per_token(model)
    return (GIB + states + (tokens + 0.5) * per_token / (1 - MARGIN)) / GIB


def _tokens(n: int, per_token: float) -> int:
    """Bytes held that take `n` tokens from a budget."""
    from appo.trainer.memory import MARGIN

    return int(n * per_token / (1 - MARGIN))


def test_the_budget_is_derived_once_and_reused_on_resume(tmp_path, monkeypatch):
    from appo.trainer.memory import BUDGET_FILE, activation_bytes_per_token, apply_memory_target

    model = load_model("tiny-test").model
    opt = torch.optim.AdamW(model.parameters())
    held = _Held(monkeypatch)
    per_token = activation_bytes_per_token(model)
    target = _target_for(400, model)
    actor = ActorConfig(max_memory_gb=target)
    first = apply_memory_target(actor, model, opt, _OneRank(), run_dir=tmp_path)
    assert (tmp_path / BUDGET_FILE).is_file() and abs(first - 400) <= 2
    held.extra = _tokens(100, per_token)  # what a resumed process may hold more
    again = ActorConfig(max_memory_gb=target)
    assert apply_memory_target(again, model, opt, _OneRank(), run_dir=tmp_path) == first
    assert again.ppo_max_token_len_per_device == first
    # without the record (or for another target) the budget is derived from what is held now
    fresh = apply_memory_target(ActorConfig(max_memory_gb=target), model, opt, _OneRank())
    assert abs(fresh - (first - 100)) <= 2
    other = ActorConfig(max_memory_gb=target + 0.01)
    assert apply_memory_target(other, model, opt, _OneRank(), run_dir=tmp_path) > first


def _metrics(run: Path) -> list[dict]:
    import json

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "memory/"))}
            for r in rows]


def _result(run: Path) -> dict:
    import json

    from appo.compare.runner import RESULT_FILE

    out = json.loads((run / RESULT_FILE).read_text())
    return {k: v for k, v in out.items() if not k.endswith("_seconds")}


def test_a_compare_pair_alone_equals_the_pair_after_another_in_one_worker(tmp_path,
                                                                           monkeypatch):
    import json
    import shutil

    sys.path.insert(0, str(Path(__file__).parent / "compare"))
    from test_compare_run import write_spec

    from appo.compare.runner import BUDGET_KEY, PAIR_FILE, run_comparison, run_pair
    from appo.compare.spec import load_spec
    from appo.trainer.memory import activation_bytes_per_token

    held = _Held(monkeypatch)
    model = load_model("tiny-test").model
    per_token = activation_bytes_per_token(model)

    def worker(spec_, variant, seed, progress=True):
        held.extra += _tokens(BUDGET_STEP, per_token)  # a worker holds more after each pair
        return run_pair(spec_, variant, seed, progress=False)

    target = _target_for(FIRST_BUDGET + BUDGET_STEP, model)  # the worker's first pair
    spec = load_spec(write_spec(tmp_path, variants={"grpo": ["rollout.strategy=grpo"]},
                                seeds=(1, 2), base_extra=(f"actor.max_memory_gb={target}",
                                                          "trainer.total_steps=2")))
    # seed 2 runs after seed 1 in this process (one --jobs worker runs its pairs in turn)
    assert run_comparison(spec, run=worker)[0] == [("grpo", 1), ("grpo", 2)]
    after = _metrics(spec.run_dir("grpo", 2))
    result = _result(spec.run_dir("grpo", 2))
    definition = json.loads((spec.run_dir("grpo", 2) / PAIR_FILE).read_text())
    assert isinstance(definition[BUDGET_KEY], int)
    # seed 2 again, alone, in a process that now holds more
    shutil.rmtree(spec.run_dir("grpo", 2))
    assert run_comparison(spec, run=worker)[0] == [("grpo", 2)]
    assert _metrics(spec.run_dir("grpo", 2)) == after
    assert _result(spec.run_dir("grpo", 2)) == result
    assert json.loads((spec.run_dir("grpo", 2) / PAIR_FILE).read_text()) == definition
