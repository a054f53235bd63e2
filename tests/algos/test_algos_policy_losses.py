"""Policy losses: hand-computed tokens, entropy-balanced gradients, future-KL vs a naive loop."""

from __future__ import annotations

import math
import random

import pytest
import torch

from appo.algos import (
    LossAgg,
    MaskedStats,
    PolicyLossParams,
    discounted_future_sum,
    entropy_balanced_policy_loss,
    future_kl_kept_rows,
    future_kl_policy_loss,
    vanilla_policy_loss,
)
from appo.errors import AppoError

E = math.e


def one_token(log_ratio: float, adv: float, fn=vanilla_policy_loss, **params):
    """Loss and d loss / d logp of a single token (token-mean over one token = its loss)."""
    logp = torch.tensor([[0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-log_ratio]], dtype=torch.float64)
    mask = torch.ones(1, 1)
    agg = LossAgg.from_masks("token-mean", mask)
    loss, metrics = fn(logp, old, torch.tensor([[adv]], dtype=torch.float64), mask,
                       agg=agg, params=PolicyLossParams(**params))
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


@pytest.mark.parametrize(
    "log_ratio, adv, expected_loss, expected_grad, clipped, dual",
    [
        # r = e, A = 1: max(-e, -1.2) = -1.2 (clipped at the top, no gradient)
        (1.0, 1.0, -1.2, 0.0, 1.0, 0.0),
        # r = e, A = -1: max(e, 1.2) = e; dual bound -A c = 3 > e -> e; grad -A r = e
        (1.0, -1.0, E, E, 0.0, 0.0),
        # r = e^2 = 7.389, A = -1: max(7.389, 1.2) = 7.389 > 3 -> dual clip 3, no gradient
        (2.0, -1.0, 3.0, 0.0, 0.0, 1.0),
        # r = 1/e = 0.3679, A = 1: max(-0.3679, -0.8) = -0.3679 (low clip not for A > 0)
        (-1.0, 1.0, -1 / E, -1 / E, 0.0, 0.0),
        # r = 1/e, A = -1: max(0.3679, 0.8) = 0.8 (clipped at the bottom, no gradient)
        (-1.0, -1.0, 0.8, 0.0, 1.0, 0.0),
        # r = 1, A = 2: -2, grad -A r = -2
        (0.0, 2.0, -2.0, -2.0, 0.0, 0.0),
    ],
)
def test_vanilla_hand_computed(log_ratio, adv, expected_loss, expected_grad, clipped, dual):
    loss, grad, metrics = one_token(log_ratio, adv)
    assert loss == pytest.approx(expected_loss, abs=1e-9)
    assert grad == pytest.approx(expected_grad, abs=1e-9)
    assert metrics["pg_clipfrac"] == clipped
    assert metrics["pg_clipfrac_lower"] == dual
    assert metrics["ppo_kl"] == pytest.approx(-log_ratio)


def test_vanilla_clip_higher_and_dual_clip_constant():
    # clip_ratio_high 0.28: r = e, A = 1 -> -1.28
    assert one_token(1.0, 1.0, clip_high=0.28)[0] == pytest.approx(-1.28)
    # clip_ratio_c 5: r = e^2 = 7.389, A = -1 -> min(7.389, 5) = 5
    assert one_token(2.0, -1.0, clip_c=5.0)[0] == pytest.approx(5.0)
    # clip_ratio_low 0.1: r = 1/e, A = -1 -> max(0.3679, 0.9) = 0.9
    assert one_token(-1.0, -1.0, clip_low=0.1)[0] == pytest.approx(0.9)


