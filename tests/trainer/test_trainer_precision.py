"""bfloat16 training with float32 master weights (appo.trainer.precision), as verl's actor."""

from __future__ import annotations

import copy

import pytest
import torch
from test_trainer_rl import _fixed_rows

from appo.config import ActorConfig, load_config
from appo.models import load_model
from appo.trainer.precision import master_dtype, train_compute_dtype
from appo.trainer.update import batched_logprobs, update_policy


def _changed_fraction(before, after) -> float:
    changed = total = 0
    for p, q in zip(before.parameters(), after.parameters(), strict=True):
        if q.grad is None or not q.requires_grad:
            continue
        moved = p.detach().float() != q.detach().float()
        has_grad = q.grad.detach() != 0
        changed += int((moved & has_grad).sum())
        total += int(has_grad.sum())
    return changed / max(total, 1)


def test_one_small_adamw_step_moves_float32_masters_but_not_bfloat16_weights():
    """AdamW's first step moves every weight with a gradient by ~lr = 1e-6. A float32 weight
    of size ~0.02 has spacing ~2e-9 and moves; a bfloat16 one has spacing ~1.2e-4 (8 bits of
    mantissa), so the step rounds away: the bug the float32 masters fix."""
    lm = load_model("tiny-test")
    rows = _fixed_rows(lm.tokenizer)
    actor = ActorConfig(ppo_mini_batch_size=16)
    fractions = {}
    for name, dtype, compute in (("master", torch.float32, torch.bfloat16),
                                 ("bf16", torch.bfloat16, None)):
        start = copy.deepcopy(lm.model).to(dtype)
        model = copy.deepcopy(start)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        update_policy(model, opt, rows, actor, max_response_length=384, compute_dtype=compute)
        assert next(model.parameters()).dtype == dtype
        fractions[name] = _changed_fraction(start, model)
    assert fractions["master"] > 0.9
    assert fractions["bf16"] < 0.1


@pytest.mark.parametrize("share_prefix", [True, False])
def test_bfloat16_forward_over_float32_masters_is_the_bfloat16_model(share_prefix):
    """The autocast forward of float32 masters gives the log-probs of the bfloat16 model up to
    bfloat16 rounding, and differs from the float32 forward by about that much."""
    lm = load_model("tiny-test")
    rows = _fixed_rows(lm.tokenizer)
    fp32 = batched_logprobs(lm.model, rows, 4096, 128, share_prefix)
    mixed = batched_logprobs(lm.model, rows, 4096, 128, share_prefix,
                             compute_dtype=torch.bfloat16)
    bf16 = batched_logprobs(copy.deepcopy(lm.model).to(torch.bfloat16), rows, 4096, 128,
                            share_prefix)
    mask = rows.loss_mask > 0
    assert mixed.dtype == torch.float32
    assert (mixed - bf16)[mask].abs().max() < 0.1
    assert (mixed - fp32)[mask].abs().max() < 0.1
    assert (mixed - fp32)[mask].abs().max() > 0  # it did compute in bfloat16


def test_config_selects_the_master_weights():
    cfg = load_config(overrides=["model.dtype=bfloat16"])
    assert master_dtype(cfg) == "float32" and train_compute_dtype(cfg) == torch.bfloat16
    off = load_config(overrides=["model.dtype=bfloat16", "actor.fp32_master_weights=false"])
    assert master_dtype(off) == "bfloat16" and train_compute_dtype(off) is None
    assert train_compute_dtype(load_config()) is None  # float32: nothing to do


def test_bfloat16_training_run_keeps_float32_masters_and_a_bfloat16_reference(tmp_path):
    from test_trainer_rl import make_toy, toy_config

    from appo.trainer.loop import RLTrainer

    cfg = toy_config(make_toy(tmp_path), "model.dtype=bfloat16", "actor.use_kl_loss=true",
                     "actor.kl_loss_coef=0.001", "rollout.strategy=grpo",
                     "trainer.total_steps=2", "actor.ppo_mini_batch_size=1")
    trainer = RLTrainer(cfg, progress=False)
    assert next(trainer.model.parameters()).dtype == torch.float32
    assert next(trainer.ref_model.parameters()).dtype == torch.bfloat16
    start = copy.deepcopy(trainer.model)
    trainer.fit()
    assert trainer.step == 2
    assert any(not torch.equal(p, q) for p, q in
               zip(start.parameters(), trainer.model.parameters(), strict=True))
