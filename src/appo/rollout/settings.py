"""The rollout's parameters (`RolloutSettings`, read from `rollout.*`, `tools.*` and
`data.*` in one place) and the segment entropy measures of the branching rules
(docs/algorithms.md §2.2 arpo.2)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from appo.config import DataConfig, RolloutConfig, ToolsConfig
from appo.errors import AppoError
from appo.rollout.engine import SegmentOutput
from appo.rollout.sampling import SamplingParams

_R, _T, _D = RolloutConfig(), ToolsConfig(), DataConfig()  # the defaults' one source


@dataclass
class RolloutSettings:
    """Everything the loop and the strategies read: the rollout's parameters, taken from
    `rollout.*`, `tools.*` and `data.*` in one place (`from_config`), defaults included."""

    n: int = _R.n
    initial_rollouts: int = _R.initial_rollouts
    beam_size: int = _R.beam_size
    branch_probability: float = _R.branch_probability
    entropy_weight: float = _R.entropy_weight
    entropy_window: int = _R.entropy_window
    entropy_measure: str = _R.entropy_measure
    sampling: SamplingParams = field(default_factory=SamplingParams)
    result_template: str = _R.result_template
    call_format: str = _T.format  # tools.format (appo.tools.formats)
    on_limit: str = _R.on_limit
    call_limit: int = _T.call_limit
    # Per-tool call limits on top of `call_limit` (`eval.tool_call_limits`); None: none.
    tool_call_limits: dict[str, int] | None = None
    max_response_length: int = _D.max_response_length
    max_prompt_length: int | None = None
    # aepo
    enable_dynamic_rollouts: bool = _R.enable_dynamic_rollouts
    initial_entropy_tokens: int = _R.initial_entropy_tokens
    beta: float = _R.beta
    branch_penalty: float = _R.branch_penalty
    reuse_premonitor: bool = _R.reuse_premonitor
    # appo
    appo_gamma: float = _R.appo_gamma
    future_value_clip: float = _R.future_value_clip
    appo_skip_punctuation: bool = _R.appo_skip_punctuation
    # appo: a row whose |logp_current - logp_rollout| stay within this is on-policy up to
    # recompute noise: rank by entropy. None: by the scoring model's dtype
    # (`appo.rollout.scoring.LR_NOISE_TOL`).
    lr_noise_tol: float | None = _R.lr_noise_tol
    seed: int = _R.seed

    def __post_init__(self) -> None:
        if self.on_limit not in ("stop", "notify"):
            raise AppoError(f"rollout.on_limit must be stop or notify, got {self.on_limit!r}")
        if self.entropy_measure not in ENTROPY_MEASURES:
            raise AppoError(
                f"rollout.entropy_measure must be one of {', '.join(ENTROPY_MEASURES)}, "
                f"got {self.entropy_measure!r}"
            )
        from appo.tools.formats import CALL_FORMATS

        if self.call_format not in CALL_FORMATS:
            raise AppoError(f"tools.format must be one of {', '.join(CALL_FORMATS)}, "
                            f"got {self.call_format!r}")
        if "{text}" not in self.result_template:
            raise AppoError("rollout.result_template must contain {text}")
        if self.n < 1 or self.initial_rollouts < 1 or self.beam_size < 1:
            raise AppoError("rollout.n, rollout.initial_rollouts and rollout.beam_size must be >= 1")
        if self.max_response_length < 1:
            raise AppoError("data.max_response_length must be >= 1")

    @property
    def initial(self) -> int:
        """`initial_rollouts` clamped to `n`."""
        return min(self.initial_rollouts, self.n)

    @classmethod
    def from_config(cls, cfg: Any, **overrides: Any) -> RolloutSettings:
        r = cfg.rollout
        values = dict(
            n=int(r.n),
            initial_rollouts=int(r.initial_rollouts),
            beam_size=int(r.beam_size),
            branch_probability=float(r.branch_probability),
            entropy_weight=float(r.entropy_weight),
            entropy_window=int(r.entropy_window),
            entropy_measure=str(r.entropy_measure),
            sampling=SamplingParams.from_config(r),
            result_template=str(r.result_template),
            call_format=str(cfg.tools.format),
            on_limit=str(r.on_limit),
            call_limit=int(cfg.tools.call_limit),
            max_response_length=int(cfg.data.max_response_length),
            max_prompt_length=int(cfg.data.max_prompt_length),
            enable_dynamic_rollouts=bool(r.enable_dynamic_rollouts),
            initial_entropy_tokens=int(r.initial_entropy_tokens),
            beta=float(r.beta),
            branch_penalty=float(r.branch_penalty),
            reuse_premonitor=bool(r.reuse_premonitor),
            appo_gamma=float(r.appo_gamma),
            future_value_clip=float(r.future_value_clip),
            appo_skip_punctuation=bool(r.appo_skip_punctuation),
            lr_noise_tol=None if r.lr_noise_tol is None else float(r.lr_noise_tol),
            seed=int(r.seed),
        )
        values.update(overrides)
        return cls(**values)


# ------------------------------------------------- segment entropy (docs/algorithms.md §2.2 arpo.2)
def _mean_entropy(out: SegmentOutput, window: int, vocab_size: int) -> float:
    values = out.entropies[:window]
    return float(sum(values) / len(values)) if values else 0.0


def _seed_topk_sum(out: SegmentOutput, window: int, vocab_size: int) -> float:
    # The original: top-10 `-p log p` summed over the window's tokens, divided by log |V|.
    values = out.topk_entropies[:window]
    return float(sum(values) / math.log(vocab_size)) if values else 0.0


ENTROPY_MEASURES = {"mean": _mean_entropy, "seed_topk_sum": _seed_topk_sum}


def segment_entropy(out: SegmentOutput, settings: RolloutSettings, vocab_size: int) -> float:
    """`H_seg`: entropy over the first `entropy_window` tokens of a model segment."""
    return ENTROPY_MEASURES[settings.entropy_measure](out, settings.entropy_window, vocab_size)
