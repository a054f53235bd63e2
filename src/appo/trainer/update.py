"""The policy update: log-prob forwards and `ppo_epochs` x mini-batches of a `TrainBatch`.

Reads `actor.*` (an `appo.config.ActorConfig`) directly; `policy_loss_params` is the one
place the loss's scalar parameters are taken from it. The mathematics is `appo.algos`
(docs/algorithms.md §3-4); this module only batches it:
- mini-batches are whole prompt groups (`actor.ppo_mini_batch_size` prompts, verl's unit),
  so every rank agrees on their number;
- micro-batches pack rows under a token budget (`actor.ppo_max_token_len_per_device`),
  a group's prompt computed once (`appo.trainer.forward`), or with `actor.tree_forward`
  the whole token trie of its rows (branches' shared responses; `appo.trainer.tree_forward`);
- loss normalisers are counted once per mini-batch over all ranks (`appo.algos.LossAgg`),
  so the value and gradient do not depend on micro-batch or rank splits;
- rows without a trained token (APPO branch rows) never enter the loss;
- gradients are summed over ranks by torch's DDP (`appo.trainer.distributed.GradSync`: one
  all-reduce pass per optimizer step, in its last micro-batch's backward) or by FSDP;
- `future_kl`'s sequence filter (docs/algorithms.md §4.3) removes rows from the policy loss
  and its normaliser: after the update's first optimizer step the policy has moved, so a
  no-grad pass over the mini-batch decides the kept rows before its normaliser is counted
  (KL and entropy terms keep every row, as in the original). At the first step the ratio is
  1 up to recompute noise, far from the dual-clip bound `c > 1`, so no row can be filtered
  and no pass is needed.
With one PPO epoch and one mini-batch the behaviour log-probs are the detached log-probs of
the update's own forward (ratio 1 exactly): the separate no-grad pass verl runs would compute
the same. With more, that pass runs first (`needs_old_logp`).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch
from torch import Tensor

from appo.algos import (
    POLICY_LOSSES,
    LossAgg,
    PolicyLossParams,
    entropy_aware_advantage,
    entropy_bonus,
    future_kl_kept_rows,
    kl_loss,
    token_logprobs_and_entropy,
)
from appo.trainer.batch import TrainBatch
from appo.trainer.distributed import DataParallel, GradSync, check_grad_sync
from appo.trainer.forward import final_hidden_states, plan_shared_microbatches
from appo.trainer.fsdp import idle_forward, idle_step, to_float
from appo.trainer.guards import check_finite
from appo.trainer.memory import forward_allocations, sparse_embedding_grads
from appo.trainer.precision import autocast, head_inputs


def policy_loss_params(actor: Any) -> PolicyLossParams:
    """The policy loss's parameters from `actor.*`."""
    return PolicyLossParams(
        clip_low=actor.clip_ratio_low,
        clip_high=actor.clip_ratio_high,
        clip_c=actor.clip_ratio_c,
        entropy_clip_scope=actor.entropy_clip_scope,
        future_kl_decay_rate=actor.future_kl_decay_rate,
        future_kl_clip_high=actor.future_kl_clip_high,
        future_kl_clip_high_only=actor.future_kl_clip_high_only,
        future_kl_safety_thresh=actor.future_kl_safety_thresh,
        future_kl_coef=actor.future_kl_coef,
        future_kl_seq_filter=actor.future_kl_seq_filter,
    )


def kl_coef(actor: Any) -> float:
    return float(actor.kl_loss_coef) if actor.use_kl_loss else 0.0


