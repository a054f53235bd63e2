"""Name -> implementation registries that config validation consults (rollout strategies,
reward functions, advantage estimators, policy losses).

A config key that selects an implementation by name (`rollout.strategy`) is valid when the
name is registered here, so a user's strategy registered at run time
(`appo.register_strategy`, or a module loaded with `appo train --plugin`) passes validation
exactly as a built-in does. There is one list of names per key: this registry.

Built-ins register the same way as user code, by name, but as a `"module:attribute"`
reference resolved on first use: loading a config must not import torch (the strategies'
modules do), and `appo --help` stays fast. User entries are the objects themselves.

The pure-torch layer (`appo.algos`) may import nothing of appo's but its errors, so it keeps
its own lookup tables (`appo.algos.ADV_ESTIMATORS`, `appo.algos.POLICY_LOSSES`, the
built-ins) and the trainer reads those: a registry with a `table` writes each user entry
into that table as well (and removes it on `unregister`), so both always hold the same names
(a test checks). Writing the table imports its module, i.e. torch, when a user registers an
estimator or a loss, which is torch code anyway.

Rules: a built-in name cannot be taken (one line naming the built-ins); a user name may be
registered again by an object of the same qualified name (a module imported twice), not by
a different one.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from appo.errors import AppoError


def qualified_name(obj: Any) -> str:
    """`module.qualname` of a function or class; of an instance, its class's plus `()`."""
    target = obj if hasattr(obj, "__qualname__") else type(obj)
    module = getattr(target, "__module__", None) or "?"
    name = f"{module}.{target.__qualname__}"
    return name if target is obj else name + "()"


class Registry(Mapping[str, Any]):
    """Names of one kind (`what`, e.g. "rollout strategy") for the config key `key`.

    A `Mapping`: `names in registry`, `list(registry)` (built-ins first, then user entries in
    registration order), `registry[name]` (the implementation, a built-in imported on first
    use)."""

    def __init__(self, what: str, key: str, builtins: dict[str, str],
                 table: str | None = None) -> None:
        self.what = what
        self.key = key
        self._builtins = dict(builtins)
        self._entries: dict[str, Any] = dict(builtins)
        self._table = table  # "module:attr" of a dict that receives the user entries too

    # ------------------------------------------------------------ Mapping
    def __getitem__(self, name: str) -> Any:
        entry = self._entries[name]
        if isinstance(entry, str) and name in self._builtins:
            entry = _resolve(entry)
            self._entries[name] = entry
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------ use
    def get_checked(self, name: str) -> Any:
        """The implementation of `name`; an unknown name is one line with the choices."""
        if name not in self._entries:
            raise AppoError(f"unknown {self.what} {name!r} (choose from {', '.join(self)})")
        return self[name]

    def is_builtin(self, name: str) -> bool:
        return name in self._builtins

    def name_of(self, obj: Any) -> str | None:
        """The name `obj` is registered under (a built-in already imported counts)."""
        for name in self._entries:
            if self[name] is obj:
                return name
        return None

    def register(self, name: str, obj: Any) -> Any:
        """Make `obj` usable as `<key>=name`; returns `obj` (so it works as a decorator's
        body). Refused with one line: a name that is no identifier-like word, a built-in's
        name, or a name another object already holds."""
        if not isinstance(name, str) or not name.strip() or any(c in name for c in " =,\n"):
            raise AppoError(f"register a {self.what}: bad name {name!r} (a word such as "
                            "'my_strategy')")
        if not callable(obj):
            raise AppoError(f"register a {self.what} {name!r}: {type(obj).__name__} is not "
                            "callable")
        if name in self._builtins:
            raise AppoError(f"register a {self.what} {name!r}: that is a built-in's name "
                            f"(built-ins: {', '.join(self._builtins)}); choose another")
        old = self._entries.get(name)
        if old is not None and old is not obj and qualified_name(old) != qualified_name(obj):
            raise AppoError(f"register a {self.what} {name!r}: already registered as "
                            f"{qualified_name(old)}; choose another name")
        self._entries[name] = obj
        if self._table is not None:
            _resolve(self._table)[name] = obj
        return obj

    def unregister(self, name: str) -> None:
        """Remove a user entry (tests, notebooks); built-ins stay."""
        if name in self._builtins:
            raise AppoError(f"cannot unregister the built-in {self.what} {name!r}")
        if self._entries.pop(name, None) is not None and self._table is not None:
            _resolve(self._table).pop(name, None)


def _resolve(reference: str) -> Any:
    """The object a `"module:attribute"` reference names (its module imported)."""
    module, _, attr = reference.partition(":")
    return getattr(importlib.import_module(module), attr)


