"""The allowed range of every numeric config key, as one table (`RANGES`), and the check that
`appo.config.load_config` runs over the whole loaded config with it.

Every float is finite unless its range says `inf_ok` (NaN never passes); a null value of an
optional key (`int | None`) means "unset" and is not checked. A key without an entry here
only gets the finite check; `tests/test_config_validation.py` fails for a numeric key of the
schema without an entry, so a new key must state its range. `*` in a key stands for any
entry of a mapping (`eval.tool_call_limits.*`) or item of a list (`actor.optim.betas.*`).

Kept free of OmegaConf and torch: the search tool's `pages` parameters are checked with the
same `Range` (`appo.tools.page_step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

from appo.errors import AppoError


@dataclass(frozen=True)
class Range:
    """lo <= value <= hi (`lo_open` / `hi_open`: strict); `inf_ok`: +inf is allowed (and
    means what `note` says); `note`: shown after the range in the error."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    inf_ok: bool = False
    note: str = ""

    def describe(self) -> str:
        if self.lo is not None and self.hi is not None:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            text = f"must be in {left}{self.lo:g}, {self.hi:g}{right}"
        elif self.lo is not None:
            text = f"must be {'>' if self.lo_open else '>='} {self.lo:g}"
        elif self.hi is not None:
            text = f"must be {'<' if self.hi_open else '<='} {self.hi:g}"
        else:
            text = "must be a finite number"
        return f"{text}; {self.note}" if self.note else text

    def allows(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if math.isinf(value) and not (self.inf_ok and value > 0):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))


def at_least(lo: float, note: str = "", inf_ok: bool = False) -> Range:
    return Range(lo=lo, note=note, inf_ok=inf_ok)


def above(lo: float, note: str = "", inf_ok: bool = False) -> Range:
    return Range(lo=lo, lo_open=True, note=note, inf_ok=inf_ok)


def within(lo: float, hi: float, note: str = "", lo_open: bool = False,
           hi_open: bool = False) -> Range:
    return Range(lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, note=note)


FINITE = Range()
COUNT = at_least(1)  # a count where 0 would do nothing (or divide by zero)
ANY_COUNT = at_least(0)
PROB = within(0.0, 1.0)
SEED = at_least(0)
# Above 1e30, AdamW's float32 step (lr / (1 - beta1^t)) overflows inside torch.
LR = within(0.0, 1e30, "0 keeps the weights fixed")
CLIP = above(0.0, "inf: no clipping", inf_ok=True)
FREQ = at_least(-1, "-1 or 0: off")
# a save frequency of -1 or 0 still saves once, at the end of the run
SAVE_FREQ = at_least(-1, "-1 or 0: only at the end")
GB = above(0.0, "or null")
TOP_K = at_least(-1, "-1 or 0: off")
TEMPERATURE = at_least(0.0, "0 is greedy")

_OPTIM = {
    "lr": LR,
    "weight_decay": at_least(0.0),
    "betas.*": within(0.0, 1.0, hi_open=True),
    "lr_warmup_steps_ratio": PROB,
}

