"""Reward routing by `data_source` / `ability`, and user reward functions loaded from a file.

Routing order (first hit wins):
1. a user function (`custom_reward_function.path` + `.name`, or a Python callable given as
   `custom_fn` / `RLTrainer(reward_fn=...)`) replaces routing entirely, as in verl;
2. `data_source` looked up in `DATA_SOURCE_ROUTES` (extendable per router);
3. `ability` looked up in `ABILITY_ROUTES` (`math` -> math, `qa` -> qa);
   A name registered by the user (`appo.register_reward`) routes as a built-in's does;
   `custom_reward_function.name=NAME` without a path makes the registered NAME replace
   routing;
4. otherwise an `AppoError` naming the data source and ability, raised by `resolve` so a
   trainer can check a whole dataset before the first rollout.

User functions take verl's parameters `(data_source, solution_str, ground_truth,
extra_info)` (only those declared are passed, by name, so the original ARPO
`compute_score(solution_str, ground_truth, extra_info)` files load as they are) or the form
`(completion, example)` (the response text and the row as a dict); the rule is
`appo.rewards.user_fn`. They return a float or a dict. A dict must hold `score`; `acc`/`accuracy` and `reason` are used when present,
other numeric entries become metrics. An exception inside the user function is recorded as
the reason with score 0 and counted in `RewardRouter.errors`; it does not end the run.
"""

from __future__ import annotations

import importlib.util
import logging
import numbers
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from appo.errors import AppoError
from appo.registry import REWARDS, qualified_name
from appo.rewards.base import RewardOutput
from appo.rewards.user_fn import FORMS_TEXT, RewardForm, call_arguments, reward_form

log = logging.getLogger(__name__)
DEFAULT_FUNCTION_NAME = "compute_score"  # custom_reward_function.name's default

RewardFn = Callable[..., RewardOutput]

# The registry of reward names (`appo.registry.REWARDS`): the built-ins below, registered
# there by reference, and a user's (`appo.register_reward`, a `--plugin` module), which
# take verl's parameters by name and are called as a custom function is.
REWARD_FNS = REWARDS

# The original trained everything (math and QA rows) under data_source "DR_grpo_mix" with
# the deep_research reward. Benchmarks are graded by what they are.
DATA_SOURCE_ROUTES: dict[str, str] = {
    "DR_grpo_mix": "deep_research",
    "synth_arith": "math",
    "synth_lookup": "qa",
    **dict.fromkeys(["gsm8k", "math500", "math", "aime24", "aime25", "amc23"], "math"),
    **dict.fromkeys(
        ["hotpotqa", "2wiki", "musique", "bamboogle", "nq", "triviaqa", "popqa", "simpleqa",
         "webwalker", "gaia", "hle", "xbench"],
        "qa",
    ),
}
ABILITY_ROUTES: dict[str, str] = {"math": "math", "qa": "qa"}