class Names:
    """A live, read-only view of a registry's names: what `CHOICES[key]` holds for a key a
    registry serves, so validation and the reference read the registry itself. Compares
    equal to a tuple of the same names."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._registry))

    def __contains__(self, name: object) -> bool:
        return name in self._registry

    def __len__(self) -> int:
        return len(self._registry)

    def __getitem__(self, i: int) -> str:
        return tuple(self._registry)[i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Names | tuple | list):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable: not a dict key

    def __repr__(self) -> str:
        return repr(tuple(self))


STRATEGIES = Registry("rollout strategy", "rollout.strategy", {
    "grpo": "appo.rollout.strategies:rollout_grpo",
    "arpo": "appo.rollout.strategies:rollout_arpo",
    "aepo": "appo.rollout.strategies:rollout_aepo",
    "appo": "appo.rollout.strategies:rollout_appo",
})


def register_strategy(name: str, strategy: Any = None) -> Any:
    """Register a rollout strategy as `rollout.strategy=name`.

    `strategy` has the signature of `appo.rollout.strategies.Strategy`:
    `(prompts, engine, tools, settings, rng=None, score_fn=None) -> RolloutBatch`. Without
    it, a decorator: `@register_strategy("fixed")`."""
    if strategy is None:
        return lambda fn: STRATEGIES.register(name, fn)
    return STRATEGIES.register(name, strategy)


def get_strategy(name: str) -> Any:
    """The strategy registered as `name` (built-ins included); unknown: one line."""
    return STRATEGIES.get_checked(name)


REWARDS = Registry("reward function", "custom_reward_function.name", {
    "deep_research": "appo.rewards.deep_research:deep_research_reward",
    "math": "appo.rewards.math_reward:math_reward",
    "qa": "appo.rewards.qa_reward:qa_reward",
})


def register_reward(name: str, fn: Any = None) -> Any:
    """Register a reward function as `name`: rows whose `data_source` is `name` are scored
    by it, and `custom_reward_function.name=name` (with no `.path`) scores every row by it.

    `fn` takes verl's `compute_score` parameters by name (`data_source, solution_str,
    ground_truth, extra_info`; only those it declares) or `(completion, example)`
    (`appo.rewards.user_fn`; another form is refused here) and returns a number or a dict
    with `score`. Without it, a decorator: `@register_reward("exact")`."""
    if fn is None:
        return lambda f: register_reward(name, f)
    if callable(fn):
        from appo.rewards.user_fn import reward_form

        reward_form(fn, f"{name!r} ({qualified_name(fn)})")
    return REWARDS.register(name, fn)


ADV_ESTIMATORS = Registry("advantage estimator", "algorithm.adv_estimator", {
    name: f"appo.algos.advantages:{name}_advantage"
    for name in ("grpo", "rloo", "reinforce_plus_plus", "appo", "gae")
}, table="appo.algos.advantages:ADV_ESTIMATORS")


def register_advantage(name: str, fn: Any = None) -> Any:
    """Register an advantage estimator as `algorithm.adv_estimator=name`.

    `fn(scores, response_mask, groups, *, params, tree=None, values=None) -> (advantages,
    metrics)`: `scores` `[B]`, `response_mask` `[B, R]`, `groups` the B group ids,
    `params` an `appo.algos.AdvantageParams`; advantages `[B, R]`, metrics a dict of floats
    (logged under `adv/`). Without `fn`, a decorator: `@register_advantage("mine")`."""
    if fn is None:
        return lambda f: ADV_ESTIMATORS.register(name, f)
    return ADV_ESTIMATORS.register(name, fn)


def get_advantage(name: str) -> Any:
    """The advantage estimator registered as `name` (built-ins included); unknown: one line."""
    return ADV_ESTIMATORS.get_checked(name)


POLICY_LOSSES = Registry("policy loss", "actor.policy_loss", {
    name: f"appo.algos.policy_losses:{name}_policy_loss"
    for name in ("vanilla", "entropy_balanced", "future_kl")
}, table="appo.algos.policy_losses:POLICY_LOSSES")


def register_policy_loss(name: str, fn: Any = None) -> Any:
    """Register a policy loss as `actor.policy_loss=name`.

    `fn(logp, old_logp, advantages, loss_mask, *, agg, params, entropy=None) -> (loss,
    metrics)` (`appo.algos.policy_losses.PolicyLossFn`): per-token `[B, R]` tensors, `agg`
    the `appo.algos.LossAgg` that normalises the sum, `params` an
    `appo.algos.PolicyLossParams`; a scalar loss, metrics a dict of floats (logged under
    `actor/`). Without `fn`, a decorator: `@register_policy_loss("mine")`."""
    if fn is None:
        return lambda f: POLICY_LOSSES.register(name, f)
    return POLICY_LOSSES.register(name, fn)


def get_policy_loss(name: str) -> Any:
    """The policy loss registered as `name` (built-ins included); unknown: one line."""
    return POLICY_LOSSES.get_checked(name)