RANGES: dict[str, Range] = {
    # model
    "model.lora_rank": at_least(0, "0: full fine-tuning"),
    "model.lora_alpha": above(0.0),
    "model.lora_dropout": within(0.0, 1.0, hi_open=True),
    # data
    "data.train_batch_size": COUNT,
    "data.val_batch_size": COUNT,
    "data.max_prompt_length": COUNT,
    "data.max_response_length": COUNT,
    "data.seed": SEED,
    # rollout
    "rollout.n": COUNT,
    "rollout.initial_rollouts": COUNT,
    "rollout.beam_size": COUNT,
    "rollout.branch_probability": PROB,
    "rollout.entropy_weight": at_least(0.0),
    "rollout.entropy_window": COUNT,
    "rollout.temperature": TEMPERATURE,
    "rollout.top_p": PROB,
    "rollout.top_k": TOP_K,
    "rollout.repetition_penalty": above(0.0),
    "rollout.initial_entropy_tokens": COUNT,
    "rollout.beta": at_least(0.0),
    "rollout.branch_penalty": at_least(0.0),
    "rollout.appo_gamma": PROB,
    "rollout.future_value_clip": at_least(0.0),
    "rollout.lr_noise_tol": at_least(0.0),
    "rollout.gpu_memory_utilization": within(0.0, 1.0, lo_open=True),
    "rollout.kv_cache_gib": GB,
    "rollout.tensor_model_parallel_size": COUNT,
    "rollout.seed": SEED,
    # tools
    "tools.call_limit": ANY_COUNT,
    "tools.max_workers": COUNT,
    "tools.timeout": above(0.0, "seconds"),
    "tools.retry_count": ANY_COUNT,
    "tools.infra_failure_limit": COUNT,
    # algorithm
    "algorithm.reward_scale_discount": PROB,
    "algorithm.gamma": PROB,
    "algorithm.lam": PROB,
    # actor
    "actor.clip_ratio_low": within(0.0, 1.0, lo_open=True),
    "actor.clip_ratio_high": above(0.0),
    "actor.clip_ratio_c": above(1.0, "the dual-clip bound"),
    "actor.entropy_coeff": at_least(0.0),
    "actor.kl_loss_coef": at_least(0.0),
    "actor.entropy_advantage_alpha": at_least(0.0),
    "actor.future_kl_decay_rate": above(0.0),
    "actor.future_kl_clip_high": above(0.0),
    "actor.future_kl_safety_thresh": above(0.0),
    "actor.future_kl_coef": at_least(0.0),
    "actor.ppo_epochs": COUNT,
    "actor.ppo_mini_batch_size": COUNT,
    "actor.ppo_max_token_len_per_device": COUNT,
    "actor.max_memory_gb": GB,
    "actor.activation_memory_gb": GB,
    "actor.logprob_chunk_size": COUNT,
    "actor.grad_clip": CLIP,
    **{f"actor.optim.{k}": r for k, r in _OPTIM.items()},
    # critic
    **{f"critic.optim.{k}": r for k, r in _OPTIM.items()},
    "critic.cliprange_value": above(0.0),
    "critic.ppo_epochs": COUNT,
    "critic.ppo_mini_batch_size": COUNT,
    "critic.ppo_max_token_len_per_device": COUNT,
    "critic.grad_clip": CLIP,
    # trainer
    "trainer.total_epochs": at_least(1, "a run of no steps trains nothing"),
    "trainer.total_steps": at_least(1, "a run of no steps trains nothing"),
    "trainer.save_freq": SAVE_FREQ,
    "trainer.test_freq": FREQ,
    "trainer.mmap_threshold_kb": at_least(0),
    "trainer.seed": SEED,
    # sft
    "sft.max_length": COUNT,
    "sft.epochs": at_least(1, "0 trains nothing"),
    "sft.batch_size": COUNT,
    "sft.gradient_accumulation_steps": COUNT,
    "sft.lr": LR,
    "sft.weight_decay": at_least(0.0),
    "sft.warmup_ratio": PROB,
    "sft.grad_clip": CLIP,
    "sft.save_freq": SAVE_FREQ,
    "sft.max_steps": at_least(1, "0 trains nothing; null: all epochs"),
    "sft.max_tokens_per_micro_batch": COUNT,
    # eval
    "eval.k": COUNT,
    "eval.temperature": TEMPERATURE,
    "eval.top_p": PROB,
    "eval.top_k": TOP_K,
    "eval.repetition_penalty": above(0.0),
    "eval.max_response_length": COUNT,
    "eval.tool_call_limits.*": ANY_COUNT,
}


def range_for(key: str) -> Range | None:
    """The key's entry, or its pattern's (the last part as `*`)."""
    if key in RANGES:
        return RANGES[key]
    head, _, _ = key.rpartition(".")
    return RANGES.get(f"{head}.*") if head else None


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_value(key: str, value: Any, rng: Range | None = None, where: str = "") -> None:
    """One `AppoError` line naming the key when `value` (a number) is out of its range."""
    if not is_number(value):
        return
    rng = rng if rng is not None else (range_for(key) or FINITE)
    if not rng.allows(float(value)):
        raise AppoError(f"bad value for config key {key!r}{where}: {value!r} "
                        f"({rng.describe()})")


def check_dataclass(obj: Any, table: dict[str, Range], prefix: str) -> None:
    """`check_value` on every numeric field of a dataclass (nested ones too) against `table`
    (field name -> range; nested fields as `inner.field`); floats without an entry must be
    finite. `prefix` names the section in the error (`search pages.`)."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value):
            inner = {k.split(".", 1)[1]: r for k, r in table.items()
                     if k.startswith(f.name + ".")}
            check_dataclass(value, inner, f"{prefix}{f.name}.")
        else:
            check_value(f"{prefix}{f.name}", value, table.get(f.name))