def mini_batches(actor: Any, n_groups: int, dp: DataParallel) -> int:
    """Optimizer steps per epoch: `actor.ppo_mini_batch_size` prompt groups each (split over
    ranks), as many as the rank with the most groups needs, so all ranks agree."""
    per_mb = max(1, actor.ppo_mini_batch_size // dp.world)
    return max(1, dp.max_int(math.ceil(n_groups / per_mb)))


def needs_old_logp(actor: Any, batch: TrainBatch, dp: DataParallel) -> bool:
    """The update is off-policy after its first optimizer step (several epochs or several
    mini-batches): the behaviour log-probs must then come from a pass before it."""
    return actor.ppo_epochs > 1 or mini_batches(actor, len(set(batch.uids)), dp) > 1


def response_logprobs(model, batch: TrainBatch, chunk_size: int, with_entropy: bool,
                      entropy_grad: bool = False, share_prefix: bool = True,
                      temperature: float = 1.0, compute_dtype: torch.dtype | None = None,
                      tree: bool = False, head_grad_in_place: bool = False,
                      ) -> tuple[Tensor, Tensor | None, Tensor]:
    """Current-policy log-prob (and entropy) of every response token of `batch`.

    Returns logp `[b, R]`, entropy `[b, R]` or None, and the response mask `[b, R]` (1 on
    real response tokens), R = longest response. The logits are divided by `temperature`,
    the rollout's (as verl does; 1 for a greedy rollout). Log-probs come from the final hidden
    states and the lm_head weight in chunks (`appo.algos.token_logprobs_and_entropy`), so
    `[b, T, V]` logits never exist; the model itself computes logits for one position only.
    `compute_dtype`: float32 master weights computed in this dtype (`appo.trainer.precision`).
    `head_grad_in_place`: the head's weight gradient goes straight into its allocated `.grad`
    (`token_logprobs_and_entropy`'s `weight_grad_in_place`; `actor.grads_in_place`).
    """
    device = next(model.parameters()).device
    with autocast(device, compute_dtype):
        hidden = final_hidden_states(model, batch.input_ids, batch.lengths, share_prefix, tree)
    ids = batch.input_ids[:, : hidden.shape[1]].to(device)
    resp = batch.response_lens
    width = int(resp.max()) if len(batch) else 0
    # Response token j of row i sits at position prompt_len + j and is predicted from the
    # hidden state one position earlier.
    j = torch.arange(width)[None, :]
    valid = (j < resp[:, None]).to(torch.long)
    pos = (batch.prompt_lens[:, None] - 1 + j) * valid
    pos, valid = pos.to(device), valid.to(device)
    gathered = hidden.gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
    targets = ids.gather(1, (pos + 1).clamp(max=ids.shape[1] - 1)) * valid
    head = model.get_output_embeddings()
    gathered, weight, bias = head_inputs(gathered, head.weight, getattr(head, "bias", None),
                                         compute_dtype)
    logp, entropy = token_logprobs_and_entropy(
        gathered, weight, targets, bias=bias,
        temperature=temperature, chunk_size=chunk_size, with_entropy=with_entropy,
        entropy_grad=entropy_grad, weight_grad_in_place=head_grad_in_place,
    )
    logp = logp * valid
    if entropy is not None:
        entropy = entropy * valid
    return logp, entropy, valid


@torch.no_grad()
def batched_logprobs(model, batch: TrainBatch, max_tokens: int, chunk_size: int,
                     share_prefix: bool = True, temperature: float = 1.0,
                     compute_dtype: torch.dtype | None = None, tree: bool = False,
                     dp: DataParallel | None = None, fsdp: bool = False) -> Tensor:
    """No-grad response log-probs `[B, R]` of every row (old / reference policy),
    token-budgeted; zero past each row's response. `fsdp`: `model` is sharded, so every
    rank runs as many forwards (each gathers shards): idle ones for the ranks with fewer
    micro-batches."""
    out = torch.zeros_like(batch.loss_mask)
    plan = plan_shared_microbatches(batch.input_ids, batch.lengths, max_tokens, batch.uids,
                                    share_prefix, tree)
    for idx in plan.batches:
        logp, _, _ = response_logprobs(model, batch.select(idx), chunk_size, False,
                                       share_prefix=share_prefix, temperature=temperature,
                                       compute_dtype=compute_dtype, tree=tree)
        out[torch.tensor(idx), : logp.shape[1]] = logp.float().cpu()
    if fsdp and dp is not None:
        for _ in range(dp.max_int(len(plan.batches)) - len(plan.batches)):
            idle_forward(model)
    return out


def idle_logits(model) -> Tensor:
    """A one-token forward through the whole model (every parameter, the head included):
    the output of a synced pass that contributes nothing (`GradSync.idle`)."""
    device = next(model.parameters()).device
    return model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
                 logits_to_keep=1).logits


