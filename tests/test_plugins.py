"""Plug-in strategies (issue 42): one registry that config validation reads,
`appo.register_strategy`, and `--plugin MODULE|FILE.py` on the command line.

The example plugin (examples/fixed_split.py, docs/extending.md) trains a step from the
command line and from Python, and its own branch decisions are in the rollout dump; a bad
plugin is one line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import appo
from appo.errors import AppoError
from appo.registry import ADV_ESTIMATORS, POLICY_LOSSES, REWARDS, STRATEGIES
from cli_runner import run_cli

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "fixed_split.py"
TINY = ["model.path=tiny-test", "data.max_prompt_length=1024", "data.max_response_length=16",
        "rollout.n=3", "rollout.initial_rollouts=1", "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2", "trainer.total_steps=1", "data.val_files=[]",
        "trainer.logger=[jsonl]"]


@pytest.fixture
def clean_registry():
    """Strategies a test registers are gone afterwards (the reference pages, generated in
    the same process by another test, list the registry's names), and a plugin file is
    imported afresh by the next test that loads it."""
    registries = (STRATEGIES, REWARDS, ADV_ESTIMATORS, POLICY_LOSSES)
    before = {id(r): set(r) for r in registries}
    modules = set(sys.modules)
    yield
    for registry in registries:
        for name in set(registry) - before[id(registry)]:
            registry.unregister(name)
    for name in set(sys.modules) - modules:
        if name.startswith("appo_plugin_") or name.startswith("my_rules"):
            del sys.modules[name]


def _dummy(prompts, engine, tools, settings, rng=None, score_fn=None):
    raise AssertionError("not called")


def test_validation_reads_the_registry(clean_registry):
    with pytest.raises(AppoError, match=r"'mine' \(choose from grpo, arpo, aepo, appo\)"):
        appo.load_config(overrides=["rollout.strategy=mine"])
    assert appo.register_strategy("mine", _dummy) is _dummy
    assert appo.load_config(overrides=["rollout.strategy=mine"]).rollout.strategy == "mine"
    assert appo.get_strategy("mine") is _dummy
    from appo.rollout import get_strategy

    assert get_strategy("mine") is _dummy  # the rollout's lookup is the same registry
    with pytest.raises(AppoError, match=r"unknown rollout strategy 'other' \(choose from grpo, "
                                        r"arpo, aepo, appo, mine\)"):
        appo.get_strategy("other")
    STRATEGIES.unregister("mine")
    with pytest.raises(AppoError, match="bad value for config key 'rollout.strategy'"):
        appo.load_config(overrides=["rollout.strategy=mine"])


def test_registration_refusals_are_one_line(clean_registry):
    with pytest.raises(AppoError, match="'arpo': that is a built-in's name"):
        appo.register_strategy("arpo", _dummy)
    with pytest.raises(AppoError, match="bad name 'a b'"):
        appo.register_strategy("a b", _dummy)
    with pytest.raises(AppoError, match="int is not callable"):
        appo.register_strategy("three", 3)
    appo.register_strategy("taken", _dummy)
    with pytest.raises(AppoError, match=r"'taken': already registered as .*_dummy"):
        appo.register_strategy("taken", lambda *a, **k: None)
    appo.register_strategy("taken", _dummy)  # the same object again: fine

    @appo.register_strategy("decorated")
    def decorated(prompts, engine, tools, settings, rng=None, score_fn=None):
        return None

    assert appo.get_strategy("decorated") is decorated


def test_a_module_plugin_from_the_working_directory(tmp_path, monkeypatch, clean_registry):
    (tmp_path / "my_rules.py").write_text(
        "import appo\nfrom appo.rollout.strategies import rollout_grpo\n"
        "appo.register_strategy('plain', rollout_grpo)\n")
    monkeypatch.chdir(tmp_path)
    r = run_cli("config", "show", "--plugin", "my_rules", "rollout.strategy=plain",
                "rollout.strategy")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "rollout.strategy: plain"
    STRATEGIES.unregister("plain")  # as a new process without the plugin would start
    r = run_cli("config", "show", "rollout.strategy=plain")
    assert r.returncode == 2 and "choose from grpo, arpo, aepo, appo" in r.stderr


BAD = {
    "missing file": (None, "--plugin {path}: file not found"),
    "import error": ("raise RuntimeError('no GPU here')\n",
                     "--plugin {path}: importing it failed: RuntimeError: no GPU here"),
    "syntax error": ("def f(:\n", "--plugin {path}: {path}:1: SyntaxError:"),
    "a built-in's name": (
        "import appo\nappo.register_strategy('grpo', print)\n",
        "--plugin {path}: register a rollout strategy 'grpo': that is a built-in's name"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_plugin_file_is_one_line(case, tmp_path, clean_registry):
    body, expected = BAD[case]
    path = tmp_path / "plugin.py"
    if body is not None:
        path.write_text(body)
    r = run_cli("train", "--plugin", str(path), "model.path=tiny-test")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith("error: " + expected.format(path=path)), r.stderr


def test_a_missing_module_is_one_line(clean_registry):
    r = run_cli("train", "--plugin", "no_such_plugin_module", "model.path=tiny-test")
    assert r.returncode == 2
    assert r.stderr.strip() == ("error: --plugin no_such_plugin_module: no module named "
                                "'no_such_plugin_module' (give a module on the Python path, "
                                "or a path to a .py file)")


def check_dump(dump: Path, step: int = 1) -> None:
    """The step's trajectories came from examples/fixed_split.py: every row tagged, and per
    prompt one whole answer plus n - 1 branches that restart it after its first 3 tokens."""
    rows = [json.loads(line)
            for line in (dump / f"step_{step:05d}.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 3
    assert {r["extra"]["strategy"] for r in rows} == {"fixed_split"}
    assert {r["extra"]["model"] for r in rows} == {"tiny-test"}  # for appo view
    by_id = {r["traj_id"]: r for r in rows}
    roots = [r for r in rows if r["parent_id"] is None]
    assert len(roots) == 2 and len({r["uid"] for r in roots}) == 2
    for child in (r for r in rows if r["parent_id"] is not None):
        parent = by_id[child["parent_id"]]
        keep = min(3, len(parent["response_ids"]))
        assert child["uid"] == parent["uid"]
        assert child["branch_token_index"] == keep - 1
        assert child["response_ids"][:keep] == parent["response_ids"][:keep]
        assert sum(child["loss_mask"][:keep]) == keep  # trained like any row


REWARD_PLUGIN = """
import appo

@appo.register_reward("quarter")
def quarter(data_source, solution_str):
    return {"score": 0.25, "acc": float(data_source == "synth_arith"), "chars": len(solution_str)}
"""


def test_a_plugin_strategy_trains_from_the_command_line(tmp_path, clean_registry):
    """Two plugins: the example strategy, and a reward registered by name and selected with
    custom_reward_function.name."""
    run, dump = tmp_path / "run", tmp_path / "dump"
    rewards = tmp_path / "rewards.py"
    rewards.write_text(REWARD_PLUGIN)
    r = run_cli("train", "--plugin", str(EXAMPLE), "--plugin", str(rewards),
                "rollout.strategy=fixed_split", "custom_reward_function.name=quarter", *TINY,
                "trainer.total_steps=2",  # issue 42: two steps from the command line
                f"trainer.default_local_dir={run}", f"trainer.rollout_data_dir={dump}")
    assert r.returncode == 0, r.stderr[-2000:]
    check_dump(dump, 1)
    check_dump(dump, 2)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["rollout/branches"] == 4  # 2 prompts x (n - 1)
        assert (row["reward/mean"], row["reward/accuracy"]) == (0.25, 1.0)
    for step in (1, 2):
        lines = [json.loads(line)
                 for line in (dump / f"step_0000{step}.jsonl").read_text().splitlines()]
        assert {line["reward"] for line in lines} == {0.25}
    assert (run / "global_step_2").is_dir()


def test_a_plugin_strategy_trains_from_python(tmp_path, clean_registry):
    appo.load_plugin(str(EXAMPLE))
    strategy = appo.get_strategy("fixed_split")
    cfg = appo.load_config(overrides=[*TINY, "trainer.total_steps=2",
                                      f"trainer.default_local_dir={tmp_path / 'run'}",
                                      f"trainer.rollout_data_dir={tmp_path / 'dump'}"])
    trainer = appo.RLTrainer(cfg, progress=False, strategy=strategy)
    assert cfg.rollout.strategy == "fixed_split"  # the name it is registered under
    history = trainer.fit()
    assert [h["step"] for h in history] == [1, 2]
    assert [h["rollout/branches"] for h in history] == [4, 4]
    check_dump(tmp_path / "dump", 1)
    check_dump(tmp_path / "dump", 2)
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["objects"]["strategy"].endswith(".fixed_split")


def test_a_registered_reward_routes_its_data_source_and_can_score_every_row(clean_registry):
    from appo.rewards import RewardRouter, router_from_config

    got = []

    @appo.register_reward("exact")
    def exact(solution_str, ground_truth, extra_info):
        got.append((solution_str, ground_truth, extra_info))
        return float(solution_str.strip() == ground_truth)

    router = RewardRouter()
    assert router.resolve("exact") == "exact"
    out = router("exact", " 4 ", "4", {"index": 2})
    assert (out.score, out.reward_fn) == (1.0, "registered:exact")
    assert got == [(" 4 ", "4", {"index": 2})]
    assert router("gsm8k", "<answer> \\boxed{4} </answer>", "4").reward_fn == "math"
    # custom_reward_function.name alone: every row, whatever its data_source.
    every = router_from_config(appo.load_config(overrides=["custom_reward_function.name=exact"]))
    assert every("gsm8k", "5", "4").score == 0.0 and len(got) == 2
    # A built-in by name scores every row too, with the config's options for it.
    math = router_from_config(appo.load_config(overrides=["custom_reward_function.name=math"]))
    assert math("hotpotqa", "<answer> \\boxed{4} </answer>", "4").score == 1.0


def test_reward_registration_and_selection_refusals(clean_registry):
    from appo.rewards import router_from_config

    with pytest.raises(AppoError, match="'qa': that is a built-in's name"):
        appo.register_reward("qa", print)
    cfg = appo.load_config(overrides=["custom_reward_function.name=nope"])
    with pytest.raises(AppoError, match=r"custom_reward_function.name=nope: no reward function "
                                        r"of that name is registered \(registered: "
                                        r"deep_research, math, qa\)"):
        router_from_config(cfg)


LOSS_PLUGIN = """
import appo
from appo.algos import vanilla_policy_loss

@appo.register_policy_loss("counted")
def counted(logp, old_logp, advantages, loss_mask, *, agg, params, entropy=None):
    loss, metrics = vanilla_policy_loss(logp, old_logp, advantages, loss_mask, agg=agg,
                                        params=params, entropy=entropy)
    with open(LOG, "a") as f:
        f.write("called\\n")
    return loss, {**metrics, "counted_calls": 1.0}
"""


def test_a_plugin_policy_loss_trains_from_the_command_line(tmp_path, clean_registry):
    """A policy loss registered by a --plugin file (delegating to the built-in vanilla loss)
    is a valid actor.policy_loss and is what the update calls."""
    run, log = tmp_path / "run", tmp_path / "calls.log"
    plugin = tmp_path / "losses.py"
    plugin.write_text(f"LOG = {str(log)!r}\n" + LOSS_PLUGIN)
    r = run_cli("train", *TINY, "actor.policy_loss=counted")
    assert r.returncode == 2 and "'counted' (choose from vanilla, entropy_balanced, future_kl)" \
        in r.stderr, r.stderr
    r = run_cli("train", "--plugin", str(plugin), *TINY, "actor.policy_loss=counted",
                f"trainer.default_local_dir={run}")
    assert r.returncode == 0, r.stderr[-2000:]
    calls = log.read_text().splitlines()
    assert calls and set(calls) == {"called"}  # one per micro-batch of the step's update
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]
    assert rows[0]["actor/counted_calls"] > 0 and "actor/pg_loss" in rows[0]
    assert (run / "global_step_1").is_dir()


def test_advantage_and_loss_registries_reach_validation_and_the_tables(clean_registry):
    """The trainer's tables (appo.algos) and the config's choices hold the same names, a
    user's included; unknown names list every registered one."""
    import torch

    from appo import algos
    from appo.config import CHOICES

    def halved(scores, response_mask, groups, *, params, tree=None, values=None):
        adv, metrics = algos.grpo_advantage(scores, response_mask, groups, params=params)
        return adv / 2, metrics

    assert appo.register_advantage("halved", halved) is halved
    assert appo.get_advantage("halved") is halved and algos.ADV_ESTIMATORS["halved"] is halved
    assert appo.get_advantage("grpo") is algos.grpo_advantage
    assert appo.get_policy_loss("future_kl") is algos.future_kl_policy_loss
    cfg = appo.load_config(overrides=["algorithm.adv_estimator=halved"])
    assert cfg.algorithm.adv_estimator == "halved"
    scores, mask = torch.tensor([1.0, 0.0]), torch.ones(2, 3)
    want, _ = algos.grpo_advantage(scores, mask, ["a", "a"], params=algos.AdvantageParams())
    got, _ = algos.ADV_ESTIMATORS["halved"](scores, mask, ["a", "a"],
                                            params=algos.AdvantageParams())
    assert torch.equal(got, want / 2)
    for key, table in (("algorithm.adv_estimator", algos.ADV_ESTIMATORS),
                       ("actor.policy_loss", algos.POLICY_LOSSES)):
        assert tuple(table) == CHOICES[key]
    with pytest.raises(AppoError, match=r"unknown policy loss 'nope' \(choose from vanilla, "
                                        r"entropy_balanced, future_kl\)"):
        appo.get_policy_loss("nope")
    with pytest.raises(AppoError, match=r"'nope' \(choose from grpo, rloo, "
                                        r"reinforce_plus_plus, appo, gae, halved\)"):
        appo.load_config(overrides=["algorithm.adv_estimator=nope"])
    with pytest.raises(AppoError, match="'gae': that is a built-in's name"):
        appo.register_advantage("gae", halved)

    @appo.register_policy_loss("decorated_loss")
    def decorated_loss(logp, old_logp, advantages, loss_mask, *, agg, params, entropy=None):
        return algos.vanilla_policy_loss(logp, old_logp, advantages, loss_mask, agg=agg,
                                         params=params)

    assert algos.POLICY_LOSSES["decorated_loss"] is decorated_loss
    POLICY_LOSSES.unregister("decorated_loss")
    assert "decorated_loss" not in algos.POLICY_LOSSES
    assert tuple(algos.POLICY_LOSSES) == CHOICES["actor.policy_loss"]
