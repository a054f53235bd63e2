"""The Python API (issue 42): `appo.RLTrainer` with a reward function, rows in memory and a
strategy object; docs/python-api.md's example runs as written.

What is checked: the callable reward is called with the row's fields under verl's names and
its values are what the step's metrics report; the objects are recorded in run.json and a
resume with another reward says so; bad objects are one line; `import appo` stays light.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import appo
from appo.errors import AppoError
from appo.trainer import objects as trainer_objects

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.path=tiny-test", "data.max_prompt_length=1024", "data.max_response_length=16",
        "rollout.n=2", "rollout.initial_rollouts=1", "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=2", "trainer.logger=[jsonl]"]


def doc_example() -> str:
    text = (REPO / "docs" / "python-api.md").read_text(encoding="utf-8")
    return re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)


def test_the_documented_example_runs_as_written(tmp_path, monkeypatch):
    """The page's block, executed unchanged; the reward it defines is wrapped (same name,
    same parameters) to see what it was called with."""
    monkeypatch.chdir(tmp_path)  # the example's run directory: runs/appo-* under here
    calls: list[dict] = []
    given = trainer_objects.PythonObjects.given.__func__

    def spy(cls, cfg, reward_fn=None, *args, **kwargs):
        @functools.wraps(reward_fn)
        def recorded(data_source, solution_str, ground_truth, extra_info):
            value = reward_fn(data_source, solution_str, ground_truth, extra_info)
            calls.append({"data_source": data_source, "solution_str": solution_str,
                          "ground_truth": ground_truth, "extra_info": extra_info,
                          "value": value})
            return value

        return given(cls, cfg, recorded, *args, **kwargs)

    monkeypatch.setattr(trainer_objects.PythonObjects, "given", classmethod(spy))
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(doc_example(), "docs/python-api.md", "exec"), namespace)  # noqa: S102

    history, trainer, rows = namespace["history"], namespace["trainer"], namespace["rows"]
    assert [h["step"] for h in history] == [1, 2]
    assert "val/pass@1" in history[-1]
    # 2 steps x 4 prompts x n=2, then validation on the 2 val rows (eval.k=1).
    train_calls = [c for c in calls if c["data_source"] == "train_data"]
    val_calls = [c for c in calls if c["data_source"] == "val_data"]
    assert len(train_calls) == 16 and len(val_calls) == 2
    answers = {r["question"]: r["answer"] for r in rows}
    for c in calls:
        assert isinstance(c["solution_str"], str)
        assert answers[c["extra_info"]["question"]] == c["ground_truth"]
    assert {c["extra_info"]["question"] for c in val_calls} == {r["question"] for r in rows[:2]}
    step1 = train_calls[:8]
    assert history[0]["reward/mean"] == pytest.approx(
        sum(c["value"]["score"] for c in step1) / 8)
    record = json.loads((trainer.out_dir / "run.json").read_text())
    assert record["objects"]["reward_fn"] == "docs_example.my_reward"
    assert record["objects"]["train_data"].startswith("8 rows in memory, sha256 ")
    assert record["objects"]["val_data"].startswith("2 rows in memory, sha256 ")


# Issue 42's snippet, character for character; its three `...` are placeholders (a body,
# a prompt, an answer, more rows), which FILLS gives values. The test checks that undoing
# FILLS gives the issue's text back, so nothing else in it was changed.
ISSUE_SNIPPET = """import appo

def my_reward(completion: str, example: dict) -> float: ...   # or a dict with "score"

cfg = appo.load_config("my.yaml", overrides=["trainer.total_steps=2"])  # path optional
trainer = appo.RLTrainer(cfg, reward_fn=my_reward,
                         train_data=[{"prompt": "...", "answer": "..."}, ...])
