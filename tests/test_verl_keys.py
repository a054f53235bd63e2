"""verl's keys as the original scripts pass them (issue 39, part 4): read with their meaning,
or refused with one line naming the appo key to use (configs/README.md, "verl keys")."""

from __future__ import annotations

import logging

import pytest

from appo.config import load_config
from appo.errors import AppoError


def test_ppo_max_token_len_per_gpu_is_the_device_budget(tmp_path):
    cfg = load_config(None, ["actor.ppo_max_token_len_per_gpu=11264"])
    assert cfg.actor.ppo_max_token_len_per_device == 11264
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  ppo_max_token_len_per_gpu: 9000\n")
    assert load_config(path).actor.ppo_max_token_len_per_device == 9000
    cfg = load_config(None, ["critic.ppo_max_token_len_per_gpu=512"])
    assert cfg.critic.ppo_max_token_len_per_device == 512
    with pytest.raises(AppoError, match="disagree"):
        load_config(None, ["actor.ppo_max_token_len_per_gpu=100",
                           "actor.ppo_max_token_len_per_device=200"])
    with pytest.raises(AppoError, match=r"'actor\.ppo_max_token_len_per_device': 0"):
        load_config(None, ["actor.ppo_max_token_len_per_gpu=0"])


@pytest.mark.parametrize("key, says", [
    ("actor.use_dynamic_bsz", "actor.ppo_max_token_len_per_device"),
    ("model.use_remove_padding", "no padding-removal switch"),
])
def test_no_op_keys_are_accepted_with_one_note(key, says, caplog):
    from appo import errors

    for message in [m for m in errors._warned if key in m]:  # an earlier test's note
        errors._warned.discard(message)
    with caplog.at_level(logging.WARNING, logger="appo"):
        cfg = load_config(None, [f"{key}=True"])
        load_config(None, [f"{key}=false"])
    notes = [r.getMessage() for r in caplog.records if key in r.getMessage()]
    assert len(notes) == 1, notes
    assert "has no effect" in notes[0] and says in notes[0]
    assert cfg.actor.ppo_max_token_len_per_device == 4096  # nothing else changed
    with pytest.raises(AppoError, match=rf"'{key}': 3 \(true or false\)"):
        load_config(None, [f"{key}=3"])


def test_offload_switches_are_schema_keys():
    cfg = load_config(None, ["actor.fsdp_config.param_offload=True",
                             "actor.fsdp_config.optimizer_offload=False"])
    assert cfg.actor.fsdp_config.param_offload is True
    assert cfg.actor.fsdp_config.optimizer_offload is False
    assert load_config().actor.fsdp_config.param_offload is False  # the scripts' value
    with pytest.raises(AppoError, match="fsdp_config.param_offload"):
        load_config(None, ["actor.fsdp_config.param_offload=maybe"])


@pytest.mark.parametrize("override, names", [
    ("ref.fsdp_config.param_offload=True",
     ["'ref.fsdp_config.param_offload'", "actor.fsdp_config.param_offload"]),
    ("ref.log_prob_max_token_len_per_gpu=100", ["actor.ppo_max_token_len_per_device"]),
    ("rollout.log_prob_max_token_len_per_gpu=100", ["actor.ppo_max_token_len_per_device"]),
    ("actor_rollout_ref.actor.use_dynamic_bsz=True",
     ["'actor_rollout_ref.actor.use_dynamic_bsz'", "use 'actor.use_dynamic_bsz'"]),
    ("actor_rollout_ref.rollout.tools.call_limit=3", ["use 'tools.call_limit'"]),
])
def test_keys_appo_does_not_have_name_the_one_to_use(override, names):
    with pytest.raises(AppoError) as e:
        load_config(None, [override])
    message = str(e.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message


def test_the_scripts_keys_in_a_yaml_file(tmp_path):
    """The five keys of issue 39 as a YAML file (appo's key paths) load together."""
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  use_remove_padding: true\n"
                    "actor:\n  use_dynamic_bsz: true\n  ppo_max_token_len_per_gpu: 11264\n"
                    "  fsdp_config:\n    param_offload: false\n    optimizer_offload: false\n")
    cfg = load_config(path)
    assert cfg.actor.ppo_max_token_len_per_device == 11264
    assert cfg.actor.fsdp_config.optimizer_offload is False
