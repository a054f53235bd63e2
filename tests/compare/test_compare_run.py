"""appo compare end to end on tiny-test: pairs run once, a partly finished comparison runs
only its missing pairs, the report is written from partial results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from appo.compare import runner
from appo.compare.report import write_report
from appo.compare.runner import RESULT_FILE, pair_state, run_comparison, run_pair
from appo.compare.spec import load_spec
from appo.errors import AppoError
from cli_runner import run_cli

REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str or ""
    share = sum(c.islower() and c.isascii() for c in text) / max(len(text), 1)
    return {"score": share, "acc": float(share > 0.1)}
'''


def write_spec(tmp_path: Path, variants: dict | None = None, seeds=(1, 2),
               extra: dict | None = None, base_extra: tuple[str, ...] = ()) -> Path:
    data = tmp_path / "toy.jsonl"
    with data.open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": f"q{i}?"}],
                                "answer": "7", "data_source": "toy", "ability": "math"}) + "\n")
    (tmp_path / "reward.py").write_text(REWARD_FILE)
    spec = {
        "output_dir": str(tmp_path / "out"),
        "base": {"overrides": [
            "model.path=tiny-test", f"data.train_files=[{data}]", "data.val_files=[]",
            "data.train_batch_size=2", "data.max_response_length=8",
            f"custom_reward_function.path={tmp_path / 'reward.py'}", "rollout.n=2",
            "rollout.initial_rollouts=1", "actor.ppo_mini_batch_size=2",
            "trainer.total_steps=1", "trainer.logger=[jsonl]", *base_extra]},
        "variants": variants or {"grpo": ["rollout.strategy=grpo"],
                                 "arpo": ["rollout.strategy=arpo"]},
        "seeds": list(seeds),
        "eval": {"sets": {"toy": f"{data}?n=3"}, "k": 2, "temperature": 1.0},
        **(extra or {}),
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_resume_runs_only_missing_pairs(tmp_path, monkeypatch):
    spec = load_spec(write_spec(tmp_path))
    calls: list[tuple[str, int, str]] = []

    def counting(spec_, variant, seed, progress=True):
        calls.append((variant, seed, pair_state(spec_, variant, seed)))
        return run_pair(spec_, variant, seed, progress=False)

    # First invocation, stopped (Ctrl-C) in the third pair after its training, before its
    # evaluation: two pairs done, one with a checkpoint but no result, one not started.
    real_evaluate = runner.evaluate_pair

    def interrupted(spec_, trainer, variant, seed):
        if (variant, seed) == ("grpo", 2):
            raise KeyboardInterrupt
        return real_evaluate(spec_, trainer, variant, seed)

    monkeypatch.setattr(runner, "evaluate_pair", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_comparison(spec, run=counting)
    monkeypatch.setattr(runner, "evaluate_pair", real_evaluate)
    assert [pair_state(spec, v, s) for v, s in spec.pairs()] == [
        "done", "done", "partial", "missing"]
    first = json.loads((spec.run_dir("arpo", 1) / RESULT_FILE).read_text())
    assert first["steps"] == 1 and len(first["sets"]["toy"]["greedy"]) == 3
    assert all(0 <= c <= 2 for c in first["sets"]["toy"]["sampled_correct"])
    untouched = {p: (spec.run_dir(*p) / RESULT_FILE).stat().st_mtime_ns
                 for p in [("grpo", 1), ("arpo", 1)]}
    # The restart runs exactly the two unfinished pairs; the finished ones are left alone.
    calls.clear()
    assert run_comparison(spec, run=counting) == ([("grpo", 2), ("arpo", 2)], [])
    assert calls == [("grpo", 2, "partial"), ("arpo", 2, "missing")]
    for p, mtime in untouched.items():
        assert (spec.run_dir(*p) / RESULT_FILE).stat().st_mtime_ns == mtime
    resumed = json.loads((spec.run_dir("grpo", 2) / RESULT_FILE).read_text())
    assert resumed["steps"] == 1  # resumed from its checkpoint, not trained again
    rows = (spec.run_dir("grpo", 2) / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["step"] for r in rows] == [1]
    # Everything done: a third invocation runs nothing.
    calls.clear()
    assert run_comparison(spec, run=counting) == ([], []) and calls == []
    report = write_report(spec, resamples=200).read_text()
    assert "Finished pairs: 4 of 4." in report and "grpo - arpo" in report


def test_report_from_partial_results(tmp_path):
    spec = load_spec(write_spec(tmp_path))
    run_pair(spec, "grpo", 1, progress=False)
    path = write_report(spec, resamples=100)
    text = path.read_text()
    assert "Finished pairs: 1 of 4." in text
    assert "arpo/seed1 (missing)" in text and "grpo/seed2 (missing)" in text
    assert "| grpo | 1 | 3 |" in text and "| arpo | 0 | - |" in text  # the eval-set table
    assert "| grpo - arpo | 0 | - | - |" in text
    for png in ("curves_step.png", "curves_tokens.png"):
        assert (path.parent / png).stat().st_size > 0


def _fake_result(spec, variant, seed, greedy, sampled):
    run = spec.run_dir(variant, seed)
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "reward/accuracy": 0.5, "time/step": 2.0,
                    "rollout/tokens_decoded": 100.0, "rollout/branches": 1.0}) + "\n")
    (run / RESULT_FILE).write_text(json.dumps({
        "variant": variant, "seed": seed, "steps": 1, "eval_seconds": 1.0,
        "sets": {"toy": {"greedy": greedy, "sampled_correct": sampled, "k": 2,
                         "tool_calls": [1] * len(greedy), "files": spec.eval.sets["toy"]}}}))


def test_report_intervals_and_distinguishable_sentence(tmp_path):
    spec = load_spec(write_spec(tmp_path, seeds=(1, 2, 3)))
    # grpo: greedy accuracies 1/4, 2/4, 3/4 over the seeds -> mean 0.5, s = 0.25, half width
    # 4.303 * 0.25 / sqrt(3) = 0.621084 -> [-12.1, 112.1] in %, clipped to what an accuracy
    # can be: [0.0, 100.0]; pass@k always 0.
    # arpo: always right. Sampled pass@k differs by -1 in every (seed, question) cell, so
    # every resample's mean is -1: [-100, -100] points, distinguishable from noise.
    for seed, ok in zip((1, 2, 3), (1, 2, 3), strict=True):
        greedy = [1.0] * ok + [0.0] * (4 - ok)
        _fake_result(spec, "grpo", seed, greedy, [0, 0, 0, 0])
        _fake_result(spec, "arpo", seed, [1.0] * 4, [2, 2, 2, 2])
    text = write_report(spec, resamples=500).read_text()
    assert "| grpo | 3 | 4 | 50.0 [0.0, 100.0] | 0.0 [0.0, 0.0] | 1.00 [1.00, 1.00] |" in text
    assert "| arpo | 3 | 4 | 100.0 [100.0, 100.0] | 100.0 [100.0, 100.0] |" in text
    assert "grpo vs arpo on `toy` (sampled pass@k: -100.0 [-100.0, -100.0])" in text
    # Cost: 100 sampled tokens, 1 branch and 2 s in the one step of every seed; 1 s of eval.
    assert "| grpo | 3 | 1 | 100 [100, 100] | 1.00 | 2 | 1 |" in text
    # 1 pair x 2 metrics = 2 intervals; Bonferroni puts each at 1 - 0.05/2 = 97.5 % with
    # max(500, ceil(40 / 0.025)) = 1600 resamples; the constant -1 difference survives any level.
    assert "2 intervals were computed; if no variant differed from another, about 0.1" in text
    assert ("Held to a family-wise 95% over all 2 (Bonferroni: each interval at 97.50%, 1600 "
            "resamples), these remain:") in text
    assert "grpo vs arpo on `toy` (sampled pass@k)" in text.split("these remain:")[1]
    assert "(one seed)" not in text  # three seeds each
    assert "(t quantile 4.30 for 3 seeds)" in text  # t_{0.975, 2}
    assert "same checkpoint for every seed" not in text  # no eval.start here


def test_report_marks_a_difference_that_rests_on_one_seed(tmp_path):
    spec = load_spec(write_spec(tmp_path, seeds=(1,)))
    _fake_result(spec, "grpo", 1, [0.0] * 4, [0, 0, 0, 0])
    _fake_result(spec, "arpo", 1, [1.0] * 4, [2, 2, 2, 2])
    text = write_report(spec, resamples=200).read_text()
    assert "grpo vs arpo on `toy` (greedy pass@1: -100.0 [-100.0, -100.0]) (one seed)" in text
    assert "resamples questions only" in text


@pytest.mark.parametrize("state", ["missing"])
def test_pair_state_of_an_empty_directory(tmp_path, state):
    spec = load_spec(write_spec(tmp_path))
    spec.run_dir("grpo", 1).mkdir(parents=True)
    assert pair_state(spec, "grpo", 1) == state


def test_cli_report_runs_nothing(tmp_path):
    path = write_spec(tmp_path)
    spec = load_spec(path)
    _fake_result(spec, "arpo", 2, [1.0, 0.0, 1.0], [1, 0, 2])
    result = run_cli("compare", str(path), "--report")
    assert result.returncode == 0, result.stderr
    assert "appo compare: report" in result.stdout and "ran" not in result.stdout
    text = (spec.output_dir / "report" / "report.md").read_text()
    assert "Finished pairs: 1 of 4." in text and "| arpo | 1 | 3 | 66.7 (1 seed) |" in text
    assert sorted(p.name for p in (spec.output_dir / "runs").iterdir()) == ["arpo"]


def test_report_leaves_out_results_of_a_changed_eval_set(tmp_path):
    spec = load_spec(write_spec(tmp_path))
    _fake_result(spec, "grpo", 1, [1.0, 0.0, 1.0], [1, 0, 2])
    _fake_result(spec, "arpo", 1, [1.0, 1.0, 1.0], [1, 1, 2])
    spec.eval.sets["toy"] += "&seed=5"  # the spec now names other questions
    text = write_report(spec, resamples=50).read_text()
    assert "left out of that set's table): grpo/seed1 `toy`, arpo/seed1 `toy`." in text
    assert "| grpo | 0 | - |" in text and "| grpo - arpo | 0 | - | - |" in text


@pytest.mark.parametrize("keep", ["all", "last"])
def test_keep_checkpoints(tmp_path, keep):
    # Three steps saved every step: `all` leaves the three checkpoints, `last` only the newest
    # once the pair is evaluated (the study's disk: ~1.3 GB per SmolLM2 checkpoint).
    spec = load_spec(write_spec(tmp_path, seeds=(1,), extra={"keep_checkpoints": keep},
                                base_extra=("trainer.total_steps=3", "trainer.save_freq=1")))
    run_pair(spec, "grpo", 1, progress=False)
    run = spec.run_dir("grpo", 1)
    kept = sorted(p.name for p in run.glob("global_step_*"))
    assert kept == (["global_step_1", "global_step_2", "global_step_3"] if keep == "all"
                    else ["global_step_3"])
    assert pair_state(spec, "grpo", 1) == "done"
    assert json.loads((run / RESULT_FILE).read_text())["steps"] == 3


def test_keep_checkpoints_refuses_other_values(tmp_path):
    with pytest.raises(AppoError, match="keep_checkpoints must be one of all, last, got 'none'"):
        load_spec(write_spec(tmp_path, extra={"keep_checkpoints": "none"}))


def test_eval_start_evaluates_the_starting_checkpoint(tmp_path):
    # eval.start adds the row `start`: the base model evaluated per seed without training
    # (no step, no checkpoint), first in every seed; the report shows it beside the variants.
    # Under greedy decoding the untrained model answers the same whatever the seed.
    spec = load_spec(write_spec(tmp_path, extra={"eval": {
        "sets": {"toy": f"{tmp_path / 'toy.jsonl'}?n=3"}, "k": 2, "temperature": 1.0,
        "start": True}}))
    assert spec.pairs()[:3] == [("start", 1), ("grpo", 1), ("arpo", 1)]
    for seed in (1, 2):
        run_pair(spec, "start", seed, progress=False)
    results = [json.loads((spec.run_dir("start", s) / RESULT_FILE).read_text()) for s in (1, 2)]
    assert [r["steps"] for r in results] == [0, 0]
    assert results[0]["sets"]["toy"]["greedy"] == results[1]["sets"]["toy"]["greedy"]
    assert not list(spec.run_dir("start", 1).glob("global_step_*"))
    assert pair_state(spec, "start", 1) == "done" and pair_state(spec, "grpo", 1) == "missing"
    text = write_report(spec, resamples=50).read_text()
    assert "| start | - | - | - | - | the starting checkpoint, not trained |" in text
    assert "| start | 2 | 3 |" in text and "| start - grpo | 0 | - | - |" in text
    assert "`start` is the same checkpoint for every seed" in text
    assert "(t quantile 12.71 for 2 seeds)" in text  # t_{0.975, 1}: only start has 2 seeds


def test_eval_start_refuses_a_variant_named_start(tmp_path):
    path = write_spec(tmp_path, variants={"start": ["rollout.strategy=grpo"]}, extra={"eval": {
        "sets": {"toy": f"{tmp_path / 'toy.jsonl'}?n=3"}, "start": True}})
    with pytest.raises(AppoError, match="a variant is named 'start'"):
        load_spec(path)


def test_a_pair_held_by_another_process_is_passed_over(tmp_path):
    # Another `appo compare` holding (grpo, 1) - here, an flock taken on a descriptor of our
    # own, which the kernel treats like another process's - is passed over, the rest run.
    # Released, the pair runs on the next invocation.
    spec = load_spec(write_spec(tmp_path))
    calls: list[tuple[str, int]] = []

    def fake(spec_, variant, seed, progress=True):
        calls.append((variant, seed))
        _fake_result(spec_, variant, seed, [1.0, 0.0, 1.0], [1, 0, 2])

    with runner.held_lock(runner.lock_path(spec, "grpo-seed1")) as mine:
        assert mine
        with runner.held_lock(runner.lock_path(spec, "grpo-seed1")) as other:
            assert not other  # the lock excludes a second holder, as it will in run_comparison
        ran, held = run_comparison(spec, run=fake)
    assert held == [("grpo", 1)] and ("grpo", 1) not in ran
    assert sorted(ran) == sorted([("arpo", 1), ("grpo", 2), ("arpo", 2)])
    assert pair_state(spec, "grpo", 1) == "missing"
    calls.clear()
    assert run_comparison(spec, run=fake) == ([("grpo", 1)], []) and calls == [("grpo", 1)]


@pytest.mark.slow
def test_cli_jobs_runs_every_pair_once_in_parallel_processes(tmp_path):
    path = write_spec(tmp_path, seeds=(1,))
    spec = load_spec(path)
    result = run_cli("compare", str(path), "--jobs", "2", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [pair_state(spec, v, s) for v, s in spec.pairs()] == ["done", "done"]
    for v, s in spec.pairs():  # each pair trained once: one step, one metrics row
        rows = (spec.run_dir(v, s) / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in rows] == [1]
    assert "Finished pairs: 2 of 2." in (spec.output_dir / "report" / "report.md").read_text()


def test_cli_jobs_below_one_is_one_clear_error(tmp_path):
    result = run_cli("compare", str(write_spec(tmp_path)), "--jobs", "0")
    assert result.returncode != 0 and "--jobs 0" in result.stderr
    assert "Traceback" not in result.stderr
