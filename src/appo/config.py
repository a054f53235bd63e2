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

import copy
import difflib
import functools
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from appo.config_ranges import check_value
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
    FSDPOffloadConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
    SFTConfig,
    ToolInstanceConfig,
    ToolsConfig,
    TrainerConfig,
)
from appo.config_verl import translate_verl_keys
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


def unknown_key_error(key: str) -> AppoError:
    """The error for a key the schema lacks, with the nearest valid keys."""
    return _unknown_key_error(key, OmegaConf.structured(AppoConfig))


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


def _short(value: Any, limit: int = 60) -> str:
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    import yaml

    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise AppoError(f"bad override {item!r}: expected key=value, e.g. rollout.n=16")
        try:  # one at a time: the error names the override it is about
            OmegaConf.from_dotlist([item])
        except yaml.YAMLError as e:
            what = " ".join(filter(None, [getattr(e, "context", None),
                                          getattr(e, "problem", None)])) or str(e)
            raise AppoError(f"bad override {item!r}: cannot parse its value "
                            f"({what.splitlines()[0]})") from None
        except OmegaConfBaseException as e:
            raise AppoError(f"bad override {item!r}: {str(e).splitlines()[0]}") from None
    return OmegaConf.from_dotlist(list(overrides))


def _resolve(cfg: DictConfig) -> None:
    """Interpolations (`${data.seed}`, `${oc.env:VAR}`) resolved once, in place: a missing or
    recursive one is one line naming the key."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        detail = (str(e) or type(e).__name__).splitlines()[0]
        detail = _short(detail.replace("KeyError raised while resolving interpolation: ", ""),
                        160)
        key = f" for config key {e.full_key!r}" if e.full_key else ""
        raise AppoError(f"bad interpolation{key}: {detail}") from None


def _numbers(node: Any, prefix: str = ""):
    """(dotted key, value) of every number in the config; list items as `key.INDEX`."""
    if isinstance(node, DictConfig):
        items = [(k, node._get_node(k)) for k in node.keys()]
    elif isinstance(node, ListConfig):
        items = [(i, node._get_node(i)) for i in range(len(node))]
    else:
        return
    for key, child in items:
        if isinstance(child, (DictConfig, ListConfig)):
            yield from _numbers(child, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", child._value()


def _check_ranges(cfg: DictConfig) -> None:
    """Every number against its range in `appo.config_ranges.RANGES` (floats: finite)."""
    for key, value in _numbers(cfg):
        if key.startswith("tools.tool_instances."):
            continue  # a tool's own parameters: the tool checks them
        check_value(key, value)


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
    _check_ranges(cfg)  # type, finite, range: one table (appo.config_ranges)
    if cfg.algorithm.adv_estimator == "appo" and cfg.rollout.strategy != "appo":
        # APPO's credit mapping treats every row with a parent as an untrained branch; arpo /
        # aepo branches are trained rows, so they would silently get no advantage.
        raise AppoError(
            f"algorithm.adv_estimator=appo needs rollout.strategy=appo (got "
            f"{cfg.rollout.strategy!r}); use grpo, rloo or reinforce_plus_plus with it"
        )
    if cfg.trainer.sharded_checkpoint and cfg.model.lora_rank:
        raise AppoError("trainer.sharded_checkpoint=true with model.lora_rank > 0: a LoRA "
                        "checkpoint holds only the adapter, which is small and saved whole; "
                        "drop trainer.sharded_checkpoint")
    if cfg.trainer.overwrite and cfg.trainer.resume:
        raise AppoError("trainer.overwrite=true and trainer.resume=true: resume continues the "
                        "run in trainer.default_local_dir, overwrite deletes it; give one")
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


@functools.cache
def _defaults() -> DictConfig:
    """The schema's defaults as a structured config, built once per process: building it
    (`OmegaConf.structured`) was most of a `load_config`, which the CLI, the compare runner
    and the tests call many times. The schema's defaults are static (no registry feeds
    them), so one copy serves every load; callers only ever get copies of it."""
    return OmegaConf.structured(AppoConfig)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> AppoConfig:
    """Defaults <- YAML file (optional) <- dotted overrides; validated; returned as AppoConfig.

    The returned object is an OmegaConf structured config, typed as `AppoConfig`
    (attribute access, assignment type-checked).
    """
    cfg = _defaults()  # never modified here: each merge below returns a new config
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise AppoError(f"config file not found: {path}")
        loaded = _load_yaml(path)
        if isinstance(loaded, ListConfig):
            raise AppoError(f"config file {path} must hold a mapping, not a list")
        where = f" (in {path})"
        cfg = _merge(cfg, translate_verl_keys(loaded, where), where)
    if overrides:
        tried = [item.split("=", 1)[0] for item in overrides]
        cfg = _merge(cfg, translate_verl_keys(_parse_overrides(overrides)), "", tried)
    if cfg is _defaults():
        cfg = copy.deepcopy(cfg)
    _resolve(cfg)
    _validate(cfg)
    OmegaConf.set_readonly(cfg, False)
    return cfg  # type: ignore[return-value]


def to_yaml(cfg: AppoConfig) -> str:
    return OmegaConf.to_yaml(cfg)  # type: ignore[arg-type]


def to_container(cfg: Any) -> Any:
    """A plain dict/list copy of a config node (for logging and checkpoints)."""
    return OmegaConf.to_container(cfg, resolve=True)


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A plain nested dict (`to_container`'s) as `{"a.b.c": value}`; lists stay values."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}
