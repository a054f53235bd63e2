"""Clipped policy-gradient losses: PPO dual-clip, AEPO entropy-balanced clip, APPO/FIPO future-KL.

One calling convention for all, so the trainer picks one from `POLICY_LOSSES` by
`actor.policy_loss`:

    loss, metrics = POLICY_LOSSES[name](logp, old_logp, advantages, loss_mask,
                                        agg=agg, params=params, entropy=entropy)

- logp `[B, T]`: current policy log-probs of the sampled tokens (carries the gradient).
- old_logp `[B, T]`: log-probs of the policy that collected the batch (no gradient).
- advantages `[B, T]`; loss_mask `[B, T]` (1 = a sampled token that is trained on).
- agg: `LossAgg` with the mini-batch's global normalisers (see `aggregation`).
- params: `PolicyLossParams` (scalars from `actor.*`).
- entropy `[B, T]` (optional): current-policy token entropy, read only by
  `entropy_balanced` with `entropy_clip_scope=high_entropy`; entropy_stats optionally gives
  mini-batch entropy statistics for its threshold (else the given micro-batch's).
- Returns this micro-batch's share of the mini-batch loss (0-dim tensor) and metrics whose
  values are likewise shares of mini-batch token means: sum both over micro-batches.

Ratio `r = exp(clamp(logp - old_logp, -20, 20))`; clip range `[1 - eps_low, 1 + eps_high]`
(clip-higher of DAPO, 2503.14476); dual-clip `c` (Ye et al. 2019, 1912.09729) bounds the loss
of negative-advantage tokens at `-A c`.

- `vanilla`: `max(-A r, -A clip(r))`, then `min(., -A c)` where `A < 0`.
- `entropy_balanced` (AEPO, 2510.14545): the upper clip bound is `(1 + eps_high) r / sg(r)`,
  equal in value to `1 + eps_high` but with gradient: a token clipped at the top is not
  silenced but gets `(1 + eps_high) (-A) grad log pi`. The value is exactly `vanilla`'s.
  `entropy_clip_scope=all` (AEPO) applies it to every token; `high_entropy` only to tokens
  whose entropy is above the mean valid-token entropy (clipped high-entropy tokens are the
  exploratory forks AEPO wants to keep learning from; low-entropy ones stay silenced).
- `future_kl` (APPO, after FIPO): each token's advantage is re-weighted by how far the
  policy has already moved on the tokens that follow it. `d_k = clamp(logp - old, -20, 20)`;
  tokens with `d_k > ln c` are left out (`P_k`); `FutureKL_t = sum_{k>=t} g^(k-t) P_k d_k
  mask_k` with `g = 2^(-1/decay_rate)` (half-life `decay_rate` tokens);
  `f = sg(clamp(exp(FutureKL), lo, clip_high))` with `lo = 1` if `clip_high_only` else
  `2 - clip_high`; where `A < 0` and `r > safety_thresh`, `f` is clamped to [0.8, 1];
  `A' = A (1 + coef f)` (docs/algorithms.md §4.3; FIPO itself uses `A f`), then the
  dual-clip loss on `A'`. Sequence filter (the original's, `future_kl_seq_filter`, on by
  default): a row with more than one dual-clip hit (`A < 0` and the clipped loss above
  `-A' c`) leaves the loss; the caller's `agg` must count only the kept rows
  (`future_kl_kept_rows`), as the original's normaliser does.
  The APPO runs used eps 0.2 / 0.28 (`actor.clip_ratio_high=0.28`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from appo.algos.aggregation import LossAgg, MaskedStats, aggregate, token_share
from appo.errors import AppoError

__all__ = [
    "POLICY_LOSSES",
    "PolicyLossFn",
    "PolicyLossParams",
    "discounted_future_sum",
    "entropy_balanced_policy_loss",
    "future_kl_kept_rows",
    "future_kl_policy_loss",
    "vanilla_policy_loss",
]

ENTROPY_CLIP_SCOPES = ("all", "high_entropy")


@dataclass(frozen=True)
class PolicyLossParams:
    """Scalars the losses read; each field names its config key."""

    clip_low: float = 0.2  # actor.clip_ratio_low
    clip_high: float = 0.2  # actor.clip_ratio_high
    clip_c: float = 3.0  # actor.clip_ratio_c
    entropy_clip_scope: str = "all"  # actor.entropy_clip_scope
    future_kl_decay_rate: float = 64.0  # actor.future_kl_decay_rate
    future_kl_clip_high: float = 1.2  # actor.future_kl_clip_high
    future_kl_clip_high_only: bool = True  # actor.future_kl_clip_high_only
    future_kl_safety_thresh: float = 6.0  # actor.future_kl_safety_thresh
    future_kl_coef: float = 1.0  # actor.future_kl_coef
    future_kl_seq_filter: bool = True  # actor.future_kl_seq_filter

    def __post_init__(self) -> None:
        checks = [
            (0.0 <= self.clip_low < 1.0, "actor.clip_ratio_low", self.clip_low, "in [0, 1)"),
            (self.clip_high >= 0.0, "actor.clip_ratio_high", self.clip_high, ">= 0"),
            (self.clip_c > 1.0, "actor.clip_ratio_c", self.clip_c, "> 1"),
            (self.entropy_clip_scope in ENTROPY_CLIP_SCOPES, "actor.entropy_clip_scope",
             self.entropy_clip_scope, f"one of {', '.join(ENTROPY_CLIP_SCOPES)}"),
            (self.future_kl_decay_rate > 0.0, "actor.future_kl_decay_rate",
             self.future_kl_decay_rate, "> 0"),
            (1.0 <= self.future_kl_clip_high < 2.0, "actor.future_kl_clip_high",
             self.future_kl_clip_high, "in [1, 2)"),
            (self.future_kl_safety_thresh > 0.0, "actor.future_kl_safety_thresh",
             self.future_kl_safety_thresh, "> 0"),
            (self.future_kl_coef >= 0.0, "actor.future_kl_coef", self.future_kl_coef, ">= 0"),
        ]
        for ok, key, value, rule in checks:
            if not ok:
                raise AppoError(f"bad value for config key {key!r}: {value!r} (must be {rule})")


class PolicyLossFn(Protocol):
    def __call__(
        self,
        logp: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        loss_mask: Tensor,
        *,
        agg: LossAgg,
        params: PolicyLossParams = ...,
        entropy: Tensor | None = ...,
        entropy_stats: MaskedStats | None = ...,
    ) -> tuple[Tensor, dict[str, float]]: ...


def _check(logp: Tensor, old_logp: Tensor, advantages: Tensor, loss_mask: Tensor) -> None:
    shapes = {tuple(t.shape) for t in (logp, old_logp, advantages, loss_mask)}
    if len(shapes) != 1 or logp.dim() != 2:
        raise AppoError(
            "logp, old_logp, advantages and loss_mask must all be [B, T]; got "
            + ", ".join(str(tuple(t.shape)) for t in (logp, old_logp, advantages, loss_mask))
        )


def _dual_clip(
    ratio: Tensor, clipped_ratio: Tensor, advantages: Tensor, clip_c: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token dual-clip PPO loss and the masks of tokens hit by the clip / the dual clip."""
    unclipped = -advantages * ratio
    clipped = -advantages * clipped_ratio
    loss = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_c
    negative = advantages < 0
    dual_hit = negative & (loss > dual_bound)
    loss = torch.where(negative, torch.minimum(loss, dual_bound), loss)
    return loss, clipped > unclipped, dual_hit


