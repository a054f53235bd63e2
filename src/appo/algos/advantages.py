"""Outcome-reward advantage estimators, grouped by prompt, and the AEPO advantage transform.

Every estimator has one calling convention, so the trainer picks one from `ADV_ESTIMATORS`
by `algorithm.adv_estimator`:

    adv, metrics = ADV_ESTIMATORS[name](scores, response_mask, groups, params=..., tree=...,
                                        values=...)

- scores `[B]`: outcome score per trajectory (sum of its token rewards).
- response_mask `[B, T]`: 1 on the response tokens that receive an advantage (normally the
  `loss_mask`); the result is zero elsewhere.
- groups: prompt id per row -- a list/array of uid strings or ints, or an int tensor `[B]`.
  Groups are found by id, never by reshaping, so they may have any sizes and any order.
- tree: `BranchTree` (branch provenance); only `appo` reads it.
- values: `[B, T]` value-model estimates (response-aligned); only `gae` reads them.
- Returns `adv [B, T]` (float32) and a dict of float metrics.

Estimators:
- `grpo` (DeepSeekMath, 2402.03300): `(s - mean) / (std + eps)`, unbiased std; a group of
  one has mean 0 and std 1 (so `A = s / (1 + eps)`, as verl); `norm_adv_by_std=False` gives
  Dr.GRPO (2503.20783): `s - mean`.
- `rloo` (Ahmadian et al. 2402.14740): `s_i - mean_{j != i} s_j`; a group of one has no
  leave-one-out baseline, so `A = s`.
- `reinforce_plus_plus` (REINFORCE++ with baseline, Hu 2501.03262 / verl
  `reinforce_plus_plus_baseline`): `s - mean_group(s)` (0 for a group of one), broadcast to
  tokens, then whitened over all valid tokens of the batch (unbiased std).
- `appo` (APPO tree credit, docs/algorithms.md §2.4 appo.5, §3.4): see `appo_advantage`.
- `gae` (PPO with a value model, Schulman et al. 1506.02438; docs/algorithms.md §3.6): reads
  `values` `[B, T]` (the critic's); tool-result tokens are skipped by the recursion
  (`appo.algos.gae`).

`entropy_aware_advantage` is AEPO's (2510.14545) token-level transform, applied in the loss
step after the estimator because it needs the current policy's entropy.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from appo.algos.aggregation import MaskedStats
from appo.algos.gae import gae_advantages_and_returns, outcome_token_rewards
from appo.errors import AppoError

__all__ = [
    "ADV_ESTIMATORS",
    "AdvantageParams",
    "BranchTree",
    "Groups",
    "appo_advantage",
    "entropy_aware_advantage",
    "gae_advantage",
    "group_index",
    "grpo_advantage",
    "reinforce_plus_plus_advantage",
    "rloo_advantage",
]

Groups = Tensor | Sequence[Hashable]


@dataclass(frozen=True)
class AdvantageParams:
    """Scalars the estimators read; each field names its config key."""

    norm_adv_by_std: bool = True  # algorithm.norm_adv_by_std (grpo only)
    appo_discount_credit: bool = False  # algorithm.appo_discount_credit
    reward_scale_discount: float = 0.9  # algorithm.reward_scale_discount
    gamma: float = 1.0  # algorithm.gamma (gae)
    lam: float = 1.0  # algorithm.lam (gae)
    gae_whiten: bool = True  # algorithm.gae_whiten
    eps: float = 1e-6

    def __post_init__(self) -> None:
        for key in ("gamma", "lam"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise AppoError(f"algorithm.{key} must be in [0, 1], got {getattr(self, key)}")
        if not 0.0 < self.reward_scale_discount <= 1.0:
            raise AppoError(
                f"algorithm.reward_scale_discount must be in (0, 1], got {self.reward_scale_discount}"
            )


@dataclass(frozen=True)
class BranchTree:
    """Branch provenance of a batch, in row coordinates.

    parent `[B]` long: row index of the row a branch continues from; -1 for initial rows.
    split_index `[B]` long: for a branch, the index `t` (response-token coordinates of its
        parent) of the split token: the branch is `prompt + parent.response[:t+1]` plus its own
        continuation. Ignored for initial rows (use -1).

    A branch of a branch is allowed: it is credited to the initial row at the root of its
    chain, up to the smallest split index along the chain (the prefix it really shares).
    """

    parent: Tensor
    split_index: Tensor

    @property
    def is_branch(self) -> Tensor:
        """`[B]` bool."""
        return self.parent >= 0

    @classmethod
    def from_ids(
        cls,
        traj_ids: Sequence[Hashable],
        parent_ids: Sequence[Hashable | None],
        split_indices: Sequence[int | None],
    ) -> BranchTree:
        """Build from per-row trajectory ids, parent trajectory ids (None for initial rows)
        and branch token indices (None for initial rows), as a rollout records them."""
        row_of = {tid: i for i, tid in enumerate(traj_ids)}
        if len(row_of) != len(traj_ids):
            raise AppoError("trajectory ids in a batch must be unique")
        parent = []
        for tid, pid in zip(traj_ids, parent_ids, strict=True):
            if pid is not None and pid not in row_of:
                raise AppoError(f"branch {tid!r} names parent {pid!r}, which is not in the batch")
            parent.append(-1 if pid is None else row_of[pid])
        split = [-1 if s is None else int(s) for s in split_indices]
        return cls(torch.tensor(parent, dtype=torch.long), torch.tensor(split, dtype=torch.long))

    def resolve(self) -> tuple[list[int], list[int]]:
        """Per row: (root initial row, effective split index); a root row maps to (itself, -1)."""
        parent = self.parent.tolist()
        split = self.split_index.tolist()
        size = len(parent)
        roots, splits = [], []
        for row in range(size):
            node, eff, steps = row, None, 0
            while parent[node] >= 0:
                if parent[node] >= size:
                    raise AppoError(f"row {node} has parent {parent[node]} outside the batch")
                eff = split[node] if eff is None else min(eff, split[node])
                node = parent[node]
                steps += 1
                if steps > size:
                    raise AppoError(f"branch parents form a cycle through row {row}")
            roots.append(node)
            splits.append(-1 if eff is None else eff)
        return roots, splits


def group_index(groups: Groups, batch_size: int | None = None) -> tuple[Tensor, int]:
    """Dense group ids `[B]` long (0..G-1, in order of first appearance for sequences) and G."""
    if isinstance(groups, Tensor):
        if groups.dim() != 1 or groups.dtype.is_floating_point:
            raise AppoError(f"group ids must be a 1-D integer tensor, got {groups.dtype} "
                            f"{tuple(groups.shape)}")
        unique, index = torch.unique(groups, return_inverse=True)
        index, count = index.long(), unique.numel()
    else:
        first_seen: dict[Any, int] = {}
        index = torch.tensor([first_seen.setdefault(g, len(first_seen)) for g in groups],
                             dtype=torch.long)
        count = len(first_seen)
    if batch_size is not None and index.numel() != batch_size:
        raise AppoError(f"got {index.numel()} group ids for a batch of {batch_size} rows")
    return index, count


def _check_inputs(scores: Tensor, response_mask: Tensor) -> None:
    if scores.dim() != 1 or response_mask.dim() != 2 or response_mask.shape[0] != scores.shape[0]:
        raise AppoError(
            f"scores must be [B] and response_mask [B, T]; got {tuple(scores.shape)} and "
            f"{tuple(response_mask.shape)}"
        )
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        raise AppoError(
            f"reward scores are not finite for rows {bad[:10]}; check the reward function"
        )


def _group_stats(
    values: Tensor, index: Tensor, n_groups: int, select: Tensor, unbiased: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Per group over `select`ed rows: mean, std, count (all `[G]` float64)."""
    weight = select.double()
    vals = torch.where(select, values.double(), 0.0)
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, weight)
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, index, vals)
    mean = total / count.clamp(min=1)
    sq_dev = torch.zeros(n_groups, dtype=torch.float64).index_add_(
        0, index, (vals - mean[index]) ** 2 * weight
    )
    dof = (count - 1) if unbiased else count
    return mean, (sq_dev / dof.clamp(min=1)).sqrt(), count