def random_batch(seed: int, size=(4, 12), spread=1.0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(size, generator=gen, dtype=dtype) * 3).requires_grad_(True)
    old = logp.detach() + spread * torch.randn(size, generator=gen, dtype=dtype)
    adv = torch.randn(size, generator=gen, dtype=dtype)
    mask = (torch.rand(size, generator=gen) < 0.8).float()
    entropy = torch.rand(size, generator=gen, dtype=dtype) * 4
    return logp, old, adv, mask, entropy


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scope", ["all", "high_entropy"])
def test_entropy_balanced_value_equals_vanilla_and_gradient_only_changes_on_top_clip(seed, scope):
    logp, old, adv, mask, entropy = random_batch(seed)
    agg = LossAgg.from_masks("token-mean", mask)
    params = PolicyLossParams(clip_high=0.28, entropy_clip_scope=scope)
    v_loss, _ = vanilla_policy_loss(logp, old, adv, mask, agg=agg, params=params)
    (v_grad,) = torch.autograd.grad(v_loss, logp)
    e_loss, metrics = entropy_balanced_policy_loss(logp, old, adv, mask, agg=agg, params=params,
                                                   entropy=entropy)
    (e_grad,) = torch.autograd.grad(e_loss, logp)
    assert e_loss.item() == pytest.approx(v_loss.item(), abs=1e-12)

    ratio = (logp - old).exp().detach()
    top = (ratio > 1.28) & (adv > 0) & mask.bool()
    if scope == "high_entropy":
        top &= entropy > MaskedStats.of(entropy, mask).mean
    assert top.any(), "the random batch must contain top-clipped tokens"
    # token-mean: d loss / d logp_t = (1 + eps_high) * (-A_t) / n_tokens on those tokens
    torch.testing.assert_close(e_grad[top], (1.28 * -adv / agg.n_tokens)[top])
    assert (v_grad[top] == 0).all()
    torch.testing.assert_close(e_grad[~top], v_grad[~top])
    assert metrics["clip_grad_kept_frac"] == pytest.approx(float(top.sum()) / agg.n_tokens)


def test_entropy_balanced_gradient_reaches_parameters_as_scaled_logp_gradient():
    # A tiny softmax policy: logits = x @ W. One token, pushed far above the clip range.
    torch.manual_seed(0)
    x = torch.randn(1, 3, dtype=torch.float64)
    w = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    target = 2
    logp = torch.log_softmax(x @ w, -1)[:, target].reshape(1, 1)
    (dlogp,) = torch.autograd.grad(logp.sum(), w, retain_graph=True)
    old = logp.detach() - 1.0  # r = e > 1.2
    adv, eps_high = 0.7, 0.2
    mask = torch.ones(1, 1)
    loss, _ = entropy_balanced_policy_loss(
        logp, old, torch.tensor([[adv]], dtype=torch.float64), mask,
        agg=LossAgg.from_masks("token-mean", mask), params=PolicyLossParams(clip_high=eps_high))
    (grad,) = torch.autograd.grad(loss, w)
    assert loss.item() == pytest.approx(-adv * (1 + eps_high))
    torch.testing.assert_close(grad, (1 + eps_high) * (-adv) * dlogp)


def test_entropy_balanced_high_entropy_scope_needs_entropy():
    logp, old, adv, mask, _ = random_batch(0)
    with pytest.raises(AppoError, match="high_entropy"):
        entropy_balanced_policy_loss(logp, old, adv, mask,
                                     agg=LossAgg.from_masks("token-mean", mask),
                                     params=PolicyLossParams(entropy_clip_scope="high_entropy"))


# ---------------------------------------------------------------- future KL


def test_future_kl_hand_computed():
    # decay_rate 1 -> g = 0.5. d = [0.1, 2.0, 0.2]; ln c = ln 3 = 1.0986, so token 1 does not
    # participate. FutureKL_0 = 0.1 + 0.5 * 0 + 0.25 * 0.2 = 0.15; FutureKL_1 = 0.5 * 0.2 = 0.1;
    # FutureKL_2 = 0.2. f = clamp(exp(.), 1, 1.2) = 1.161834, 1.105171, 1.2.
    # A = [1, -1, 1]; token 1 has A < 0 and r = e^2 = 7.389 > 6 -> f clamped to [0.8, 1] = 1.
    # A' = A (1 + f) = 2.161834, -2, 2.2.
    # token 0: r = e^0.1 = 1.105171 inside [0.8, 1.2] -> -2.161834 * 1.105171 = -2.389195
    # token 1: max(2 * 7.389, 2 * 1.2) = 14.778 > dual bound -A' c = 6 -> 6
    # token 2: r = e^0.2 = 1.221403 > 1.2 -> max(-2.2 * 1.221403, -2.2 * 1.2) = -2.64
    # token-mean = (-2.389195 + 6 - 2.64) / 3 = 0.323602
    logp = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    old = -torch.tensor([[0.1, 2.0, 0.2]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3)
    params = PolicyLossParams(future_kl_decay_rate=1.0)
    loss, metrics = future_kl_policy_loss(logp, old, adv, mask,
                                          agg=LossAgg.from_masks("token-mean", mask), params=params)
    f0 = math.exp(0.15)
    expected = (-(1 + f0) * math.exp(0.1) + 6.0 - 2.2 * 1.2) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-9)
    assert loss.item() == pytest.approx(0.323602, abs=1e-6)
    assert metrics["future_kl_participation"] == pytest.approx(2 / 3)
    assert metrics["future_kl_safety_frac"] == pytest.approx(1 / 3)
    assert metrics["future_kl"] == pytest.approx((0.15 + 0.1 + 0.2) / 3)