def zero_grads_first(params: list[torch.Tensor]) -> None:
    """Zero every gradient, allocating the missing ones now, before any activation: the
    gradients live through the whole update, and allocated by the first backward they land
    between freed activations and split the heap, so later micro-batches' activations no
    longer fit the holes and the heap grows (glibc). Accumulating into zeros gives the same
    values as a first backward that assigns."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


def update_policy(model, optimizer, batch: TrainBatch, actor: Any, max_response_length: int,
                  dp: DataParallel | None = None, scheduler=None,
                  fsdp: bool = False, temperature: float = 1.0,
                  compute_dtype: torch.dtype | None = None,
                  ddp: GradSync | None = None) -> dict[str, float]:
    """`actor.ppo_epochs` x mini-batches of this rank's rows; one optimizer step each.

    `batch` needs `advantages`, `ref_logp` with a KL term, and `old_logp` when
    `needs_old_logp` (without it the detached current log-probs stand in: exact for the
    first optimizer step only).
    `fsdp`: the model is sharded (`appo.trainer.fsdp`): every rank runs as many forward
    passes (idle ones if it has fewer micro-batches), FSDP reduces the gradients, and the
    shared-prefix and tree forwards are off (their number of model calls depends on the rows).
    `ddp`: the model's `DistributedDataParallel` wrapper (several processes without FSDP,
    built once by the trainer): micro-batches but the last of each optimizer step run under
    `no_sync`, the last one all-reduces, and a rank with no micro-batch in a mini-batch runs
    one empty synced pass.
    `temperature`: the rollout's sampling temperature, applied to the training logits.
    `compute_dtype`: the forwards' autocast dtype over float32 master weights, or None.
    """
    dp = dp or DataParallel()
    check_grad_sync(dp, fsdp, ddp, "update_policy")
    # Under FSDP the gradients are sharded and allocated by FSDP, and under DDP a gradient
    # written outside autograd never fires the hook its all-reduce waits for: no in-place
    # accumulation under either.
    in_place = actor.grads_in_place and not fsdp and ddp is None
    with sparse_embedding_grads(model, in_place):
        return _update(model, optimizer, batch, actor, max_response_length, dp,
                       scheduler, fsdp, temperature, compute_dtype, in_place, ddp)


def _update(model, optimizer, batch: TrainBatch, actor: Any, max_response_length: int,
            dp: DataParallel, scheduler, fsdp: bool, temperature: float,
            compute_dtype: torch.dtype | None, in_place: bool,
            ddp: GradSync | None) -> dict[str, float]:
    share_prefix = actor.share_prefix_forward and not fsdp
    tree = share_prefix and actor.tree_forward
    loss_params = policy_loss_params(actor)
    params = [p for p in model.parameters() if p.requires_grad]
    trainable = batch.trainable_rows()
    uid_order = list(dict.fromkeys(batch.uids))
    per_mb = max(1, actor.ppo_mini_batch_size // dp.world)
    n_mini = mini_batches(actor, len(uid_order), dp)
    sums: Counter = Counter()
    padded_total = real_total = rows_total = skipped = 0
    filters_rows = actor.policy_loss == "future_kl" and loss_params.future_kl_seq_filter
    model.train()
    for epoch in range(actor.ppo_epochs):
        for m in range(n_mini):
            mb_uids = set(uid_order[m * per_mb : (m + 1) * per_mb])
            mini = batch.select([i for i in trainable if batch.uids[i] in mb_uids])
            agg = _loss_agg(actor, mini.loss_mask, max_response_length, dp)
            keep = torch.ones(len(mini), dtype=torch.bool)
            pg_agg = agg
            if filters_rows and (epoch > 0 or m > 0):
                keep = _kept_rows(model, mini, actor, loss_params, share_prefix, temperature,
                                  compute_dtype, tree)
                sums["actor/future_kl_filtered_rows"] += float((~keep).sum())
                pg_agg = _loss_agg(actor, mini.loss_mask * keep[:, None], max_response_length,
                                   dp)
            plan = plan_shared_microbatches(mini.input_ids, mini.lengths,
                                            actor.ppo_max_token_len_per_device, mini.uids,
                                            share_prefix, tree)
            padded_total += plan.padded_tokens
            real_total += plan.real_tokens
            rows_total += plan.rows_tokens
            # FSDP gathers shards in every forward: all ranks must run as many (decided
            # before any of them runs, or the collectives would interleave).
            n_passes = dp.max_int(len(plan.batches)) if fsdp else len(plan.batches)
            if fsdp:  # sharded gradients: FSDP allocates them itself
                optimizer.zero_grad(set_to_none=True)
            else:
                zero_grads_first(params)
            # FSDP and DDP average gradients over ranks; the sum is wanted (trainer.fsdp).
            scale = float(dp.world) if fsdp or ddp is not None else 1.0
            for k, mb_idx in enumerate(plan.batches):
                sums.update(_micro_step(model, mini.select(mb_idx), actor, loss_params, agg,
                                        share_prefix, temperature, compute_dtype,
                                        pg_agg=pg_agg, tree=tree,
                                        keep=keep[mb_idx], in_place=in_place,
                                        loss_scale=scale, ddp=ddp,
                                        sync=k == len(plan.batches) - 1))
            if fsdp:
                for _ in range(n_passes - len(plan.batches)):
                    idle_step(model)
            elif ddp is not None and not plan.batches:  # sync once, as every rank does
                ddp.idle(idle_logits)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, actor.grad_clip)
            check_finite(**{"actor/grad_norm": to_float(grad_norm)})  # before the step
            # No learning signal on any rank (actor.skip_zero_advantage_steps): no step.
            if actor.skip_zero_advantage_steps and not dp.max_int(
                    int(bool((mini.advantages * mini.loss_mask).any()))):
                skipped += 1  # the same on every rank (decided by the all-reduce)
            else:
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
            sums["actor/grad_norm"] += to_float(grad_norm)
    model.eval()
    # Loss-valued metrics are shares of the mini-batch value (global normalisers): sum them
    # over micro-batches and ranks, then average over optimizer steps.
    if dp.enabled:
        merged: Counter = Counter()
        for part in dp.gather_objects([dict(sums)]):
            merged.update(part)
        grad_sum = sums["actor/grad_norm"]
        sums = merged
        sums["actor/grad_norm"] = grad_sum  # identical on every rank after the all-reduce
        real_total, padded_total, rows_total = dp.sum_floats(
            [float(real_total), float(padded_total), float(rows_total)])
    steps = max(actor.ppo_epochs * n_mini, 1)
    out = {k: v / steps for k, v in sums.items()}
    out["actor/padding_frac"] = 1.0 - real_total / padded_total if padded_total else 0.0
    # Share of the rows' tokens the shared-prefix (or tree) forward did not have to compute.
    out["actor/prefix_saving"] = 1.0 - padded_total / rows_total if rows_total else 0.0
    out["actor/computed_tokens"] = float(padded_total) / max(actor.ppo_epochs, 1)
    out["actor/optimizer_steps"] = float(steps)
    if actor.skip_zero_advantage_steps:
        out["actor/skipped_steps"] = float(skipped)
    return out


def _loss_agg(actor: Any, loss_mask: Tensor, max_response_length: int,
              dp: DataParallel) -> LossAgg:
    """The mini-batch's normalisers over every rank (`[B, R]` mask of this rank's rows)."""
    n_tok, n_seq = dp.sum_floats([float(loss_mask.sum()), float((loss_mask.sum(dim=1) > 0).sum())])
    return LossAgg(actor.loss_agg_mode, max(n_tok, 1.0), max(n_seq, 1.0),
                   float(max_response_length))


def _kept_rows(model, mini: TrainBatch, actor: Any, loss_params: PolicyLossParams,
               share_prefix: bool, temperature: float,
               compute_dtype: torch.dtype | None, tree: bool = False) -> Tensor:
    """Rows `[B]` of `mini` that `future_kl`'s sequence filter keeps under the current policy."""
    logp = batched_logprobs(model, mini, actor.ppo_max_token_len_per_device,
                            actor.logprob_chunk_size, share_prefix, temperature, compute_dtype,
                            tree)
    old = mini.old_logp if mini.old_logp is not None else logp
    return future_kl_kept_rows(logp, old, mini.advantages, mini.loss_mask, loss_params).cpu()


