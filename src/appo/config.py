"""Typed configuration: dataclasses -> OmegaConf structured config, YAML + dotted overrides.

Sections: model, data, rollout, tools, algorithm, actor, trainer, sft, eval,
custom_reward_function. Key names follow the original ARPO/AEPO/APPO (verl) system where it
had one, minus verl's `actor_rollout_ref.` prefix: `actor_rollout_ref.rollout.n` is
`rollout.n` here, `actor_rollout_ref.actor.clip_ratio_high` is `actor.clip_ratio_high`.

The defaults describe the embedded setup (SmolLM2-135M on CPU, the synthetic `arith` task
with the python tool), so every command runs without a config file.

Errors never surface as OmegaConf tracebacks: an unknown key names the nearest valid keys,
a bad value names the key and the value, and names that select a registered function
(strategy, estimator, loss, ...) are checked here, at load time.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from appo.config_schema import (  # noqa: F401  (re-exported: appo.config is the one import)
    CHOICES,
    LIST_CHOICES,
    MISSING,
    ActorConfig,
    AlgorithmConfig,
    AppoConfig,
    CriticConfig,
    CriticModelConfig,
    CustomRewardConfig,
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    SFTConfig,
    ToolInstanceConfig,
    ToolsConfig,
    TrainerConfig,
)
from appo.errors import AppoError, warn_once

__all__ = ["MISSING", "AppoConfig", "load_config", "to_yaml", "CHOICES"]


def _all_keys(node: Any, prefix: str = "") -> list[str]:
    keys: list[str] = []
    if isinstance(node, DictConfig):
        for key in node.keys():
            full = f"{prefix}{key}"
            keys.append(full)
            keys.extend(_all_keys(node._get_node(key), full + "."))
    return keys


def _unknown_key_error(key: str, schema: DictConfig) -> AppoError:
    valid = _all_keys(schema)
    close = difflib.get_close_matches(key, valid, n=3, cutoff=0.5)
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in valid if k.rsplit(".", 1)[-1] == leaf][:3]
        close = close or difflib.get_close_matches(
            leaf, [k.rsplit(".", 1)[-1] for k in valid], n=3, cutoff=0.6
        )
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return AppoError(f"unknown config key {key!r}{hint}")


def _check_sections(schema: DictConfig, other: Any, where: str, prefix: str = "") -> None:
    """A section (`rollout`, `actor.optim`) given a value instead of keys: OmegaConf's own
    merge error for it names no key, so name the section and show the form it takes."""
    if not isinstance(other, DictConfig):
        return
    for key in other.keys():
        node = schema._get_node(key) if key in schema else None
        if not isinstance(node, DictConfig) or OmegaConf.is_missing(other, key):
            continue
        value = other._get_node(key)
        full = f"{prefix}{key}"
        if isinstance(value, DictConfig):
            if OmegaConf.get_type(node) is not dict:  # a typed section: check inside it
                _check_sections(node, value, where, full + ".")
            continue
        if value._is_none() and OmegaConf.get_type(node) is dict:
            continue
        example = next(iter(node.keys()), None)
        form = f"its keys, e.g. {full}.{example}=..." if example else "a mapping"
        raise AppoError(f"config key {full!r}{where} is a section, not a value "
                        f"(got {_short(value._value())}); give {form}")


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _merge(base: DictConfig, other: Any, where: str, tried: list[str] = ()) -> DictConfig:
    _check_sections(base, other, where)
    try:
        return OmegaConf.merge(base, other)  # type: ignore[return-value]
    except ConfigKeyError as e:
        key = e.full_key or str(e.key)
        # OmegaConf names the first unknown level; report the whole key the user wrote.
        key = next((t for t in tried if t == key or t.startswith(key + ".")), key)
        raise _unknown_key_error(key, base) from None
    except ValidationError as e:
        # OmegaConf leaves `msg` and `full_key` unset for some merge errors.
        detail = (e.msg or str(e) or type(e).__name__).splitlines()[0]
        if not e.full_key:
            raise AppoError(f"bad config{where}: {detail}") from None
        raise AppoError(f"bad value for config key {e.full_key!r}{where}: {detail}") from None
    except OmegaConfBaseException as e:
        raise AppoError(f"bad config{where}: {str(e).splitlines()[0]}") from None


def _parse_overrides(overrides: list[str]) -> DictConfig:
    dotlist = []
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise AppoError(f"bad override {item!r}: expected key=value, e.g. rollout.n=16")
        dotlist.append(item)
    try:
        return OmegaConf.from_dotlist(dotlist)
    except OmegaConfBaseException as e:
        raise AppoError(f"bad override: {str(e).splitlines()[0]}") from None


def _validate(cfg: DictConfig) -> None:
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise AppoError(
                f"bad value for config key {key!r}: {value!r} (choose from {', '.join(allowed)})"
            )
    for key, allowed in LIST_CHOICES.items():
        for value in OmegaConf.select(cfg, key):
            if value not in allowed:
                raise AppoError(
                    f"bad value in config key {key!r}: {value!r} "
                    f"(choose from {', '.join(allowed)})"
                )
    positive = ["rollout.n", "rollout.initial_rollouts", "rollout.beam_size",
                "rollout.entropy_window", "data.train_batch_size", "data.max_response_length",
                "actor.ppo_epochs", "actor.ppo_mini_batch_size", "eval.k", "tools.max_workers",
                "data.val_batch_size", "eval.max_response_length", "actor.logprob_chunk_size",
                "actor.ppo_max_token_len_per_device", "sft.batch_size", "sft.max_length",
                "sft.gradient_accumulation_steps"]
    for key in positive:
        value = OmegaConf.select(cfg, key)
        if value < 1:
            raise AppoError(f"bad value for config key {key!r}: {value!r} (must be >= 1)")
    # Unset (null) means "derive it": total_steps from the epochs.
    for key in ["trainer.total_steps", "trainer.total_epochs", "data.max_prompt_length",
                "critic.ppo_epochs", "critic.ppo_mini_batch_size",
                "critic.ppo_max_token_len_per_device"]:
        value = OmegaConf.select(cfg, key)
        if value is not None and value < 1:
            hint = ": a run of no steps trains nothing" if key.startswith("trainer.") else ""
            raise AppoError(f"bad value for config key {key!r}: {value!r} (must be >= 1{hint})")
    for key in ["rollout.temperature", "eval.temperature"]:
        value = OmegaConf.select(cfg, key)
        if value < 0:  # samplers treat any value <= 0 as greedy: a sign slip would hide
            raise AppoError(f"bad value for config key {key!r}: {value!r} (must be >= 0; "
                            "0 is greedy)")
    for key in ["actor.max_memory_gb", "actor.activation_memory_gb"]:
        value = OmegaConf.select(cfg, key)
        if value is not None and not value > 0:
            raise AppoError(f"bad value for config key {key!r}: {value!r} (must be > 0 GB, "
                            "or null)")
    if cfg.critic.cliprange_value <= 0:  # clamp(-c, c) needs c > 0
        raise AppoError(f"bad value for config key 'critic.cliprange_value': "
                        f"{cfg.critic.cliprange_value!r} (must be > 0)")
    for key in ["rollout.branch_probability", "rollout.top_p", "eval.top_p", "algorithm.gamma",
                "algorithm.lam"]:
        value = OmegaConf.select(cfg, key)
        if not 0.0 <= value <= 1.0:
            raise AppoError(f"bad value for config key {key!r}: {value!r} (must be in [0, 1])")
    if cfg.algorithm.adv_estimator == "appo" and cfg.rollout.strategy != "appo":
        # APPO's credit mapping treats every row with a parent as an untrained branch; arpo /
        # aepo branches are trained rows, so they would silently get no advantage.
        raise AppoError(
            f"algorithm.adv_estimator=appo needs rollout.strategy=appo (got "
            f"{cfg.rollout.strategy!r}); use grpo, rloo or reinforce_plus_plus with it"
        )
    r = cfg.rollout
    if r.initial_rollouts > r.n and r.strategy != "grpo":  # grpo samples n and ignores it
        warn_once(f"rollout.initial_rollouts={r.initial_rollouts} is more than rollout.n={r.n}: "
                  f"clamped to {r.n}, which leaves {r.strategy} no budget to branch")
    for name, inst in cfg.tools.tool_instances.items():
        if OmegaConf.is_missing(inst, "class_path"):
            raise AppoError(f"config key 'tools.tool_instances.{name}.class_path' is not set")
    for name in cfg.tools.enabled or []:
        if name not in cfg.tools.tool_instances:
            raise AppoError(
                f"bad value in config key 'tools.enabled': {name!r} is not a tool instance "
                f"(defined: {', '.join(cfg.tools.tool_instances) or 'none'})"
            )


def enabled_tool_names(tools_cfg: Any) -> list[str]:
    """Names of the tool instances a run uses, in definition order (`tools.enabled`)."""
    names = list(tools_cfg.tool_instances.keys())
    enabled = getattr(tools_cfg, "enabled", None)
    return names if enabled is None else [n for n in names if n in set(enabled)]


def _load_yaml(path: Path) -> Any:
    """OmegaConf.load with errors as `FILE:LINE:COL: problem`, the place an editor jumps to."""
    import yaml

    try:
        return OmegaConf.load(path)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = " ".join(filter(None, [e.context, e.problem])) or type(e).__name__
        raise AppoError(f"{where}: cannot parse config file: {what}") from None
    except UnicodeDecodeError as e:
        raise AppoError(f"{path}: cannot parse config file: not UTF-8 text (byte "
                        f"0x{e.object[e.start]:02x} at offset {e.start})") from None
    except Exception as e:  # noqa: BLE001 - other yaml / OmegaConf errors come in several types
        first = (str(e) or type(e).__name__).splitlines()[0]
        raise AppoError(f"{path}: cannot parse config file: {first}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> AppoConfig:
    """Defaults <- YAML file (optional) <- dotted overrides; validated; returned as AppoConfig.

    The returned object is an OmegaConf structured config, typed as `AppoConfig`
    (attribute access, assignment type-checked).
    """
    cfg: DictConfig = OmegaConf.structured(AppoConfig)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise AppoError(f"config file not found: {path}")
        loaded = _load_yaml(path)
        if isinstance(loaded, ListConfig):
            raise AppoError(f"config file {path} must hold a mapping, not a list")
        cfg = _merge(cfg, loaded, f" (in {path})")
    if overrides:
        tried = [item.split("=", 1)[0] for item in overrides]
        cfg = _merge(cfg, _parse_overrides(overrides), "", tried)
    _validate(cfg)
    OmegaConf.set_readonly(cfg, False)
    return cfg  # type: ignore[return-value]


def to_yaml(cfg: AppoConfig) -> str:
    return OmegaConf.to_yaml(cfg)  # type: ignore[arg-type]


def to_container(cfg: Any) -> Any:
    """A plain dict/list copy of a config node (for logging and checkpoints)."""
    return OmegaConf.to_container(cfg, resolve=True)
