"""verl's keys as the original ARPO/AEPO/APPO scripts pass them (minus verl's
`actor_rollout_ref.` prefix), read for what they mean in appo (configs/README.md, "verl keys").

- `RENAMED`: the same setting under appo's name; the value moves there.
- `NO_OPS`: settings appo has no switch for because it always behaves one way; accepted
  (a boolean), with one note per process.
- `REFUSED`: settings appo does not have; one error line naming the appo key to use.

Applied to a YAML file's keys and to the overrides before they are merged into the schema.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from appo.errors import AppoError, warn_once

RENAMED: dict[str, str] = {
    "actor.ppo_max_token_len_per_gpu": "actor.ppo_max_token_len_per_device",
    "critic.ppo_max_token_len_per_gpu": "critic.ppo_max_token_len_per_device",
}

NO_OPS: dict[str, str] = {
    "actor.use_dynamic_bsz": "appo always splits micro-batches by the token budget "
                             "actor.ppo_max_token_len_per_device",
    "critic.use_dynamic_bsz": "appo always splits micro-batches by the token budget "
                              "critic.ppo_max_token_len_per_device",
    "model.use_remove_padding": "appo has no padding-removal switch; its update forward "
                                "computes a group's shared prompt once "
                                "(actor.share_prefix_forward)",
}

REFUSED: dict[str, str] = {
    "ref.fsdp_config.param_offload": "the KL reference is placed as the policy is: use "
                                     "actor.fsdp_config.param_offload",
    "ref.log_prob_max_token_len_per_gpu": "reference log-probs use the update's token "
                                          "budget: use actor.ppo_max_token_len_per_device",
    "rollout.log_prob_max_token_len_per_gpu": "old log-probs use the update's token budget: "
                                              "use actor.ppo_max_token_len_per_device",
    "actor.ppo_micro_batch_size_per_gpu": "appo splits micro-batches by tokens: use "
                                          "actor.ppo_max_token_len_per_device",
}

PREFIX = "actor_rollout_ref."


def _pop(cfg: DictConfig, key: str) -> tuple[bool, Any]:
    """Remove `key` (dotted) from `cfg`: (found, value)."""
    head, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, head, default=None) if head else cfg
    if not isinstance(parent, DictConfig) or leaf not in parent:
        return False, None
    value = parent[leaf]
    del parent[leaf]
    if head and len(parent) == 0:  # `fsdp_config: {}` left behind would be unknown
        _pop(cfg, head)
    return True, value


def _first_leaf(node: Any) -> str:
    if isinstance(node, DictConfig) and len(node):
        key = next(iter(node.keys()))
        inner = _first_leaf(node._get_node(key))
        return f"{key}.{inner}" if inner else str(key)
    return ""


def translate_verl_keys(cfg: Any, where: str = "") -> Any:
    """`cfg` (a YAML file's or the overrides' DictConfig) with verl's keys read as appo's."""
    if not isinstance(cfg, DictConfig):
        return cfg
    if PREFIX.rstrip(".") in cfg:
        key = PREFIX + _first_leaf(cfg[PREFIX.rstrip(".")])
        appo_key = key.removeprefix(PREFIX).replace("rollout.tools.", "tools.", 1)
        raise AppoError(f"config key {key!r}{where}: appo drops verl's {PREFIX!r} prefix; "
                        f"use {appo_key!r}")
    for key, reason in REFUSED.items():
        if _pop(cfg, key)[0]:
            raise AppoError(f"config key {key!r}{where} is verl's, not appo's: {reason}")
    for key, target in RENAMED.items():
        found, value = _pop(cfg, key)
        if not found:
            continue
        if OmegaConf.select(cfg, target, default=None) not in (None, value):
            raise AppoError(f"config keys {key!r} and {target!r}{where} disagree: give "
                            f"{target!r} only")
        OmegaConf.update(cfg, target, value, force_add=True)
    for key, reason in NO_OPS.items():
        found, value = _pop(cfg, key)
        if not found:
            continue
        if not isinstance(value, bool):
            raise AppoError(f"bad value for config key {key!r}{where}: {value!r} (true or "
                            "false)")
        warn_once(f"{key} (verl's) has no effect: {reason}")
    return cfg
