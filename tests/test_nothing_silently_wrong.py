"""Issue 41: a run that goes to NaN stops with one line before the optimizer step and saves
nothing; metrics keep a NaN as NaN (null in the JSONL); every config value is checked when
the config loads (class 1); `appo view` never replaces its input and names what a non-file
input is.

Commands run through the real command line (`run_cli`) on the tiny random model, with the
learnable reward of tests/trainer/test_trainer_rl.py so the update has a gradient.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from appo.trainer.guards import NonFiniteError, check_finite
from appo.trainer.metrics import MetricsLogger, read_metrics
from cli_runner import run_cli
from toy_files import make_toy_files

TRAIN = ["model.path=tiny-test", "data.val_files=[]", "data.train_batch_size=2",
         "data.max_response_length=8", "rollout.strategy=grpo", "rollout.n=2",
         "actor.ppo_mini_batch_size=2", "trainer.logger=[jsonl]", "tools.enabled=[]",
         "data.train_files=[toy.jsonl]", "custom_reward_function.path=reward.py",
         "trainer.default_local_dir=run"]


BAR = re.compile(r"^[\w ]+:\s+\d+%\|")  # a tqdm progress bar (`rl:  50%|...`)


def shown_lines(stderr: str) -> list[str]:
    """stderr's lines less the progress bars' (redrawn with carriage returns or newlines):
    an error written after a bar without ending it shows up as a bar line, not as the error."""
    parts = (p for line in stderr.split("\n") for p in line.split("\r"))
    return [p for p in parts if p.strip() and not BAR.match(p)]


def error_line(r: subprocess.CompletedProcess, *names: str) -> str:
    """Failed with exactly one line on stderr (as shown), `error: ...`, naming `names`."""
    assert r.returncode != 0, r.stdout[-500:]
    assert "Traceback" not in r.stderr, r.stderr
    lines = shown_lines(r.stderr)
    assert len(lines) == 1, lines
    # "error: unexpected <Exception>" is the CLI's last resort for internal errors.
    assert lines[0].startswith("error: ") and not lines[0].startswith("error: unexpected")
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def files(tmp_path, monkeypatch) -> Path:
    return make_toy_files(tmp_path, monkeypatch)


def _checkpoints(run: Path) -> list[Path]:
    return sorted(run.glob("global_step_*")) if run.exists() else []


# ---------------------------------------------------------------- the non-finite guard
def test_a_diverging_rl_run_stops_before_the_step_and_saves_nothing(files):
    r = run_cli("train", *TRAIN, "trainer.total_steps=2", "actor.optim.lr=1e30")
    error_line(r, "step 2:", "actor/grad_norm is nan", "before the optimizer step",
               "actor.optim.lr")
    assert _checkpoints(Path("run")) == []
    rows = read_metrics("run/metrics.jsonl")
    assert [row["step"] for row in rows] == [1]  # step 1 was finite and logged
    assert math.isfinite(rows[0]["actor/grad_norm"]) and rows[0]["actor/grad_norm"] > 0


def test_a_nan_clip_is_refused_at_load(files):
    r = run_cli("train", *TRAIN, "trainer.total_steps=2", "actor.grad_clip=nan")
    error_line(r, "'actor.grad_clip'", "nan")
    assert not Path("run").exists()


def test_a_diverging_sft_run_stops_and_saves_nothing(files):
    r = run_cli("sft", "model.path=tiny-test", "sft.lr=1e30", "sft.max_steps=3",
                "sft.batch_size=2", "sft.output_dir=out", "trainer.logger=[jsonl]")
    error_line(r, "step 2:", "sft/grad_norm is nan", "sft.lr")
    assert _checkpoints(Path("out")) == []
    assert "final loss" not in r.stdout


def test_a_weight_that_overflows_is_never_saved(files):
    """float16 weights trained in place: a finite gradient step can still overflow them."""
    r = run_cli("sft", "model.path=tiny-test", "model.dtype=float16", "model.device=cpu",
                "actor.fp32_master_weights=false", "sft.lr=1e5", "sft.max_steps=1",
                "sft.batch_size=2", "sft.output_dir=out", "trainer.logger=[jsonl]")
    error_line(r, "step 1: a weight is not finite", "before saving it")
    assert _checkpoints(Path("out")) == []


def test_the_critic_stops_before_its_step():
    sys.path.insert(0, str(Path(__file__).parent / "trainer"))
    from test_trainer_critic import fixed_critic_rows, make_critic

    critic, tok = make_critic()
    batch = fixed_critic_rows(tok)
    batch.rewards[0] = float("nan")
    before = [p.detach().clone() for p in critic.params]
    with pytest.raises(NonFiniteError, match="critic/grad_norm is nan.*critic.optim.lr"):
        critic.update(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, critic.params, strict=True))
    assert all(not s for s in critic.optimizer.state.values())  # AdamW never stepped


def test_check_finite_names_the_first_bad_value_and_the_step():
    check_finite(3, **{"a/loss": 1.0, "a/grad_norm": torch.tensor(2.0)})
    with pytest.raises(NonFiniteError, match=r"^step 3: a/grad_norm is inf"):
        check_finite(3, **{"a/loss": 1.0, "a/grad_norm": float("inf")})
    with pytest.raises(NonFiniteError) as e:
        check_finite(**{"x": float("nan")})
    assert str(e.value.at_step(7)).startswith("step 7: x is nan")


# ---------------------------------------------------------------- metrics keep a NaN
def test_metrics_log_nan_as_null_and_nan(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, ["jsonl", "console"])
    logger.log(1, {"actor/grad_norm": float("nan"), "actor/pg_loss": float("inf"),
                   "reward/mean": 0.5, "note": "text"}, console_keys=["actor/grad_norm"])
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    row = json.loads(line)  # standard JSON: no NaN token
    assert "NaN" not in line and "Infinity" not in line
    assert row == {"step": 1, "actor/grad_norm": None, "actor/pg_loss": None,
                   "reward/mean": 0.5}
    back = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert math.isnan(back["actor/grad_norm"]) and back["reward/mean"] == 0.5
    assert "actor/grad_norm=nan" in capsys.readouterr().err


# ---------------------------------------------------------------- class 1 from the command line
BAD_AT_LOAD = [
    ("sft.epochs=0", ["'sft.epochs'", ">= 1"]),
    ("sft.max_steps=0", ["'sft.max_steps'"]),
    ("sft.warmup_ratio=5", ["'sft.warmup_ratio'", "[0, 1]"]),
    ("tools.timeout=-1", ["'tools.timeout'"]),
    ("tools.call_limit=-1", ["'tools.call_limit'"]),
    ("tools.retry_count=-2", ["'tools.retry_count'"]),
    ("model.lora_alpha=-16", ["'model.lora_alpha'"]),
    ("rollout.temperature=nan", ["'rollout.temperature'"]),
    ("rollout.entropy_weight=inf", ["'rollout.entropy_weight'"]),
    ("critic.cliprange_value=nan", ["'critic.cliprange_value'"]),
    ("actor.optim.lr=-1e-5", ["'actor.optim.lr'"]),
    ("actor.optim.lr=nan", ["'actor.optim.lr'"]),
    ("actor.clip_ratio_low=nan", ["'actor.clip_ratio_low'"]),
    ("actor.kl_loss_coef=inf", ["'actor.kl_loss_coef'"]),
    ("actor.entropy_coeff=nan", ["'actor.entropy_coeff'"]),
    ("sft.grad_clip=nan", ["'sft.grad_clip'"]),
    ("critic.grad_clip=-inf", ["'critic.grad_clip'"]),
    ("actor.grad_clip=${nope}", ["'actor.grad_clip'", "'nope'"]),
    ("data.train_files=[a", ["'data.train_files=[a'"]),
]


@pytest.mark.parametrize("i", range(len(BAD_AT_LOAD)),
                         ids=[o for o, _ in BAD_AT_LOAD])
def test_bad_values_are_one_line_at_load(files, i):
    override, names = BAD_AT_LOAD[i]
    command = ("train", "sft")[i % 2]  # both load through the one check
    error_line(run_cli(command, "model.path=tiny-test", override), *names)
    assert not Path("runs").exists()


def test_search_pages_parameters_are_checked(files):
    from appo.errors import AppoError
    from appo.tools.page_step import PagesConfig

    with pytest.raises(AppoError, match=r"'search pages\.timeout': nan"):
        PagesConfig.from_params({"timeout": float("nan")})
    with pytest.raises(AppoError, match=r"'search pages\.max_documents_chars': -5"):
        PagesConfig.from_params({"max_documents_chars": -5})
    with pytest.raises(AppoError, match=r"'search pages\.summariser\.timeout': inf"):
        PagesConfig.from_params({"summariser": {"timeout": float("inf")}})
    assert PagesConfig.from_params({"timeout": 5}).timeout == 5


def test_compare_spec_eval_values_are_checked(tmp_path):
    from appo.compare.spec import _eval
    from appo.errors import AppoError

    for key, value in (("top_p", 7), ("top_k", -9), ("temperature", float("nan"))):
        with pytest.raises(AppoError, match=rf"'eval\.{key}'"):
            _eval({"sets": ["a.jsonl"], key: value})


# ---------------------------------------------------------------- appo view
def test_view_refuses_to_write_over_its_input(files):
    dump = Path("dump.jsonl")
    dump.write_text(json.dumps({"traj_id": "t0"}) + "\n")
    before = dump.read_bytes()
    for out in ("dump.jsonl", "./dump.jsonl", str(dump.resolve())):
        error_line(run_cli("view", "dump.jsonl", "-o", out), "is the input", "-o")
    error_line(run_cli("view", ".", "-o", "dump.jsonl"), "is the input")
    assert dump.read_bytes() == before


def test_view_names_what_a_device_is(files):
    error_line(run_cli("view", "/dev/zero"), "/dev/zero is a character device")
    error_line(run_cli("view", "nothing.jsonl"), "not found")


@pytest.mark.parametrize("params, key", [
    ({"timeout": float("nan")}, "python.params.timeout"),
    ({"timeout": -1}, "python.params.timeout"),
    ({"cpu_time": float("inf")}, "python.params.cpu_time"),
    ({"memory_mb": 0}, "python.params.memory_mb"),
])
def test_python_tool_parameters_are_checked(params, key):
    from appo.errors import AppoError
    from appo.tools.python_tool import PythonTool

    with pytest.raises(AppoError, match=rf"'tools\.tool_instances\.{re.escape(key)}'"):
        PythonTool(eager_start=False, **params)


def test_search_tool_parameters_are_checked(tmp_path):
    from appo.errors import AppoError
    from appo.tools.search_tool import SearchTool

    for params, key in (({"timeout": float("nan")}, "timeout"), ({"max_results": 0},
                                                                   "max_results")):
        with pytest.raises(AppoError, match=rf"'tools\.tool_instances\.search\.params\.{key}'"):
            SearchTool(backend="replay", replay_file=str(tmp_path / "r.json"), cache=False,
                       **params)


# ---------------------------------------------------------------- misleading messages
def test_config_show_of_a_key_shows_it(files):
    r = run_cli("config", "show", "rollout.n", "rollout.n=4", "rollout.initial_rollouts=2")
    assert r.returncode == 0, r.stderr
    assert r.stdout == "rollout.n: 4\n"
    r = run_cli("config", "show", "actor.optim")
    assert r.returncode == 0 and r.stdout.startswith("actor.optim:\n  lr: ")
    error_line(run_cli("config", "show", "rollout.nn"), "'rollout.nn' is no config file",
               "did you mean 'rollout.n'")
    error_line(run_cli("config", "show", "missing.yaml"), "config file not found: missing.yaml")


def test_overwrite_and_resume_together_are_refused(files):
    error_line(run_cli("train", *TRAIN, "trainer.overwrite=true", "trainer.resume=true"),
               "trainer.overwrite=true and trainer.resume=true", "give one")
    assert not Path("run").exists()


# ---------------------------------------------------------------- chat templates
def _tiny_dir(path: Path, template: str | None) -> Path:
    from appo.models.tiny import build_tiny

    model, tok = build_tiny()
    tok.chat_template = template
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_a_chat_template_that_does_not_compile_is_one_line(files):
    _tiny_dir(Path("bad"), "{% for m in messages %}{{ m.content }")
    error_line(run_cli("data", "check-template", "--model", "bad"), "chat template of bad",
               "does not compile", "line 1")
    error_line(run_cli("train", *TRAIN, "model.path=bad", "trainer.total_steps=1"),
               "does not compile")


def test_a_model_without_a_chat_template_is_one_line_in_train(files):
    _tiny_dir(Path("plain"), None)
    error_line(run_cli("train", *TRAIN, "model.path=plain", "trainer.total_steps=1"),
               "has no chat template")