history = trainer.fit()          # list of per-step metric dicts
"""
FILLS = [
    ("-> float: ...", "-> float: return float(example['answer'] in completion)"),
    ('[{"prompt": "...", "answer": "..."}, ...]',
     '[{"prompt": "What is 2 + 2?", "answer": "4"}, {"prompt": "What is 3 + 3?", "answer": "6"}]'),
]
MY_YAML = """model: {path: tiny-test}
data: {max_prompt_length: 1024, max_response_length: 16, train_batch_size: 2, val_files: []}
rollout: {n: 2, initial_rollouts: 1}
actor: {ppo_mini_batch_size: 2}
trainer: {logger: [jsonl]}
"""


def test_the_issue_snippet_runs_as_written(tmp_path, monkeypatch):
    """Issue 42's Python API, with its placeholders filled: a `(completion, example)` reward
    and rows whose `prompt` is a plain string. The reward is wrapped (same name and
    parameters) to see what it was called with."""
    code = ISSUE_SNIPPET
    for placeholder, value in FILLS:
        assert code.count(placeholder) == 1
        code = code.replace(placeholder, value)
    undone = code
    for placeholder, value in FILLS:
        undone = undone.replace(value, placeholder)
    assert undone == ISSUE_SNIPPET
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.yaml").write_text(MY_YAML)
    calls: list[tuple] = []
    given = trainer_objects.PythonObjects.given.__func__

    def spy(cls, cfg, reward_fn=None, *args, **kwargs):
        @functools.wraps(reward_fn)
        def recorded(completion: str, example: dict) -> float:
            value = reward_fn(completion, example)
            calls.append((completion, example, value))
            return value

        return given(cls, cfg, recorded, *args, **kwargs)

    monkeypatch.setattr(trainer_objects.PythonObjects, "given", classmethod(spy))
    namespace: dict = {"__name__": "issue_snippet"}
    exec(compile(code, "issue 42", "exec"), namespace)  # noqa: S102

    history = namespace["history"]
    assert [h["step"] for h in history] == [1, 2]
    assert len(calls) == 2 * 2 * 2  # 2 steps x 2 prompts x n=2
    answers = {"What is 2 + 2?": "4", "What is 3 + 3?": "6"}
    for completion, example, value in calls:
        assert isinstance(completion, str)
        assert example["prompt"] == example["question"] and example["prompt"] in answers
        assert example["answer"] == example["ground_truth"] == answers[example["prompt"]]
        assert example["data_source"] == "train_data"
        assert value == float(example["answer"] in completion)
    assert history[0]["reward/mean"] == pytest.approx(sum(c[2] for c in calls[:4]) / 4)
    # The rows' prompt strings are the user turns the model was asked.
    trainer = namespace["trainer"]
    assert sorted((ex.prompt[-1]["role"], ex.prompt[-1]["content"])
                  for ex in trainer.train_data) == [("user", q) for q in sorted(answers)]
    record = json.loads((trainer.out_dir / "run.json").read_text())
    assert record["objects"]["reward_fn"] == "issue_snippet.my_reward"


def length_reward(solution_str, ground_truth):
    """Varies with the sampled text, so the step's mean says whose values it averaged."""
    return {"score": len(solution_str) / 100.0, "acc": float(ground_truth == "4"),
            "chars": float(len(solution_str))}


def other_reward(solution_str):
    return 0.5


def test_reward_values_reach_the_metrics_and_a_resume_names_a_changed_reward(
        tmp_path, capfd):
    import pyarrow as pa

    seen: list[tuple[str, float]] = []

    def reward(solution_str, ground_truth):
        out = length_reward(solution_str, ground_truth)
        seen.append((ground_truth, out["score"]))
        return out

    reward.__qualname__ = "length_reward"  # one name across both runs of this test
    table = pa.Table.from_pylist([{"question": f"{a} + {a}?", "answer": str(2 * a)}
                                  for a in range(1, 5)])
    run = tmp_path / "run"
    cfg = appo.load_config(overrides=[*TINY, "trainer.total_steps=1", "data.val_files=[]",
                                      f"trainer.default_local_dir={run}"])
    history = appo.RLTrainer(cfg, progress=False, reward_fn=reward, train_data=table).fit()
    assert len(seen) == 4  # 2 prompts x n=2
    assert {gt for gt, _ in seen} <= {"2", "4", "6", "8"}
    assert history[0]["reward/mean"] == pytest.approx(sum(s for _, s in seen) / 4)
    assert history[0]["reward/accuracy"] == pytest.approx(
        sum(gt == "4" for gt, _ in seen) / 4)
    assert json.loads((run / "run.json").read_text())["objects"]["reward_fn"].endswith(
        ".length_reward")

    capfd.readouterr()
    cfg = appo.load_config(overrides=[*TINY, "trainer.total_steps=2", "data.val_files=[]",
                                      f"trainer.default_local_dir={run}", "trainer.resume=true"])
    history = appo.RLTrainer(cfg, progress=False, reward_fn=other_reward,
                             train_data=table).fit()
    err = capfd.readouterr().err
    assert re.search(r"warning: resuming with another Python object: reward_fn: \S+"
                     r"length_reward -> \S+other_reward", err), err
    assert "Python object: train_data" not in err  # the same rows: no warning for them
    assert [h["step"] for h in history] == [2]
    assert history[0]["reward/mean"] == pytest.approx(0.5)


@pytest.mark.parametrize("kwargs, message", [
    ({"reward_fn": 3}, "reward_fn: int is not callable"),
    ({"train_data": "rows.jsonl"}, "train_data: expected a list of dicts"),
    ({"train_data": [{"question": "q", "answer": "a"}, 7]},
     "train_data row 1: expected a dict of columns, got int"),
    ({"val_data": []}, "val_data: no rows"),
    ({"strategy": "arpo"}, "strategy: str is not callable"),
])
def test_bad_objects_are_one_line(kwargs, message):
    from appo.trainer.objects import PythonObjects

    cfg = appo.load_config()
    with pytest.raises(AppoError, match=re.escape(message)) as e:
        PythonObjects.given(cfg, **kwargs)
    assert "\n" not in str(e.value)


