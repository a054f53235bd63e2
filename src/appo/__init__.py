"""appo: train tool-using reasoning agents with ARPO / AEPO / APPO reinforcement learning.

The front door (docs/python-api.md):

    import appo

    cfg = appo.load_config("my.yaml", overrides=["trainer.total_steps=2"])  # path optional
    trainer = appo.RLTrainer(cfg, reward_fn=my_reward, train_data=[{...}, ...])
    history = trainer.fit()          # one dict of metrics per step

    @appo.register_strategy("fixed")  # then rollout.strategy=fixed (docs/extending.md)
    def fixed(prompts, engine, tools, settings, rng=None, score_fn=None): ...

    @appo.register_reward("exact")    # rows of data_source "exact", or
    def exact(solution_str, ground_truth): ...  # custom_reward_function.name=exact

    @appo.register_policy_loss("mine")  # actor.policy_loss=mine (and register_advantage
    def mine(logp, old_logp, advantages, loss_mask, *, agg, params, entropy=None): ...

Stages are importable on their own: ``appo.models``, ``appo.tools``, ``appo.rollout``,
``appo.algos``, ``appo.rewards``, ``appo.data``, ``appo.trainer``, ``appo.eval``.
Nothing heavy is imported here (the names above are looked up on first use), so
``import appo`` is instant.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> (module, attribute): imported on first access (PEP 562), since the trainer pulls
# torch and transformers.
_EXPORTS: dict[str, tuple[str, str]] = {
    "AppoConfig": ("appo.config", "AppoConfig"),
    "AppoError": ("appo.errors", "AppoError"),
    "RLTrainer": ("appo.trainer.loop", "RLTrainer"),
    "RewardOutput": ("appo.rewards.base", "RewardOutput"),
    "get_advantage": ("appo.registry", "get_advantage"),
    "get_policy_loss": ("appo.registry", "get_policy_loss"),
    "get_strategy": ("appo.registry", "get_strategy"),
    "load_config": ("appo.config", "load_config"),
    "load_plugin": ("appo.plugins", "load_plugin"),
    "register_advantage": ("appo.registry", "register_advantage"),
    "register_policy_loss": ("appo.registry", "register_policy_loss"),
    "register_reward": ("appo.registry", "register_reward"),
    "register_strategy": ("appo.registry", "register_strategy"),
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'appo' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
