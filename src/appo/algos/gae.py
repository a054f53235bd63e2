"""GAE (Schulman et al. 1506.02438) over multi-turn tool trajectories, and the clipped value loss.

PPO with a value model, as verl's `gae` estimator and `compute_value_loss`, with one rule for
tool trajectories (docs/algorithms.md §3.6): tokens with `loss_mask=0` (tool results) are
not decision steps. The recursion runs over the decision tokens only, so the value of the
first model token after a tool result bootstraps the last model token before it, and the
result's tokens neither reset the return nor add a discount step. A reward on a masked token
(none in appo: the outcome sits on the last `loss_mask=1` token) counts for the decision
before it, where verl drops it.

All tensors `[B, T]`, response-aligned: `values[:, t]` is the value of the state in which
response token `t` is chosen (the hidden state that predicts it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from appo.algos.aggregation import LossAgg, aggregate, token_share
from appo.errors import AppoError

__all__ = ["clipped_value_loss", "gae_advantages_and_returns", "masked_whiten",
           "outcome_token_rewards"]


def outcome_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """`[B, T]` float: each row's score `[B]` on its last `response_mask=1` token (a row
    without one gets no reward)."""
    mask = response_mask.bool()
    width = mask.shape[1]
    position = torch.arange(width)[None, :].expand_as(mask)
    last = torch.where(mask, position, -1).max(dim=1).values  # [B], -1 without a token
    out = torch.zeros(mask.shape, dtype=torch.float32)
    rows = (last >= 0).nonzero().flatten()
    out[rows, last[rows]] = scores.float()[rows]
    return out


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """`(x - mean) / sqrt(var + eps)` over the `mask=1` entries (unbiased variance, as verl's
    `masked_whiten`); 0 where `mask=0`. One entry: variance 0."""
    valid = mask.bool()
    n = int(valid.sum())
    if n == 0:
        return torch.zeros_like(x)
    vals = x[valid].double()
    mean = vals.mean()
    var = ((vals - mean) ** 2).sum() / max(n - 1, 1)
    return torch.where(valid, (x.double() - mean) * torch.rsqrt(var + eps), 0.0).to(x.dtype)


def gae_advantages_and_returns(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """GAE advantages and value targets over decision tokens. All inputs `[B, T]`.

    For the decision tokens `t_1 < ... < t_K` of a row (`response_mask=1`), with
    `r_k = sum of token_rewards over [t_k, t_{k+1})` and `V_{K+1} = 0`:

        delta_k = r_k + gamma * V(t_{k+1}) - V(t_k)
        A_k     = delta_k + gamma * lam * A_{k+1}
        R_k     = A_k + V(t_k)

    Returns `(advantages, returns)` `[B, T]` float32, 0 off the mask; advantages whitened over
    every `mask=1` token of the batch when `whiten` (returns never are).
    """
    if not token_rewards.shape == values.shape == response_mask.shape or values.dim() != 2:
        shapes = ", ".join(str(tuple(t.shape)) for t in (token_rewards, values, response_mask))
        raise AppoError(f"token rewards, values and response_mask must share [B, T]; got {shapes}")
    mask = response_mask.bool()
    rewards, vals = token_rewards.double(), values.detach().double()
    size, width = mask.shape
    next_value = torch.zeros(size, dtype=torch.float64)
    next_adv = torch.zeros(size, dtype=torch.float64)
    pending = torch.zeros(size, dtype=torch.float64)  # rewards of masked tokens after t
    adv = torch.zeros(size, width, dtype=torch.float64)
    for t in reversed(range(width)):
        decide = mask[:, t]
        reward = pending + rewards[:, t]
        delta = reward + gamma * next_value - vals[:, t]
        here = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(decide, here, 0.0)
        # A masked token changes nothing but collects its reward for the decision before it.
        next_adv = torch.where(decide, here, next_adv)
        next_value = torch.where(decide, vals[:, t], next_value)
        pending = torch.where(decide, 0.0, reward)
    returns = torch.where(mask, adv + vals, 0.0).float()
    if whiten:
        adv = masked_whiten(adv, mask)
    return adv.float(), returns


def clipped_value_loss(
    vpreds: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    *,
    agg: LossAgg,
    cliprange_value: float,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss (verl's `compute_value_loss`), all inputs `[B, T]`:

        v_clip = old + clamp(v - old, -c, c)
        loss   = 0.5 * agg(max((v - R)^2, (v_clip - R)^2))

    `agg` holds the mini-batch's global normalisers (`appo.algos.LossAgg`), so micro-batch
    shares add up to the mini-batch loss. Metrics (token-mean shares, adding up the same way):
    `vf_clipfrac` (tokens where the clipped error is the larger), `vpred_mean`.
    """
    old = old_values.detach().to(vpreds.dtype)
    target = returns.detach().to(vpreds.dtype)
    clipped = old + (vpreds - old).clamp(-cliprange_value, cliprange_value)
    unclipped_err = (vpreds - target) ** 2
    clipped_err = (clipped - target) ** 2
    loss = 0.5 * aggregate(torch.maximum(unclipped_err, clipped_err), response_mask, agg)
    metrics = {
        "vf_clipfrac": token_share((clipped_err > unclipped_err).float(), response_mask, agg),
        "vpred_mean": token_share(vpreds, response_mask, agg),
    }
    return loss, metrics