def test_a_reward_object_and_a_reward_file_are_refused_together(tmp_path):
    from appo.rewards import router_from_config
    from appo.trainer.objects import PythonObjects

    reward = tmp_path / "r.py"
    reward.write_text("def compute_score(solution_str, ground_truth):\n    return 1.0\n")
    cfg = appo.load_config(overrides=[f"custom_reward_function.path={reward}"])
    with pytest.raises(AppoError, match="give one reward function"):
        PythonObjects.given(cfg, reward_fn=other_reward)
    with pytest.raises(AppoError, match="give one"):
        router_from_config(cfg, reward_fn=other_reward)


@pytest.mark.parametrize("params, message", [
    ("text, row", "parameter(s) text, row cannot be given; a reward function takes "
                  "(data_source, solution_str, ground_truth, extra_info)"),
    ("completion, ground_truth", "mixes the parameters of two forms (completion, "
                                 "ground_truth)"),
    ("completion, example, scale", "parameter(s) scale cannot be given"),
    ("x, /", "parameter(s) x cannot be given"),
])
def test_a_reward_of_neither_form_is_refused_in_one_line(params, message):
    from appo.rewards.router import RewardRouter
    from appo.trainer.objects import PythonObjects

    namespace: dict = {}
    exec(f"def odd({params}):\n    return 0.0\n", namespace)  # noqa: S102
    for build in (lambda: RewardRouter(custom_fn=namespace["odd"]),
                  lambda: PythonObjects.given(appo.load_config(), reward_fn=namespace["odd"]),
                  lambda: appo.register_reward("odd_form", namespace["odd"])):
        with pytest.raises(AppoError, match=re.escape(message)) as e:
            build()
        assert "\n" not in str(e.value)
    from appo.registry import REWARDS

    assert "odd_form" not in REWARDS


def test_a_reward_of_the_example_form_gets_the_text_and_the_row():
    from appo.rewards.router import RewardRouter

    got = []

    def reward(completion: str, example: dict) -> float:
        got.append((completion, example))
        return 0.75

    router = RewardRouter(custom_fn=reward)
    out = router("mine", "the answer is 4", "4", {"index": 3, "question": "2 + 2?",
                                                  "level": "easy"}, "math")
    assert out.score == 0.75 and out.reward_fn.endswith("reward")
    assert got == [("the answer is 4", {
        "index": 3, "question": "2 + 2?", "prompt": "2 + 2?", "level": "easy", "answer": "4",
        "ground_truth": "4", "data_source": "mine", "ability": "math"})]

    def only_text(completion, example=None):  # a defaulted `example`: passed all the same
        got.append((completion, example is not None))
        return 0.0

    RewardRouter(custom_fn=only_text)("mine", "x", "4", None, "math")
    assert got[-1] == ("x", True)


def test_a_reward_function_gets_verls_arguments_by_name():
    from appo.rewards.router import RewardRouter

    got = {}

    def reward(data_source, solution_str, ground_truth, extra_info):
        got.update(data_source=data_source, solution_str=solution_str,
                   ground_truth=ground_truth, extra_info=extra_info)
        return {"score": 0.25, "acc": 1, "reason": "ok", "steps": 3}

    router = RewardRouter(custom_fn=reward)
    out = router("mine", "the answer is 4", "4", {"index": 0}, "math")
    assert got == {"data_source": "mine", "solution_str": "the answer is 4",
                   "ground_truth": "4", "extra_info": {"index": 0}}
    assert (out.score, out.accuracy, out.reason, out.metrics["steps"]) == (0.25, 1.0, "ok", 3.0)
    assert out.reward_fn.endswith("reward")


def test_a_strategy_object_is_registered_and_named_in_the_config():
    from appo.registry import STRATEGIES
    from appo.rollout.strategies import rollout_grpo
    from appo.trainer.objects import PythonObjects

    def my_grpo(prompts, engine, tools, settings, rng=None, score_fn=None):
        return rollout_grpo(prompts, engine, tools, settings)

    cfg = appo.load_config()
    try:
        objects = PythonObjects.given(cfg, strategy=my_grpo)
        assert cfg.rollout.strategy == f"{__name__}.{my_grpo.__qualname__}"
        assert appo.get_strategy(cfg.rollout.strategy) is my_grpo
        assert objects.identity() == {"strategy": cfg.rollout.strategy}
        # A built-in given as an object keeps its own name.
        cfg2 = appo.load_config()
        PythonObjects.given(cfg2, strategy=rollout_grpo)
        assert cfg2.rollout.strategy == "grpo"
    finally:
        STRATEGIES.unregister(f"{__name__}.{my_grpo.__qualname__}")


def test_import_appo_stays_light():
    code = ("import sys, appo; assert callable(appo.load_config); "
            "print('torch' in sys.modules, 'appo.trainer.loop' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(REPO / "src")}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
    assert "RLTrainer" in dir(appo) and "register_strategy" in appo.__all__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        appo.nope  # noqa: B018
