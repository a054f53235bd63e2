"""The value model of `algorithm.adv_estimator=gae` (PPO's critic), docs/algorithms.md §4.8.

The seed architecture's `CriticWorker`: a backbone from any `appo.models` spec
(`critic.model.path`; null: a copy of the policy's starting weights) with a fresh scalar
head on its final hidden states. Each step it gives the rollout batch its values (no
gradient, before the actor update: `values`) and is trained on verl's clipped value loss
(`update`), batched as the actor is (`appo.trainer.update`): mini-batches of whole prompt
groups, micro-batches under a token budget with the shared-prefix forward, token-mean
normalisers counted over the whole mini-batch and every rank, gradients summed over ranks
(under several processes without FSDP by torch's `DistributedDataParallel`,
`appo.trainer.distributed.GradSync`, built with the critic; the backbone's LM head, which the
value model never uses, is left out of it when it is not tied to the embeddings).
Under `trainer.parallel=fsdp` the critic is sharded as the policy is (`appo.trainer.fsdp`:
one unit per decoder layer, the rest with the value head in the root unit; loss scaled by
the world size; idle passes keep ranks in step; whole states gathered for checkpoints).
`actor.tree_forward` (with `actor.share_prefix_forward`) gives the critic's forwards the
tree-shared forward too. `actor.cpu_matmul` puts the critic's linears through oneDNN as it
does the policy's (`appo.trainer.cpu_linear`). Deviation from verl: the critic is built only
for `gae`.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from typing import Any

import torch
from torch import Tensor, nn

from appo.algos import (
    LossAgg,
    clipped_value_loss,
    gae_advantages_and_returns,
    outcome_token_rewards,
)
from appo.errors import AppoError
from appo.trainer.batch import TrainBatch
from appo.trainer.checkpoint import TrainedPart
from appo.trainer.cpu_linear import onednn_linears, run_uses_onednn
from appo.trainer.distributed import DataParallel, GradSync, check_grad_sync
from appo.trainer.forward import final_hidden_states, plan_shared_microbatches
from appo.trainer.fsdp import shard_model, to_float
from appo.trainer.guards import CRITIC_HINT, check_finite
from appo.trainer.memory import forward_allocations
from appo.trainer.optim import adamw
from appo.trainer.precision import autocast


def uses_critic(cfg: Any) -> bool:
    """Whether the run needs a value model (only `gae` reads values)."""
    return cfg.algorithm.adv_estimator == "gae"


class ValueModel(nn.Module):
    """A causal LM backbone and a scalar head `nn.Linear(hidden, 1)` on its final hidden
    states (the LM head is not used)."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        param = next(backbone.parameters())
        self.value_head = nn.Linear(hidden, 1, dtype=param.dtype, device=param.device)

    def forward(self, input_ids: Tensor, lengths: Tensor, prompt_lens: Tensor,
                response_lens: Tensor, share_prefix: bool = True, tree: bool = False,
                compute_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """Values `[b, R]` of every response token's state (the position that predicts it)
        and the response mask `[b, R]` (1 on real response tokens); 0 past each response.
        `input_ids` `[b, T]` right-padded rows of `lengths` `[b]`, whose first
        `prompt_lens` `[b]` tokens are the prompt and the next `response_lens` `[b]` the
        response. A module call (not a method), so FSDP's hooks gather the root's shards."""
        device = next(self.parameters()).device
        with autocast(device, compute_dtype):
            hidden = final_hidden_states(self.backbone, input_ids, lengths, share_prefix, tree)
            j = torch.arange(int(response_lens.max()) if len(input_ids) else 0)[None, :]
            valid = (j < response_lens[:, None]).to(torch.long)
            pos = ((prompt_lens[:, None] - 1 + j) * valid).to(device)
            gathered = hidden.gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
            values = self.value_head(gathered).squeeze(-1).float()
        valid = valid.to(device)
        return values * valid, valid

    def response_values(self, batch: TrainBatch, share_prefix: bool = True,
                        compute_dtype: torch.dtype | None = None,
                        tree: bool = False) -> tuple[Tensor, Tensor]:
        """`forward` on a `TrainBatch`: values `[b, R]` and the response mask `[b, R]`."""
        return self(batch.input_ids, batch.lengths, batch.prompt_lens, batch.response_lens,
                    share_prefix, tree, compute_dtype)

    def idle_pass(self, backward: bool) -> None:
        """A one-token forward (and backward) that contributes nothing, to keep FSDP ranks'
        collectives in step (`appo.trainer.fsdp.idle_step` for the policy)."""
        values = self.idle_values()
        if backward:
            (values.sum() * 0.0).backward()

    def idle_values(self) -> Tensor:
        """Values of a one-token row: a forward through every parameter the critic uses."""
        one = torch.ones(1, dtype=torch.long)
        return self(torch.zeros((1, 1), dtype=torch.long), one, one, one, False)[0]

    def unused_parameters(self) -> list[nn.Parameter]:
        """Trainable parameters no forward uses: the backbone's LM head when it is not the
        input embedding (values come from the final hidden states)."""
        head = self.backbone.get_output_embeddings()
        emb = self.backbone.get_input_embeddings()
        if head is None or head.weight is emb.weight:
            return []
        return [p for p in head.parameters() if p.requires_grad]


class Critic:
    """The value model, its AdamW optimizer and LR schedule, and its update schedule."""

    def __init__(self, model: ValueModel, cfg: Any, total_steps: int,
                 compute_dtype: torch.dtype | None = None, fsdp: bool = False):
        """`fsdp`: `model` is sharded (`from_config`); the optimizer is built here, on
        its (sharded) parameters. Several processes without FSDP: the model's
        `DistributedDataParallel` wrapper is built here, once."""
        c, a = cfg.critic, cfg.actor
        self.model = model
        self.fsdp = fsdp
        dp = DataParallel()
        self.sync = (GradSync(model, ignore=model.unused_parameters())
                     if dp.enabled and not fsdp else None)
        self.cliprange_value = float(c.cliprange_value)
        self.grad_clip = float(c.grad_clip)
        self.epochs = c.ppo_epochs if c.ppo_epochs is not None else a.ppo_epochs
        self.mini_batch_size = (c.ppo_mini_batch_size if c.ppo_mini_batch_size is not None
                                else a.ppo_mini_batch_size)
        self.max_tokens = (c.ppo_max_token_len_per_device
                           if c.ppo_max_token_len_per_device is not None
                           else a.ppo_max_token_len_per_device)
        # As the actor's (`update_policy`): under FSDP the number of model calls must not
        # depend on the rows, so the shared-prefix and tree forwards are off.
        self.share_prefix = bool(a.share_prefix_forward) and not fsdp
        self.tree = self.share_prefix and bool(a.tree_forward)
        self.gamma, self.lam = float(cfg.algorithm.gamma), float(cfg.algorithm.lam)
        self.compute_dtype = compute_dtype
        # `actor.cpu_matmul` covers the critic's linears too (`appo.trainer.cpu_linear`).
        self.onednn = run_uses_onednn(cfg, model, fsdp)
        o = c.optim
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = adamw(self.params, o.lr, o.weight_decay, tuple(o.betas), o.fused)
        self.scheduler = _scheduler(self.optimizer, o, total_steps * self.epochs * max(
            1, math.ceil(cfg.data.train_batch_size / self.mini_batch_size)))

    @classmethod
    def from_config(cls, cfg: Any, policy_lm: Any, total_steps: int, fsdp: bool = False,
                    compute_dtype: torch.dtype | None = None) -> Critic:
        """`critic.model.path`'s backbone (null: a copy of the policy model as it is now, before
        any update: `model.path`'s weights) with a fresh value head. `fsdp`: the critic is
        sharded over the process group as the policy is; `policy_lm.model` must then be
        the policy's whole (unsharded) replica."""
        if cfg.critic.model.path is None:
            backbone = copy.deepcopy(policy_lm.model)
        else:
            from appo.trainer.load_once import load_once
            from appo.trainer.precision import master_dtype

            # Several processes: a model directory's weights are read by rank 0 alone.
            lm = load_once(cfg.critic.model.path, DataParallel(), dtype=master_dtype(cfg),
                           device=str(next(policy_lm.model.parameters()).device),
                           trust_remote_code=cfg.model.trust_remote_code)
            if len(lm.tokenizer) != len(policy_lm.tokenizer):
                raise AppoError(f"critic.model.path {cfg.critic.model.path!r} has a vocabulary "
                                f"of {len(lm.tokenizer)} tokens, the policy "
                                f"{len(policy_lm.tokenizer)}; the critic must read the policy's "
                                "token ids")
            backbone = lm.model
            if cfg.model.enable_gradient_checkpointing:  # the copy above inherits it
                # Non-reentrant: a reentrant backward marks DDP's parameters ready twice.
                backbone.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False})
        backbone.requires_grad_(True)  # actor.freeze_embeddings is the policy's
        model = ValueModel(backbone)
        if fsdp:
            shard_model(model, DataParallel().world, decoder=backbone)
        return cls(model, cfg, total_steps, compute_dtype, fsdp)

    def part(self) -> TrainedPart:
        """What a checkpoint saves and a resume restores (`appo.trainer.checkpoint`)."""
        return TrainedPart(self.model, self.optimizer, self.scheduler, sharded=self.fsdp)

    @torch.no_grad()
    def values(self, batch: TrainBatch, own: list[int], dp: DataParallel) -> Tensor:
        """Values `[B, R]` of every row of `batch` (0 past each response): each rank computes
        its `own` rows, then all ranks exchange them."""
        mine = batch.select(own)
        plan = plan_shared_microbatches(mine.input_ids, mine.lengths, self.max_tokens,
                                        mine.uids, self.share_prefix, self.tree)
        idle = self._idle_passes(len(plan.batches), dp)  # before any pass (see update)
        self.model.eval()
        rows: list[tuple[str, list[float]]] = []
        with onednn_linears(self.model, self.onednn):
            for idx in plan.batches:
                mb = mine.select(idx)
                values, _ = self.model.response_values(mb, self.share_prefix,
                                                       self.compute_dtype, self.tree)
                for k, i in enumerate(idx):
                    rows.append((mine.traj_ids[i],
                                 values[k, : int(mb.response_lens[k])].tolist()))
            for _ in range(idle):
                self.model.idle_pass(backward=False)
        by_id = dict(dp.gather_objects(rows))
        out = torch.zeros_like(batch.loss_mask)
        for i, tid in enumerate(batch.traj_ids):
            row = by_id[tid]
            out[i, : len(row)] = torch.tensor(row, dtype=out.dtype)
        return out

    def update(self, batch: TrainBatch, dp: DataParallel | None = None) -> dict[str, float]:
        """`epochs` x mini-batches of this rank's rows (`batch.values` filled) on the clipped
        value loss against the GAE returns; one optimizer step each."""
        with onednn_linears(self.model, self.onednn):
            return self._update(batch, dp)

    def _update(self, batch: TrainBatch, dp: DataParallel | None) -> dict[str, float]:
        dp = dp or DataParallel()
        check_grad_sync(dp, self.fsdp, self.sync, "the critic update")
        if batch.values is None:
            raise AppoError("the critic update needs the batch's values (Critic.values)")
        _, returns = gae_advantages_and_returns(
            outcome_token_rewards(batch.rewards, batch.loss_mask), batch.values,
            batch.loss_mask, gamma=self.gamma, lam=self.lam, whiten=False)
        batch.returns = returns
        trainable = batch.trainable_rows()  # APPO branch rows (all-zero masks) never enter
        uid_order = list(dict.fromkeys(batch.uids))
        per_mb = max(1, self.mini_batch_size // dp.world)
        n_mini = max(1, dp.max_int(math.ceil(len(uid_order) / per_mb)))
        sums: Counter = Counter()
        self.model.train()
        for _epoch in range(self.epochs):
            for m in range(n_mini):
                mb_uids = set(uid_order[m * per_mb : (m + 1) * per_mb])
                mini = batch.select([i for i in trainable if batch.uids[i] in mb_uids])
                n_tok = dp.sum_floats([float(mini.loss_mask.sum())])[0]
                agg = LossAgg("token-mean", max(n_tok, 1.0), 1.0)
                plan = plan_shared_microbatches(mini.input_ids, mini.lengths, self.max_tokens,
                                                mini.uids, self.share_prefix, self.tree)
                # Decided before any pass runs, or FSDP's collectives would interleave.
                idle = self._idle_passes(len(plan.batches), dp)
                self.optimizer.zero_grad(set_to_none=True)
                # FSDP and DDP average over ranks where the sum is wanted.
                scale = float(dp.world) if self.fsdp or self.sync is not None else 1.0
                for k, idx in enumerate(plan.batches):
                    sums.update(self._micro_step(mini.select(idx), agg, scale,
                                                 sync=k == len(plan.batches) - 1))
                for _ in range(idle):
                    self.model.idle_pass(backward=True)
                if self.sync is not None and not plan.batches:  # every rank syncs once
                    self.sync.idle(ValueModel.idle_values)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
                check_finite(hint=CRITIC_HINT, **{"critic/grad_norm": to_float(grad_norm)})
                self.optimizer.step()
                self.scheduler.step()
                sums["critic/grad_norm"] += to_float(grad_norm)
        self.model.eval()
        if dp.enabled:  # loss shares add up over ranks; the grad norm is the same on all
            grad_sum = sums["critic/grad_norm"]
            merged: Counter = Counter()
            for part in dp.gather_objects([dict(sums)]):
                merged.update(part)
            sums = merged
            sums["critic/grad_norm"] = grad_sum
        steps = max(self.epochs * n_mini, 1)
        out = {k: v / steps for k, v in sums.items()}
        out["critic/lr"] = self.scheduler.get_last_lr()[0]
        return out

    def _idle_passes(self, passes: int, dp: DataParallel) -> int:
        """Passes this rank runs idle: under FSDP every rank runs as many as the busiest."""
        return dp.max_int(passes) - passes if self.fsdp else 0

    def _micro_step(self, mb: TrainBatch, agg: LossAgg, loss_scale: float,
                    sync: bool = True) -> dict[str, float]:
        """`loss_scale`: the world size under FSDP or DDP, which average gradients over ranks
        where the sum is wanted (`appo.trainer.fsdp`). Under DDP the forward runs through
        its wrapper, all-reducing in the backward when `sync` (the step's last micro-batch)."""
        def forward(model: ValueModel) -> tuple[Tensor, Tensor]:
            return model.response_values(mb, self.share_prefix, self.compute_dtype, self.tree)

        with forward_allocations():
            vpreds, valid = (forward(self.model) if self.sync is None
                             else self.sync.forward(forward, sync))
        device = vpreds.device
        loss, m = clipped_value_loss(vpreds, mb.values.to(device), mb.returns.to(device),
                                     mb.loss_mask.to(device) * valid, agg=agg,
                                     cliprange_value=self.cliprange_value)
        (loss * loss_scale).backward()
        return {"critic/vf_loss": float(loss.detach()),
                **{f"critic/{k}": v for k, v in m.items()}}


def _scheduler(optimizer, optim: Any, total: int):
    """The actor's schedule kinds (`OptimConfig.lr_scheduler`) over `total` optimizer steps."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    warmup = int(optim.lr_warmup_steps_ratio * total)
    if optim.lr_scheduler == "cosine":
        return get_cosine_schedule_with_warmup(optimizer, warmup, total)
    return get_constant_schedule_with_warmup(optimizer, warmup)
