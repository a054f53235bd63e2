"""future_kl's sequence filter inside the update: rows filtered under the moved policy leave
the policy loss and its normaliser, whatever the micro-batching (docs/algorithms.md §4.3)."""

from __future__ import annotations

import copy

import torch
from test_trainer_rl import _batch, _fixed_lists

from appo.algos import LossAgg, future_kl_kept_rows, future_kl_policy_loss
from appo.config import ActorConfig
from appo.models import load_model
from appo.trainer.update import (
    batched_logprobs,
    policy_loss_params,
    response_logprobs,
    update_policy,
)

LR = 1.0  # large enough that after step 1 the repeated row of group u1 has r > c = 3


def _two_groups(tok):
    """Group u0: rows 0-1 with A = +1 (step 1 raises their tokens' probability); group u1:
    a copy of row 0 and row 3, both with A = -1. After step 1 the copy of row 0 has many
    tokens with r > 3 and A < 0 (dual-clip hits): the filter drops it; row 3 stays."""
    rows = _fixed_lists(tok, n=4)
    picked = {k: [] for k in rows}
    for i, uid, adv in ((0, "u0", 1.0), (1, "u0", 1.0), (0, "u1", -1.0), (3, "u1", -1.0)):
        for k in rows:
            picked[k].append(rows[k][i])
        picked["advantages"][-1] = [adv] * len(rows["advantages"][i])
        picked["uids"][-1] = uid
    return _batch(**picked, pad_id=tok.pad_token_id)


def _reference(model, batch, actor) -> int:
    """Plain loop: one optimizer step per group on the whole group at once; the filter and
    the token-mean normaliser from the kept rows. Returns the number of filtered rows."""
    params = policy_loss_params(actor)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    filtered = 0
    for uid in ("u0", "u1"):
        mini = batch.select([i for i, u in enumerate(batch.uids) if u == uid])
        logp, _, valid = response_logprobs(model, mini, actor.logprob_chunk_size, False)
        mask = mini.loss_mask[:, : logp.shape[1]] * valid
        old = mini.old_logp[:, : logp.shape[1]]
        adv = mini.advantages[:, : logp.shape[1]]
        kept = future_kl_kept_rows(logp.detach(), old, adv, mask, params)
        filtered += int((~kept).sum())
        kept_mask = mask * kept[:, None]
        loss, _ = future_kl_policy_loss(logp, old, adv, kept_mask, params=params,
                                        agg=LossAgg.from_masks("token-mean", kept_mask))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), actor.grad_clip)
        opt.step()
    return filtered


def test_filtered_rows_leave_the_loss_and_its_normaliser():
    lm = load_model("tiny-test")
    batch = _two_groups(lm.tokenizer)
    batch.old_logp = batched_logprobs(lm.model, batch, 4096, 128)
    ref_model = copy.deepcopy(lm.model)
    actor = ActorConfig(policy_loss="future_kl", ppo_mini_batch_size=1)  # one group each
    assert _reference(ref_model, batch, actor) == 1  # the input does exercise the filter
    for budget in (100_000, 40):  # one micro-batch per group, or several
        model = copy.deepcopy(lm.model)
        small = ActorConfig(policy_loss="future_kl", ppo_mini_batch_size=1,
                            ppo_max_token_len_per_device=budget)
        out = update_policy(model, torch.optim.SGD(model.parameters(), lr=LR), batch, small,
                            max_response_length=64)
        assert out["actor/future_kl_filtered_rows"] == 0.5  # 1 row over 2 optimizer steps
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    # Off, the copy of row 0 stays in the second step's loss: a different update.
    off = copy.deepcopy(lm.model)
    update_policy(off, torch.optim.SGD(off.parameters(), lr=LR), batch,
                  ActorConfig(policy_loss="future_kl", ppo_mini_batch_size=1,
                              future_kl_seq_filter=False), max_response_length=64)
    assert any(not torch.allclose(p, q, atol=1e-4)
               for p, q in zip(off.parameters(), ref_model.parameters(), strict=True))
