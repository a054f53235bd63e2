"""The RL step's batch: trajectories and their rewards as tensors, built once.

`TrainBatch.collate` turns a rollout's trajectories (with `Trajectory.reward` set) into
right-padded tensors; the advantage estimator, the reference / old log-prob passes and the
update all read and fill this one record, and micro-batches are row selections of it
(`TrainBatch.select`), trimmed to their longest row, never re-padded from lists.

Shapes: `B` rows, `T` = longest row (prompt + response), `R` = longest response. Response
token `j` of row `i` sits at position `prompt_lens[i] + j` of `input_ids[i]`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from appo.algos import ADV_ESTIMATORS, AdvantageParams, BranchTree

if TYPE_CHECKING:
    from appo.rollout import Trajectory


def pad_right(rows: list[list[int]] | list[list[float]], value, dtype) -> Tensor:
    """`[B, T]` tensor of rows padded on the right with `value`."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
    return out


@dataclass
class TrainBatch:
    """Rows for the update, as tensors.

    uids:        prompt group of each row (advantages are group-relative), `B` strings
    traj_ids / parent_ids / splits: the branch tree (`parent_ids[i]` None for a root;
                 `splits[i]` the index of the parent's response token the branch shares last)
    input_ids:   `[B, T]` long, right-padded with the pad id
    lengths:     `[B]` long, prompt + response length of each row
    prompt_lens: `[B]` long
    loss_mask:   `[B, R]` float, 1 on trained response tokens (sampled ones; tool results and
                 APPO branch rows carry 0)
    rewards:     `[B]` float, the sequence reward
    advantages:  `[B, R]` float, filled by `compute_advantages`
    old_logp / ref_logp: `[B, R]` float, behaviour policy of the update (only when the update
                 is off-policy) and reference policy (only with a KL term)
    values / returns: `[B, R]` float, the critic's values before the update and its value
                 targets (only with `algorithm.adv_estimator=gae`, `appo.trainer.critic`)
    """

    uids: list[str]
    traj_ids: list[str]
    parent_ids: list[str | None]
    splits: list[int | None]
    input_ids: Tensor
    lengths: Tensor
    prompt_lens: Tensor
    loss_mask: Tensor
    rewards: Tensor
    advantages: Tensor | None = None
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    values: Tensor | None = None
    returns: Tensor | None = None

    @classmethod
    def collate(cls, trajs: list[Trajectory], pad_id: int) -> TrainBatch:
        for t in trajs:
            if t.reward is None:
                raise ValueError(f"trajectory {t.traj_id} has no reward; score it first")
        return cls(
            uids=[t.uid for t in trajs],
            traj_ids=[t.traj_id for t in trajs],
            parent_ids=[t.parent_id for t in trajs],
            splits=[t.branch_token_index for t in trajs],
            input_ids=pad_right([t.prompt_ids + t.response_ids for t in trajs], pad_id,
                                torch.long),
            lengths=torch.tensor([len(t.prompt_ids) + len(t.response_ids) for t in trajs],
                                 dtype=torch.long),
            prompt_lens=torch.tensor([len(t.prompt_ids) for t in trajs], dtype=torch.long),
            loss_mask=pad_right([t.loss_mask for t in trajs], 0, torch.float32),
            rewards=torch.tensor([float(t.reward) for t in trajs], dtype=torch.float32),
        )

    def __len__(self) -> int:
        return len(self.uids)

    @property
    def response_lens(self) -> Tensor:
        """`[B]` long."""
        return self.lengths - self.prompt_lens

    def trainable_rows(self) -> list[int]:
        """Rows with at least one trained token (APPO branch rows have none)."""
        return torch.nonzero(self.loss_mask.sum(dim=1) > 0).flatten().tolist()

    def select(self, idx: list[int]) -> TrainBatch:
        """Rows `idx` in that order, tensors trimmed to the selection's longest row."""
        index = torch.tensor(idx, dtype=torch.long)
        lengths = self.lengths[index]
        width = int(lengths.max()) if idx else 0
        resp = int((lengths - self.prompt_lens[index]).max()) if idx else 0
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                out[f.name] = None
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in idx]
            elif f.name == "input_ids":
                out[f.name] = value[index, :width]
            elif value.dim() == 2:  # response-aligned
                out[f.name] = value[index, :resp]
            else:
                out[f.name] = value[index]
        return TrainBatch(**out)

    def tree(self) -> BranchTree:
        return BranchTree.from_ids(self.traj_ids, self.parent_ids, self.splits)


def compute_advantages(batch: TrainBatch, estimator: str,
                       params: AdvantageParams) -> tuple[TrainBatch, dict[str, float]]:
    """`batch` with `advantages` `[B, R]` filled (nonzero on `loss_mask=1` tokens only).

    The estimator sees every row of the groups (all ranks' rows, before `select`); `appo`
    also reads the branch tree, `gae` the critic's `values`.
    """
    if len(batch) == 0:
        return replace(batch, advantages=torch.zeros_like(batch.loss_mask)), {}
    tree = batch.tree() if estimator == "appo" else None
    adv, metrics = ADV_ESTIMATORS[estimator](batch.rewards, batch.loss_mask, batch.uids,
                                             params=params, tree=tree, values=batch.values)
    return replace(batch, advantages=adv.to(torch.float32)), metrics


def row_mean_advantages(batch: TrainBatch) -> list[float]:
    """Each row's mean advantage over its trained tokens (0 without any), for rollout dumps."""
    assert batch.advantages is not None
    count = batch.loss_mask.sum(dim=1)
    total = (batch.advantages * batch.loss_mask).sum(dim=1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total)).tolist()