def naive_future_kl_loss(logp, old, adv, mask, p: PolicyLossParams) -> float:
    """Token-mean future-KL loss with plain Python loops (docs/algorithms.md §4.3), the
    sequence filter included: a row with more than one dual-clip hit is dropped from the sum
    and from the token count."""
    g = 2.0 ** (-1.0 / p.future_kl_decay_rate)
    lo = 1.0 if p.future_kl_clip_high_only else 2.0 - p.future_kl_clip_high
    total, count = 0.0, 0
    size, width = len(logp), len(logp[0])
    for b in range(size):
        d = [min(max(logp[b][k] - old[b][k], -20.0), 20.0) for k in range(width)]
        row_total, row_count, hits = 0.0, 0, 0
        for t in range(width):
            if not mask[b][t]:
                continue
            fkl = sum(g ** (k - t) * d[k] for k in range(t, width)
                      if mask[b][k] and d[k] <= math.log(p.clip_c))
            f = min(max(math.exp(fkl), lo), p.future_kl_clip_high)
            r = math.exp(d[t])
            if adv[b][t] < 0 and r > p.future_kl_safety_thresh:
                f = min(max(f, 0.8), 1.0)
            a = adv[b][t] * (1 + p.future_kl_coef * f)
            loss = max(-a * r, -a * min(max(r, 1 - p.clip_low), 1 + p.clip_high))
            if a < 0:
                hits += loss > -a * p.clip_c
                loss = min(loss, -a * p.clip_c)
            row_total += loss
            row_count += 1
        if p.future_kl_seq_filter and hits > 1:
            continue
        total += row_total
        count += row_count
    return total / count


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("decay_rate", [0.5, 4.0, 64.0, 1000.0])
@pytest.mark.parametrize("clip_high_only", [True, False])
@pytest.mark.parametrize("seq_filter", [True, False])
def test_future_kl_equals_naive_loop(seed, decay_rate, clip_high_only, seq_filter):
    logp, old, adv, mask, _ = random_batch(seed, size=(3, 15), spread=1.2)
    # Plant one token of each kind so both clamps are hit whatever the seed: r = e^2.5 = 12.2
    # with A < 0 (no participation, safety clamp), r = e^1.5 = 4.5 with A > 0 (no participation).
    old[0, 3], adv[0, 3], mask[0, 3] = logp[0, 3].item() - 2.5, -0.9, 1.0
    old[1, 5], adv[1, 5], mask[1, 5] = logp[1, 5].item() - 1.5, 0.4, 1.0
    # Row 2 gets two dual-clip hits (r = e^2 with A < 0), so the filter drops it.
    for t in (2, 9):
        old[2, t], adv[2, t], mask[2, t] = logp[2, t].item() - 2.0, -0.5, 1.0
    params = PolicyLossParams(clip_high=0.28, future_kl_decay_rate=decay_rate,
                              future_kl_clip_high_only=clip_high_only, future_kl_coef=0.7,
                              future_kl_seq_filter=seq_filter)
    kept = future_kl_kept_rows(logp, old, adv, mask, params)
    assert bool(kept[2]) is not seq_filter
    agg = LossAgg.from_masks("token-mean", mask * kept[:, None])
    loss, metrics = future_kl_policy_loss(logp, old, adv, mask, agg=agg, params=params)
    expected = naive_future_kl_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(),
                                    params)
    assert loss.item() == pytest.approx(expected, rel=1e-9, abs=1e-9)
    # Both clamps are exercised by these inputs.
    drift = (logp - old).detach()
    assert (mask.bool() & (drift > math.log(3.0))).any()  # non-participating tokens
    assert (mask.bool() & (adv < 0) & (drift.exp() > 6.0)).any()  # safety clamp
    assert 0 < metrics["future_kl_participation"] < 1
    # Metrics cover the kept rows: the safety-clamped token of row 0 counts unless row 0 has
    # a second dual-clip hit (some seeds) and the filter drops it.
    assert (metrics["future_kl_safety_frac"] > 0) is bool(kept[0])
    assert metrics["future_kl_filtered_rows"] == float((~kept).sum())