def _ppo_metrics(
    log_ratio: Tensor, clip_hit: Tensor, dual_hit: Tensor, loss_mask: Tensor, agg: LossAgg
) -> dict[str, float]:
    return {
        "pg_clipfrac": token_share(clip_hit.float(), loss_mask, agg),
        "pg_clipfrac_lower": token_share(dual_hit.float(), loss_mask, agg),
        "ppo_kl": token_share(-log_ratio, loss_mask, agg),
    }


def vanilla_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    agg: LossAgg,
    params: PolicyLossParams = PolicyLossParams(),
    entropy: Tensor | None = None,
    entropy_stats: MaskedStats | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clip (separate low/high) with dual-clip for `A < 0`. All tensors `[B, T]`."""
    _check(logp, old_logp, advantages, loss_mask)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1.0 - params.clip_low, 1.0 + params.clip_high)
    loss, clip_hit, dual_hit = _dual_clip(ratio, clipped_ratio, advantages, params.clip_c)
    return aggregate(loss, loss_mask, agg), _ppo_metrics(log_ratio, clip_hit, dual_hit,
                                                         loss_mask, agg)


def entropy_balanced_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    agg: LossAgg,
    params: PolicyLossParams = PolicyLossParams(),
    entropy: Tensor | None = None,
    entropy_stats: MaskedStats | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """AEPO gradient-preserving upper clip; value identical to `vanilla`. All tensors `[B, T]`.

    With `entropy_clip_scope=high_entropy`, `entropy` `[B, T]` is required; the threshold is
    the mean entropy over valid tokens (`entropy_stats.mean` if given, else this call's).
    """
    _check(logp, old_logp, advantages, loss_mask)
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    high = 1.0 + params.clip_high
    # Value `high`, gradient `high * d log pi`: r / sg(r) is 1 with the gradient of log r.
    upper = high * ratio / ratio.detach()
    keeps_grad = torch.ones_like(loss_mask, dtype=torch.bool)
    if params.entropy_clip_scope == "high_entropy":
        if entropy is None or entropy.shape != logp.shape:
            raise AppoError(
                "actor.entropy_clip_scope=high_entropy needs the per-token entropy [B, T] of "
                "the current policy (pass entropy=...)"
            )
        stats = entropy_stats if entropy_stats is not None else MaskedStats.of(entropy, loss_mask)
        keeps_grad = entropy.detach() > stats.mean
        upper = torch.where(keeps_grad, upper, torch.full_like(upper, high))
    clipped_ratio = torch.where(ratio > high, upper, ratio.clamp(min=1.0 - params.clip_low))
    loss, clip_hit, dual_hit = _dual_clip(ratio, clipped_ratio, advantages, params.clip_c)
    metrics = _ppo_metrics(log_ratio, clip_hit, dual_hit, loss_mask, agg)
    grad_kept = (ratio.detach() > high) & (advantages > 0) & keeps_grad
    metrics["clip_grad_kept_frac"] = token_share(grad_kept.float(), loss_mask, agg)
    return aggregate(loss, loss_mask, agg), metrics


def discounted_future_sum(values: Tensor, gamma: float, block: int = 256) -> Tensor:
    """`out_t = sum_{k >= t} gamma^(k - t) values_k` along the last dim. values `[B, T]`.

    Blocked: within a block a `[block, block]` decay matrix, across blocks a carried tail, so
    memory is O(B T + block^2) and no power of gamma is negative (nothing overflows).
    Computed in float64, returned in the input dtype; no gradient.
    """
    if not 0.0 <= gamma <= 1.0:
        raise AppoError(f"discount must be in [0, 1], got {gamma}")
    with torch.no_grad():
        x = values.detach().double()
        size, width = x.shape
        out = torch.empty_like(x)
        steps = torch.arange(block, dtype=torch.float64, device=x.device)
        lag = steps[None, :] - steps[:, None]  # lag[t, k] = k - t
        decay = torch.where(lag >= 0, gamma ** lag.clamp(min=0), 0.0)  # decay[t, k]
        carry = torch.zeros(size, dtype=torch.float64, device=x.device)  # out at block end
        for start in reversed(range(0, width, block)):
            end = min(start + block, width)
            n = end - start
            tail = gamma ** (n - steps[:n])  # gamma^(end - t)
            out[:, start:end] = x[:, start:end] @ decay[:n, :n].T + carry[:, None] * tail
            carry = out[:, start]
        return out.to(values.dtype)


@dataclass(frozen=True)
class _FutureKL:
    """The future-KL re-weighting of one `[B, T]` batch (all no-grad but `ratio`)."""

    log_ratio: Tensor
    ratio: Tensor
    future_kl: Tensor
    influence: Tensor
    participates: Tensor
    unsafe: Tensor


def _future_kl_terms(logp: Tensor, old_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
                     params: PolicyLossParams) -> _FutureKL:
    log_ratio = (logp - old_logp).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    with torch.no_grad():
        drift = log_ratio.detach()
        participates = loss_mask.bool() & (drift <= math.log(params.clip_c))
        gamma = 2.0 ** (-1.0 / params.future_kl_decay_rate)
        future_kl = discounted_future_sum(torch.where(participates, drift, 0.0), gamma)
        low = 1.0 if params.future_kl_clip_high_only else 2.0 - params.future_kl_clip_high
        influence = future_kl.clamp(-20.0, 20.0).exp().clamp(low, params.future_kl_clip_high)
        unsafe = (advantages.detach() < 0) & (ratio.detach() > params.future_kl_safety_thresh)
        influence = torch.where(unsafe, influence.clamp(0.8, 1.0), influence)
    return _FutureKL(log_ratio, ratio, future_kl, influence, participates, unsafe)


def _future_kl_loss(terms: _FutureKL, advantages: Tensor, params: PolicyLossParams,
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token loss `[B, T]` on `A' = A (1 + coef f)`, and the clip / dual-clip hit masks."""
    weighted = advantages * (1.0 + params.future_kl_coef * terms.influence)
    clipped = terms.ratio.clamp(1.0 - params.clip_low, 1.0 + params.clip_high)
    return _dual_clip(terms.ratio, clipped, weighted, params.clip_c)


def future_kl_kept_rows(logp: Tensor, old_logp: Tensor, advantages: Tensor, loss_mask: Tensor,
                        params: PolicyLossParams = PolicyLossParams()) -> Tensor:
    """Rows `[B]` (bool) the sequence filter keeps: at most one token with `A < 0` whose
    clipped loss exceeds the dual-clip bound `-A' c` (the original's rule). All rows are kept
    with `future_kl_seq_filter` off. Inputs `[B, T]`; no gradient.

    The loss's normaliser must count only these rows: build `agg` from
    `loss_mask * kept[:, None]` (`LossAgg.from_masks`).
    """
    _check(logp, old_logp, advantages, loss_mask)
    with torch.no_grad():
        if not params.future_kl_seq_filter:
            return torch.ones(logp.shape[0], dtype=torch.bool, device=logp.device)
        terms = _future_kl_terms(logp.detach(), old_logp, advantages.detach(), loss_mask, params)
        _, _, dual_hit = _future_kl_loss(terms, advantages.detach(), params)
        return (dual_hit & loss_mask.bool()).sum(dim=-1) <= 1


def future_kl_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    agg: LossAgg,
    params: PolicyLossParams = PolicyLossParams(),
    entropy: Tensor | None = None,
    entropy_stats: MaskedStats | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """APPO/FIPO future-KL re-weighted advantage, then dual-clip PPO. All tensors `[B, T]`.

    With `future_kl_seq_filter`, rows with more than one dual-clip hit are left out of the
    loss and the metrics; `agg` should count the kept rows only (`future_kl_kept_rows`).
    """
    _check(logp, old_logp, advantages, loss_mask)
    terms = _future_kl_terms(logp, old_logp, advantages, loss_mask, params)
    loss, clip_hit, dual_hit = _future_kl_loss(terms, advantages, params)
    filtered = torch.zeros(logp.shape[0], dtype=torch.bool, device=logp.device)
    if params.future_kl_seq_filter:
        filtered = (dual_hit & loss_mask.bool()).sum(dim=-1) > 1
        loss_mask = loss_mask * (~filtered)[:, None].to(loss_mask.dtype)
    metrics = _ppo_metrics(terms.log_ratio, clip_hit, dual_hit, loss_mask, agg)
    metrics |= {
        "future_kl": token_share(terms.future_kl, loss_mask, agg),
        "future_kl_influence": token_share(terms.influence, loss_mask, agg),
        "future_kl_influence_at_high": token_share(
            (terms.influence >= params.future_kl_clip_high).float(), loss_mask, agg),
        "future_kl_participation": token_share(terms.participates.float(), loss_mask, agg),
        "future_kl_safety_frac": token_share(terms.unsafe.float(), loss_mask, agg),
        # a count (summed over micro-batches), not a share
        "future_kl_filtered_rows": float(filtered.sum()),
    }
    return aggregate(loss, loss_mask, agg), metrics


POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": vanilla_policy_loss,
    "entropy_balanced": entropy_balanced_policy_loss,
    "future_kl": future_kl_policy_loss,
}