def _broadcast(row_adv: Tensor, response_mask: Tensor) -> Tensor:
    return row_adv.float()[:, None] * response_mask.float()


def _zero_std_frac(std: Tensor, count: Tensor) -> float:
    # Groups whose rewards are all equal give no signal (all solved or all failed).
    multi = count > 1
    return float(((std == 0) & multi).sum()) / max(float(multi.sum()), 1.0)


def grpo_advantage(
    scores: Tensor,
    response_mask: Tensor,
    groups: Groups,
    *,
    params: AdvantageParams = AdvantageParams(),
    tree: BranchTree | None = None,
    values: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GRPO / Dr.GRPO outcome advantage. scores `[B]`, response_mask `[B, T]` -> `[B, T]`."""
    _check_inputs(scores, response_mask)
    index, n_groups = group_index(groups, scores.shape[0])
    everyone = torch.ones_like(index, dtype=torch.bool)
    mean, std, count = _group_stats(scores, index, n_groups, everyone, unbiased=True)
    alone = count[index] == 1
    row_mean = torch.where(alone, 0.0, mean[index])
    row_std = torch.where(alone, 1.0, std[index])
    adv = scores.double() - row_mean
    if params.norm_adv_by_std:
        adv = adv / (row_std + params.eps)
    metrics = {"score_mean": float(scores.double().mean()),
               "zero_std_group_frac": _zero_std_frac(std, count)}
    return _broadcast(adv, response_mask), metrics


def rloo_advantage(
    scores: Tensor,
    response_mask: Tensor,
    groups: Groups,
    *,
    params: AdvantageParams = AdvantageParams(),
    tree: BranchTree | None = None,
    values: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE leave-one-out. scores `[B]`, response_mask `[B, T]` -> `[B, T]`."""
    _check_inputs(scores, response_mask)
    index, n_groups = group_index(groups, scores.shape[0])
    everyone = torch.ones_like(index, dtype=torch.bool)
    mean, std, count = _group_stats(scores, index, n_groups, everyone, unbiased=True)
    n = count[index]
    s = scores.double()
    others_mean = (mean[index] * n - s) / (n - 1).clamp(min=1)
    adv = torch.where(n > 1, s - others_mean, s)
    metrics = {"score_mean": float(s.mean()), "zero_std_group_frac": _zero_std_frac(std, count)}
    return _broadcast(adv, response_mask), metrics


def reinforce_plus_plus_advantage(
    scores: Tensor,
    response_mask: Tensor,
    groups: Groups,
    *,
    params: AdvantageParams = AdvantageParams(),
    tree: BranchTree | None = None,
    values: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE++ with a group-mean baseline, whitened over the batch's valid tokens.
    scores `[B]`, response_mask `[B, T]` -> `[B, T]`."""
    _check_inputs(scores, response_mask)
    index, n_groups = group_index(groups, scores.shape[0])
    everyone = torch.ones_like(index, dtype=torch.bool)
    mean, std, count = _group_stats(scores, index, n_groups, everyone, unbiased=True)
    row_adv = scores.double() - torch.where(count[index] == 1, 0.0, mean[index])
    valid = response_mask.bool()
    tokens = row_adv[:, None].expand_as(valid)[valid]
    n_tok = tokens.numel()
    tok_mean = tokens.mean() if n_tok else torch.zeros((), dtype=torch.float64)
    tok_std = ((tokens - tok_mean) ** 2).sum().div(max(n_tok - 1, 1)).sqrt()
    whitened = (row_adv[:, None] - tok_mean) / (tok_std + params.eps)
    adv = torch.where(valid, whitened, 0.0).float()
    metrics = {"score_mean": float(scores.double().mean()),
               "zero_std_group_frac": _zero_std_frac(std, count)}
    return adv, metrics


def appo_advantage(
    scores: Tensor,
    response_mask: Tensor,
    groups: Groups,
    *,
    params: AdvantageParams = AdvantageParams(),
    tree: BranchTree | None = None,
    values: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """APPO tree credit. scores `[B]`, response_mask `[B, T]`, tree -> `[B, T]`.

    Per prompt, z-scores with the population std (`(s - mean) / (std_pop + eps)`, a group of
    one gets 0) are taken separately over its initial rows (`A_init`) and its branch rows
    (`A_branch`). For initial row `o` and token `t`:

        A_t = A_init(o) + mean_{b: parent(b) = o, split(b) >= t} A_branch(b) * w(b, t)

    with `w = discount^(split(b) - t)` if `appo_discount_credit`, else 1; the mean is over
    the branches whose split is at or after `t` (the branch term covers the shared prefix,
    split token included) and is 0 when there is none; a branch with split -1 (it shares
    only the prompt: the rollout's fallback when a row has no split point) counts in the
    branch z-scores and credits no token. Branch rows get `A = 0` (their
    tokens only supply reward signal). The original's reward-scale discount multiplied the
    token rewards, whose outcome sits on the last token, so it changed nothing; ours scales
    the credit by distance to the split.
    """
    _check_inputs(scores, response_mask)
    if tree is None:
        raise AppoError(
            "algorithm.adv_estimator=appo needs branch provenance (parent, split index) from "
            "the rollout; use rollout.strategy=appo or another estimator"
        )
    size, width = response_mask.shape
    if tree.parent.shape != (size,) or tree.split_index.shape != (size,):
        raise AppoError(f"branch tree tensors must be [{size}], got {tuple(tree.parent.shape)} "
                        f"and {tuple(tree.split_index.shape)}")
    index, n_groups = group_index(groups, size)
    roots, splits = tree.resolve()
    is_branch = tree.is_branch
    for row in is_branch.nonzero().flatten().tolist():
        if index[row] != index[roots[row]]:
            raise AppoError(f"branch row {row} is not in the prompt group of its initial row "
                            f"{roots[row]}")
        if not -1 <= splits[row] < width:  # -1: branched at the prompt, shares no token
            raise AppoError(f"branch row {row} has split index {splits[row]} outside the "
                            f"response [-1, {width})")

    def zscore(select: Tensor) -> Tensor:
        mean, std, count = _group_stats(scores, index, n_groups, select, unbiased=False)
        z = (scores.double() - mean[index]) / (std[index] + params.eps)
        return torch.where(select & (count[index] > 1), z, 0.0)

    a_init = zscore(~is_branch)
    a_branch = zscore(is_branch)

    branch_rows = is_branch.nonzero().flatten()
    credit_sum = torch.zeros(size, width, dtype=torch.float64)
    credit_count = torch.zeros(size, width, dtype=torch.float64)
    if branch_rows.numel():
        split = torch.tensor(splits, dtype=torch.long)[branch_rows]
        root = torch.tensor(roots, dtype=torch.long)[branch_rows]
        position = torch.arange(width)
        covered = (position[None, :] <= split[:, None]).double()  # [n_branch, T]
        weight = covered
        if params.appo_discount_credit:
            distance = (split[:, None] - position[None, :]).clamp(min=0).double()
            weight = covered * params.reward_scale_discount**distance
        credit_sum.index_add_(0, root, a_branch[branch_rows][:, None] * weight)
        credit_count.index_add_(0, root, covered)
    branch_term = credit_sum / credit_count.clamp(min=1)
    adv = torch.where(is_branch[:, None], 0.0, a_init[:, None] + branch_term)
    adv = torch.where(response_mask.bool(), adv, 0.0).float()
    metrics = {
        "score_mean": float(scores.double().mean()),
        "branch_frac": float(is_branch.double().mean()),
        "branch_credit_abs_mean": float(branch_term.abs()[credit_count > 0].mean())
        if bool((credit_count > 0).any()) else 0.0,
    }
    return adv, metrics


def gae_advantage(
    scores: Tensor,
    response_mask: Tensor,
    groups: Groups,
    *,
    params: AdvantageParams = AdvantageParams(),
    tree: BranchTree | None = None,
    values: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's GAE with a value model. scores `[B]`, response_mask `[B, T]`, values `[B, T]` ->
    `[B, T]`: the score is the reward of the last `response_mask=1` token, the recursion runs
    over the decision tokens only (`appo.algos.gae`, docs/algorithms.md §3.6); groups are not
    used."""
    _check_inputs(scores, response_mask)
    if values is None:
        raise AppoError("algorithm.adv_estimator=gae needs values from a value model (the "
                        "critic); the trainer builds one for it")
    token_rewards = outcome_token_rewards(scores, response_mask)
    adv, returns = gae_advantages_and_returns(token_rewards, values.cpu(), response_mask,
                                              gamma=params.gamma, lam=params.lam,
                                              whiten=params.gae_whiten)
    valid = response_mask.bool()
    n = max(float(valid.sum()), 1.0)
    ret, val = returns[valid].double(), values.cpu().double()[valid]
    # How much of the returns' variance the values explain (1: perfect, <= 0: no better
    # than their mean), over the batch's decision tokens.
    ret_var = float(ret.var(unbiased=False)) if ret.numel() else 0.0
    explained = (1.0 - float((ret - val).var(unbiased=False)) / ret_var) if ret_var > 0 else 0.0
    metrics = {"score_mean": float(scores.double().mean()),
               "returns_mean": float(ret.sum()) / n,
               "values_mean": float(val.sum()) / n,
               "vf_explained_var": explained}
    return adv, metrics


AdvantageFn = Callable[..., tuple[Tensor, dict[str, float]]]

ADV_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantage,
    "rloo": rloo_advantage,
    "reinforce_plus_plus": reinforce_plus_plus_advantage,
    "appo": appo_advantage,
    "gae": gae_advantage,
}


def entropy_aware_advantage(
    advantages: Tensor,
    entropy: Tensor,
    loss_mask: Tensor,
    *,
    alpha: float,
    stats: MaskedStats | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """AEPO entropy-aware advantage: `A_t * (1 + alpha * sg(z(H_t)))`.

    advantages, entropy, loss_mask: `[B, T]`; entropy is the current policy's full-vocabulary
    token entropy (it is detached here). `z = (H - mean) / (std + 1e-6)` with the population
    std over valid tokens of `entropy` (the micro-batch, docs/algorithms.md §3.5), or of the whole
    mini-batch if `stats` is given. Masked positions keep their advantage. For `z < -1/alpha`
    the factor turns negative, as the paper's formula does. `alpha` is
    `actor.entropy_advantage_alpha`.
    """
    if not advantages.shape == entropy.shape == loss_mask.shape:
        shapes = ", ".join(str(tuple(t.shape)) for t in (advantages, entropy, loss_mask))
        raise AppoError(f"advantages, entropy and loss_mask must share [B, T]; got {shapes}")
    stats = stats if stats is not None else MaskedStats.of(entropy, loss_mask)
    z = (entropy.detach().float() - stats.mean) / (stats.std + 1e-6)
    valid = loss_mask.bool()
    factor = torch.where(valid, 1.0 + alpha * z, 1.0)
    n_valid = max(float(valid.sum()), 1.0)
    metrics = {
        "entropy_adv_factor_mean": float(torch.where(valid, factor, 0.0).sum()) / n_valid,
        "entropy_adv_factor_neg_frac": float((valid & (factor < 0)).sum()) / n_valid,
    }
    return advantages * factor, metrics