def test_future_kl_sequence_filter_hand_computed():
    """The original's filter: a row with more than one dual-clip hit leaves the loss and the
    token-mean normaliser. c = 3; every kept token has r = 1 or a non-participating r > 3, so
    FutureKL = 0, f = clamp(e^0, 1, 1.2) = 1 and A' = 2A (the safety clamp keeps f = 1).

    row 0: A = -1, r = [4, 1, 5, 1]: two hits (r > c)          -> removed
    row 1: A = -1, r = [4, 1, 1, 1]: one hit                    -> kept
           t0: max(2 * 4, 2 * 1.28) = 8 > -A' c = 6 -> 6 (constant, no gradient)
           t1-t3: -A' r = 2 each; d/dlogp = -A' r = 2
    row 2: A = 0.5, r = 1 on 3 valid tokens: -A' r = -1 each; d/dlogp = -1
    token-mean over the 7 kept tokens: (6 + 2 + 2 + 2 - 1 - 1 - 1) / 7 = 9/7
    (without the filter, 11 tokens: row 0 adds 6 + 2 + 6 + 2: (16 + 9) / 11 = 25/11)
    """
    logp = torch.zeros(3, 4, dtype=torch.float64, requires_grad=True)
    ratios = torch.tensor([[4.0, 1, 5, 1], [4, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.float64)
    old = -ratios.log()
    adv = torch.tensor([[-1.0] * 4, [-1.0] * 4, [0.5] * 4], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]])
    params = PolicyLossParams(clip_high=0.28)
    kept = future_kl_kept_rows(logp, old, adv, mask, params)
    assert kept.tolist() == [False, True, True]
    agg = LossAgg.from_masks("token-mean", mask * kept[:, None])
    assert agg.n_tokens == 7
    loss, metrics = future_kl_policy_loss(logp, old, adv, mask, agg=agg, params=params)
    assert loss.item() == pytest.approx(9 / 7, abs=1e-12)
    assert metrics["future_kl_filtered_rows"] == 1.0
    (grad,) = torch.autograd.grad(loss, logp)
    expected = torch.tensor([[0.0, 0, 0, 0], [0, 2, 2, 2], [-1, -1, -1, 0]],
                            dtype=torch.float64) / 7
    torch.testing.assert_close(grad, expected)
    # Off, row 0 stays: the original's filter is what makes the difference.
    off = PolicyLossParams(clip_high=0.28, future_kl_seq_filter=False)
    assert future_kl_kept_rows(logp, old, adv, mask, off).all()
    loss_off, _ = future_kl_policy_loss(logp, old, adv, mask,
                                        agg=LossAgg.from_masks("token-mean", mask), params=off)
    assert loss_off.item() == pytest.approx(25 / 11, abs=1e-12)


def test_discounted_future_sum_equals_naive_loop_across_blocks():
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(2, 37, generator=gen, dtype=torch.float64)
    for gamma in (0.0, 0.5, 0.99, 1.0):
        out = discounted_future_sum(values, gamma, block=8)  # 5 blocks, the last one short
        expected = [[sum(gamma ** (k - t) * row[k] for k in range(t, len(row)))
                     for t in range(len(row))] for row in values.tolist()]
        torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))


def test_future_kl_gradient_is_ppo_gradient_with_scaled_advantage():
    # f is stop-gradient: the gradient is that of vanilla PPO on A' = A (1 + f).
    rng = random.Random(1)
    logp, old, adv, mask, _ = random_batch(rng.randint(0, 99), spread=0.3)
    agg = LossAgg.from_masks("token-mean", mask)
    params = PolicyLossParams()
    loss, _ = future_kl_policy_loss(logp, old, adv, mask, agg=agg, params=params)
    (grad,) = torch.autograd.grad(loss, logp)
    gamma = 2 ** (-1 / params.future_kl_decay_rate)
    drift = (logp - old).detach()
    participating = mask.bool() & (drift <= math.log(3))
    fkl = discounted_future_sum(torch.where(participating, drift, 0.0), gamma)
    f = fkl.exp().clamp(1.0, 1.2)
    f = torch.where((adv < 0) & (drift.exp() > 6), f.clamp(0.8, 1.0), f)
    v_loss, _ = vanilla_policy_loss(logp, old, adv * (1 + f), mask, agg=agg, params=params)
    (v_grad,) = torch.autograd.grad(v_loss, logp)
    torch.testing.assert_close(loss, v_loss)
    torch.testing.assert_close(grad, v_grad)


def test_bad_loss_params_name_the_config_key():
    with pytest.raises(AppoError, match="actor.clip_ratio_c"):
        PolicyLossParams(clip_c=1.0)
    with pytest.raises(AppoError, match="actor.entropy_clip_scope"):
        PolicyLossParams(entropy_clip_scope="some")
    with pytest.raises(AppoError, match=r"\[B, T\]"):
        vanilla_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 3),
                            agg=LossAgg("token-mean", 1, 1))