def load_custom_reward(path: str | Path, name: str = "compute_score") -> Callable[..., Any]:
    """Import `name` from the Python file at `path`."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise AppoError(f"custom_reward_function.path: file not found: {path}")
    module_name = f"appo_custom_reward_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise AppoError(f"custom_reward_function.path: cannot import {path} (not a .py file?)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any import-time failure is the user's file
        raise AppoError(
            f"custom_reward_function.path: importing {path} failed: {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AppoError(
            f"custom_reward_function.name: {path} has no function {name!r} "
            f"(functions there: {', '.join(found) or 'none'})"
        )
    return fn


def _check_callable(fn: Any) -> Callable[..., Any]:
    """A reward given as a Python object: callable, else one line (its form is checked by
    `reward_form`)."""
    if not callable(fn):
        raise AppoError(f"reward_fn: {type(fn).__name__} is not callable (give a function "
                        f"taking {FORMS_TEXT}, returning a float or a dict with 'score')")
    return fn


def _to_output(value: Any, source: str) -> RewardOutput:
    if isinstance(value, RewardOutput):
        return value
    if isinstance(value, numbers.Real):
        return RewardOutput(float(value), float(value), True, "", reward_fn=source)
    if isinstance(value, dict) and isinstance(value.get("score"), numbers.Real):
        score = float(value["score"])
        accuracy = value.get("acc", value.get("accuracy", score))
        metrics = {
            k: float(v) for k, v in value.items()
            if isinstance(v, numbers.Real) and not isinstance(v, bool) and k != "score"
        }
        return RewardOutput(
            score=score,
            accuracy=float(accuracy) if isinstance(accuracy, numbers.Real) else score,
            format_ok=bool(value.get("format_ok", True)),
            reason=str(value.get("reason", "")),
            answer=None if value.get("answer") is None else str(value["answer"]),
            reward_fn=source,
            metrics=metrics,
        )
    raise AppoError(
        f"reward function {source} returned {type(value).__name__}: expected a number or a "
        "dict with a numeric 'score'"
    )


class RewardRouter:
    """Callable `(data_source, solution_str, ground_truth, extra_info, ability) -> RewardOutput`.

    `routes` adds or overrides data_source -> reward-name entries; `reward_kwargs` passes
    keyword options to a built-in (e.g. `{"qa": {"metric": "em"}, "math": {"lenient":
    True}}`).
    """

    def __init__(
        self,
        custom_path: str | Path | None = None,
        custom_name: str = "compute_score",
        routes: dict[str, str] | None = None,
        reward_kwargs: dict[str, dict[str, Any]] | None = None,
        custom_fn: Callable[..., Any] | None = None,
        custom_label: str | None = None,
    ) -> None:
        self.routes = {**DATA_SOURCE_ROUTES, **(routes or {})}
        for source, name in self.routes.items():
            if name not in REWARD_FNS:
                raise AppoError(
                    f"reward route {source!r} -> {name!r}: unknown reward "
                    f"(choose from {', '.join(REWARD_FNS)})"
                )
        self.reward_kwargs = reward_kwargs or {}
        self.errors = 0
        self.custom: Callable[..., Any] | None = None
        self.custom_label = ""
        self._custom_form: RewardForm | None = None
        if custom_fn is not None and custom_path:
            raise AppoError("a reward function given in Python (reward_fn=) and "
                            f"custom_reward_function.path={custom_path}: give one")
        if custom_fn is not None:
            self.custom = _check_callable(custom_fn)
            self.custom_label = custom_label or f"custom:{qualified_name(custom_fn)}"
        elif custom_path:
            self.custom = load_custom_reward(custom_path, custom_name)
            self.custom_label = f"custom:{Path(custom_path).name}:{custom_name}"
        if self.custom is not None:
            self._custom_form = reward_form(self.custom, self.custom_label.removeprefix(
                "custom:"))

    def resolve(self, data_source: str, ability: str | None = None) -> str:
        """The reward name for a row; AppoError if neither data_source nor ability routes."""
        if self.custom is not None:
            return self.custom_label
        if data_source in self.routes:
            return self.routes[data_source]
        if data_source in REWARD_FNS:
            return data_source
        if ability in ABILITY_ROUTES:
            return ABILITY_ROUTES[ability]
        raise AppoError(
            f"no reward function for data_source {data_source!r} with ability {ability!r}: "
            f"set ability to one of {', '.join(ABILITY_ROUTES)}, name a reward "
            f"({', '.join(REWARD_FNS)}) as data_source, or set custom_reward_function.path"
        )

    def check(self, pairs: Iterable[tuple[str, str | None]]) -> dict[str, str]:
        """Resolve every distinct (data_source, ability) up front; returns pair-label -> reward."""
        return {f"{ds}/{ab}": self.resolve(ds, ab) for ds, ab in set(pairs)}

    def __call__(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: dict | None = None,
        ability: str | None = None,
    ) -> RewardOutput:
        if self.custom is not None:
            return self._call_user(self.custom, self.custom_label, self._custom_form,
                                   data_source, solution_str, ground_truth, extra_info, ability)
        name = self.resolve(data_source, ability)
        if not REWARDS.is_builtin(name):  # registered by the user: either form, by name
            fn = REWARDS[name]
            return self._call_user(fn, f"registered:{name}", reward_form(fn, name),
                                   data_source, solution_str, ground_truth, extra_info, ability)
        return REWARD_FNS[name](
            solution_str, ground_truth, extra_info, **self.reward_kwargs.get(name, {})
        )

    def _call_user(self, fn, label, form, data_source, solution_str, ground_truth,
                   extra_info, ability) -> RewardOutput:
        kwargs = call_arguments(form, data_source, solution_str, ground_truth, extra_info,
                                ability)
        try:
            value = fn(**kwargs)
        except Exception as e:  # noqa: BLE001 - a user function failing on one completion
            self.errors += 1
            if self.errors == 1:
                log.warning("custom reward %s raised %s: %s (scored 0; further errors counted)",
                            label, type(e).__name__, e)
            return RewardOutput(0.0, 0.0, False, f"reward function raised {type(e).__name__}: {e}",
                                reward_fn=label)
        return _to_output(value, label)


_DEFAULT_ROUTER: RewardRouter | None = None


def compute_reward(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    ability: str | None = None,
) -> RewardOutput:
    """Score one completion with the built-in reward its data_source / ability routes to."""
    global _DEFAULT_ROUTER
    if _DEFAULT_ROUTER is None:
        _DEFAULT_ROUTER = RewardRouter()
    return _DEFAULT_ROUTER(data_source, solution_str, ground_truth, extra_info, ability)


def router_from_config(cfg: Any, reward_fn: Callable[..., Any] | None = None) -> RewardRouter:
    """A router for an `AppoConfig` (uses `custom_reward_function.{path,name}`), or for a
    reward function given in Python (`reward_fn`, which replaces routing as a file does)."""
    custom = cfg.custom_reward_function
    # deep_research's format rule follows the call format (tools.format, docs §6.1).
    kwargs = ({"deep_research": {"call_format": str(cfg.tools.format)}}
              if cfg.tools.format != "tags" else None)
    label = None
    if reward_fn is None and not custom.path and custom.name != DEFAULT_FUNCTION_NAME:
        # custom_reward_function.name alone: a registered reward scores every row.
        reward_fn, label = _registered(custom.name, kwargs or {}), f"registered:{custom.name}"
    return RewardRouter(custom_path=custom.path, custom_name=custom.name, reward_kwargs=kwargs,
                        custom_fn=reward_fn, custom_label=label)


def _registered(name: str, reward_kwargs: dict[str, dict[str, Any]]) -> Callable[..., Any]:
    """The reward registered as `name`, callable with verl's parameters by name."""
    if name not in REWARDS:
        raise AppoError(f"custom_reward_function.name={name}: no reward function of that name "
                        f"is registered (registered: {', '.join(REWARDS)}); set "
                        "custom_reward_function.path to the file that defines it, or load "
                        "the module that registers it (--plugin)")
    fn = REWARDS[name]
    if not REWARDS.is_builtin(name):
        return fn
    options = reward_kwargs.get(name, {})

    def builtin(solution_str, ground_truth, extra_info):  # a built-in's positional form
        return fn(solution_str, ground_truth, extra_info, **options)

    return builtin
