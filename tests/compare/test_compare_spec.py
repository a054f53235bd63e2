"""appo compare spec: shape checks and the equal-budget rule (no model is loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from appo.compare.runner import check_eval_sets
from appo.compare.spec import load_spec
from appo.errors import AppoError
from cli_runner import run_cli


def _write(tmp_path, **changes):
    spec = {
        "output_dir": str(tmp_path / "out"),
        "base": {"overrides": ["model.path=tiny-test", "rollout.n=4", "data.train_batch_size=2",
                               "trainer.total_steps=3"]},
        "variants": {"grpo": ["rollout.strategy=grpo"], "arpo": ["rollout.strategy=arpo"]},
        "seeds": [1, 2, 3],
        "eval": {"sets": ["synth:arith?split=eval&n=4"], "k": 2},
    }
    spec.update(changes)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_valid_spec_pairs_dirs_and_configs(tmp_path):
    spec = load_spec(_write(tmp_path))
    assert spec.pairs() == [("grpo", 1), ("arpo", 1), ("grpo", 2), ("arpo", 2), ("grpo", 3),
                            ("arpo", 3)]
    assert spec.eval.sets == {"set1": "synth:arith?split=eval&n=4"}
    cfg = spec.config("arpo", 2)
    assert (cfg.rollout.strategy, cfg.trainer.seed, cfg.data.seed) == ("arpo", 2, 2)
    assert cfg.trainer.default_local_dir == str(tmp_path / "out" / "runs" / "arpo" / "seed2")
    assert spec.budgets["grpo"] == spec.budgets["arpo"] == {
        "data.train_batch_size": 2, "rollout.n": 4, "trainer.total_steps": 3,
        "data.max_response_length": 384}


@pytest.mark.parametrize("override, key", [
    ("rollout.n=8", "rollout.n"), ("data.train_batch_size=4", "data.train_batch_size"),
    ("trainer.total_steps=6", "trainer.total_steps"),
    ("data.max_response_length=100", "data.max_response_length")])
def test_a_different_budget_is_refused_unless_marked(tmp_path, override, key):
    variants = {"grpo": ["rollout.strategy=grpo"],
                "arpo": ["rollout.strategy=arpo", override]}
    with pytest.raises(AppoError, match=f"variant 'arpo' has a different budget from 'grpo': "
                                        f"{key}=.*allow_budget_difference: true"):
        load_spec(_write(tmp_path, variants=variants))
    variants["arpo"] = {"overrides": variants["arpo"], "allow_budget_difference": True}
    spec = load_spec(_write(tmp_path, variants=variants))
    assert spec.budgets["arpo"] != spec.budgets["grpo"]
    assert spec.variant("arpo").allow_budget_difference


def test_the_same_change_in_every_variant_is_an_equal_budget(tmp_path):
    variants = {"a": ["rollout.n=8"], "b": ["rollout.strategy=arpo", "rollout.n=8"]}
    spec = load_spec(_write(tmp_path, variants=variants))
    assert spec.budgets["a"]["rollout.n"] == spec.budgets["b"]["rollout.n"] == 8


@pytest.mark.parametrize("changes, message", [
    ({"seeds": [1, 1]}, "seeds must be a non-empty list of distinct integers"),
    ({"variants": {}}, "variants must be a non-empty mapping"),
    ({"variants": {"a": ["trainer.seed=3"]}}, "variants.a sets trainer.seed"),
    ({"eval": {"sets": []}}, "eval.sets must be a non-empty"),
    ({"eval": {"sets": ["x"], "temperature": 0}}, "eval.temperature > 0"),
    ({"budget": 3}, "unknown key 'budget'"),
    ({"variants": {"a b": ["rollout.n=2"]}}, "variant name 'a b'"),
])
def test_bad_specs_are_one_clear_error(tmp_path, changes, message):
    with pytest.raises(AppoError, match=message):
        load_spec(_write(tmp_path, **changes))


def test_cli_refuses_unequal_budget_in_one_line(tmp_path):
    variants = {"grpo": ["rollout.strategy=grpo"], "big": ["rollout.n=16"]}
    result = run_cli("compare", str(_write(tmp_path, variants=variants)), "--dry-run")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: variant 'big' has a different budget from 'grpo': rollout.n=16 vs 4; give "
        "every variant the same budget (data.train_batch_size, rollout.n, trainer.total_steps, "
        "data.max_response_length) or mark it `allow_budget_difference: true`"]
    ok = run_cli("compare", str(_write(tmp_path)), "--dry-run")
    assert ok.returncode == 0, ok.stderr
    assert "eval sets set1 (4 questions)" in ok.stdout
    assert "grpo seed 1: missing" in ok.stdout and "arpo seed 3: missing" in ok.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


def test_the_study_spec_is_valid(monkeypatch):
    # docs/study/spec.yaml (issue 23's study): paths are relative to the repository root.
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    spec = load_spec("docs/study/spec.yaml")
    assert [v.name for v in spec.variants] == ["start", "grpo", "arpo", "aepo", "appo"]
    assert spec.seeds == [1, 2, 3] and len(spec.pairs()) == 15
    # Only the untrained `start` row is exempt from the equal budget.
    assert [v.name for v in spec.variants if v.allow_budget_difference] == ["start"]
    assert spec.keep_checkpoints == "last"
    cfg = spec.config("appo", 3)
    assert (cfg.rollout.strategy, cfg.algorithm.adv_estimator, cfg.actor.policy_loss) == (
        "appo", "appo", "future_kl")
    assert all(int(s.split("n=")[-1]) >= 100 for s in spec.eval.sets.values())


def test_a_missing_eval_set_is_refused_before_any_training(tmp_path):
    spec = load_spec(_write(tmp_path, eval={"sets": {"gone": str(tmp_path / "nope.jsonl")}}))
    with pytest.raises(AppoError, match="nope.jsonl"):
        check_eval_sets(spec)
    assert check_eval_sets(load_spec(_write(tmp_path))) == {"set1": 4}
