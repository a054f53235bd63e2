"""Config: defaults, YAML merge, dotted overrides, and the error messages users see."""

from __future__ import annotations

import pytest
import yaml
from omegaconf import ValidationError

from appo.config import CHOICES, load_config
from appo.errors import AppoError
from cli_runner import run_cli


def test_defaults_describe_embedded_setup():
    cfg = load_config()
    assert cfg.model.path == "smollm2-135m"
    assert cfg.model.device == "auto"
    assert cfg.rollout.strategy in CHOICES["rollout.strategy"]
    assert cfg.tools.tool_instances["python"].class_path == "appo.tools.python_tool.PythonTool"


def test_yaml_then_overrides_win(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  n: 4\n  strategy: grpo\nactor:\n  clip_ratio_high: 0.25\n")
    cfg = load_config(f, ["rollout.n=16", "actor.clip_ratio_high=0.28"])
    assert cfg.rollout.n == 16  # override beats file
    assert cfg.rollout.strategy == "grpo"  # file beats default
    assert cfg.actor.clip_ratio_high == pytest.approx(0.28)
    assert cfg.actor.clip_ratio_low == pytest.approx(0.2)  # untouched default


def test_override_types_are_converted_and_checked():
    cfg = load_config(overrides=["rollout.temperature=0.6", "trainer.total_steps=2"])
    assert isinstance(cfg.rollout.temperature, float) and cfg.trainer.total_steps == 2
    with pytest.raises(AppoError, match=r"'rollout\.n'.*'abc'"):
        load_config(overrides=["rollout.n=abc"])


def test_assignment_is_type_checked():
    cfg = load_config()
    with pytest.raises(ValidationError):
        cfg.rollout.n = "many"


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("rollout.nn=3", "rollout.n"),
        ("rollot.n=3", "rollout.n"),
        ("actor.clip_ratio_hi=0.3", "actor.clip_ratio_high"),
        ("clip_ratio_high=0.3", "actor.clip_ratio_high"),
    ],
)
def test_unknown_key_names_nearest_valid_key(override, suggestion):
    with pytest.raises(AppoError) as e:
        load_config(overrides=[override])
    msg = str(e.value)
    assert msg.startswith(f"unknown config key '{override.split('=')[0]}'")
    assert f"'{suggestion}'" in msg


def test_unknown_key_in_yaml_names_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  total_step: 3\n")
    with pytest.raises(AppoError, match=r"unknown config key 'trainer\.total_step'.*trainer\.total_steps"):
        load_config(f)


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("rollout.strategy=foo", r"'rollout\.strategy': 'foo' \(choose from grpo, arpo, aepo, appo\)"),
        ("actor.policy_loss=ppo", r"'actor\.policy_loss': 'ppo'"),
        ("rollout.n=0", r"'rollout\.n': 0 \(must be >= 1\)"),
        ("rollout.branch_probability=1.5", r"must be in \[0, 1\]"),
        ("trainer.logger=[console,foo]", r"'trainer\.logger': 'foo'"),
        ("norequals", r"expected key=value"),
    ],
)
def test_bad_values_name_key_and_value(override, pattern):
    with pytest.raises(AppoError, match=pattern):
        load_config(overrides=[override])


def test_appo_credit_needs_appo_rollouts():
    # arpo/aepo branches are trained rows; the appo credit mapping would give them no
    # advantage, silently. Say so at load time.
    with pytest.raises(AppoError, match=r"adv_estimator=appo needs rollout\.strategy=appo "
                                        r"\(got 'arpo'\)"):
        load_config(overrides=["algorithm.adv_estimator=appo", "rollout.strategy=arpo"])
    cfg = load_config(overrides=["algorithm.adv_estimator=appo", "rollout.strategy=appo"])
    assert cfg.algorithm.adv_estimator == "appo"


def test_rollout_defaults_follow_the_spec_and_noise_tolerance_reaches_the_settings():
    from appo.rollout import RolloutSettings

    cfg = load_config()
    assert (cfg.rollout.n, cfg.rollout.initial_rollouts) == (16, 8)  # docs/algorithms.md §2.2
    assert RolloutSettings.from_config(cfg).lr_noise_tol is None  # by the scorer's dtype
    cfg = load_config(overrides=["rollout.lr_noise_tol=0.05"])
    assert RolloutSettings.from_config(cfg).lr_noise_tol == 0.05


def test_open_dicts_accept_new_tool_instances():
    cfg = load_config(
        overrides=[
            "tools.tool_instances.search.class_path=appo.tools.search_tool.SearchTool",
            "tools.tool_instances.search.params.backend=bm25",
        ]
    )
    assert cfg.tools.tool_instances["search"].params["backend"] == "bm25"
    with pytest.raises(AppoError, match="class_path' is not set"):
        load_config(overrides=["tools.tool_instances.web.params.x=1"])


def test_bad_files(tmp_path):
    with pytest.raises(AppoError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [unclosed\n")
    with pytest.raises(AppoError, match="cannot parse config file"):
        load_config(bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(AppoError, match="must hold a mapping"):
        load_config(lst)


def test_cli_config_show_prints_resolved_yaml(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("rollout:\n  n: 4\n")
    r = run_cli("config", "show", str(f), "rollout.beam_size=3")
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    assert shown["rollout"]["n"] == 4 and shown["rollout"]["beam_size"] == 3
    r = run_cli("config", "show", "rollout.n=5")  # overrides without a file
    assert r.returncode == 0 and yaml.safe_load(r.stdout)["rollout"]["n"] == 5


def test_cli_unknown_key_is_one_line_error_without_traceback():
    r = run_cli("config", "show", "rollout.nn=3")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0
    assert "Traceback" not in r.stderr and "did you mean 'rollout.n'" in r.stderr
    r = run_cli("--debug", "config", "show", "rollout.nn=3")
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_tools_enabled_selects_instances():
    from appo.config import enabled_tool_names

    cfg = load_config(overrides=["tools.enabled=[]"])
    assert enabled_tool_names(cfg.tools) == []
    assert enabled_tool_names(load_config().tools) == ["python"]
    with pytest.raises(AppoError, match="'tools.enabled': 'search' is not a tool instance"):
        load_config(overrides=["tools.enabled=[search]"])