def _micro_step(model, mb: TrainBatch, actor: Any, loss_params: PolicyLossParams, agg: LossAgg,
                share_prefix: bool, temperature: float, compute_dtype: torch.dtype | None,
                pg_agg: LossAgg | None = None, tree: bool = False,
                keep: Tensor | None = None, in_place: bool = False,
                loss_scale: float = 1.0, ddp: GradSync | None = None,
                sync: bool = True) -> dict[str, float]:
    """One micro-batch's forward, loss and backward. `ddp`: the forward runs through it,
    all-reducing in the backward when `sync` (the optimizer step's last micro-batch)."""
    need_entropy = actor.entropy_balanced_advantage or actor.entropy_coeff != 0 or (
        actor.policy_loss == "entropy_balanced" and actor.entropy_clip_scope == "high_entropy"
    )

    def forward(m):
        return response_logprobs(
            m, mb, actor.logprob_chunk_size, with_entropy=need_entropy,
            entropy_grad=actor.entropy_coeff != 0, share_prefix=share_prefix,
            temperature=temperature, compute_dtype=compute_dtype, tree=tree,
            head_grad_in_place=in_place,
        )

    with forward_allocations():
        logp, entropy, valid = forward(model) if ddp is None else ddp.forward(forward, sync)
    device = logp.device
    mask = mb.loss_mask.to(device) * valid
    adv = mb.advantages.to(device)
    old = mb.old_logp.to(device) if mb.old_logp is not None else logp.detach()
    metrics: dict[str, float] = {}
    if actor.entropy_balanced_advantage:
        adv, m = entropy_aware_advantage(adv, entropy.detach(), mask,
                                         alpha=actor.entropy_advantage_alpha)
        metrics.update({f"actor/{k}": v * float(mask.sum()) / agg.n_tokens for k, v in m.items()})
    # The policy loss sees only the rows the sequence filter kept (all rows without it).
    pg_mask = mask if keep is None else mask * keep.to(device)[:, None]
    loss, m = POLICY_LOSSES[actor.policy_loss](
        logp, old, adv, pg_mask, agg=pg_agg or agg, params=loss_params,
        entropy=None if entropy is None else entropy.detach(),
    )
    metrics.update({f"actor/{k}": v for k, v in m.items()})
    metrics["actor/pg_loss"] = float(loss.detach())
    coef = kl_coef(actor)
    if coef != 0:
        kl, _ = kl_loss(logp, mb.ref_logp.to(device), mask, agg=agg, kind=actor.kl_loss_type)
        loss = loss + coef * kl
        metrics["actor/kl"] = float(kl.detach())
    if entropy is not None:
        ent, _ = entropy_bonus(entropy, mask, agg=agg)
        metrics["actor/entropy"] = float(ent.detach())
        if actor.entropy_coeff != 0:
            loss = loss - actor.entropy_coeff * ent
    (loss * loss_scale).backward()
    return metrics
