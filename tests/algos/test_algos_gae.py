"""GAE over tool trajectories and the clipped value loss: hand values, a naive loop, invariances."""

from __future__ import annotations

import pytest
import torch

from appo.algos import (
    ADV_ESTIMATORS,
    AdvantageParams,
    LossAgg,
    clipped_value_loss,
    gae_advantages_and_returns,
    masked_whiten,
    outcome_token_rewards,
)
from appo.errors import AppoError


def test_six_tokens_with_one_tool_result_by_hand():
    # Tokens 0 1 [2 3 = tool result] 4 5; score 1 on token 5; gamma 0.9, lam 0.5 (gl = 0.45).
    # The tool tokens' values (9) must not enter. Decision values V = 0.5, 0.4, 0.6, 0.8:
    #   delta(t5) = 1 + 0.9*0   - 0.8 =  0.2
    #   delta(t4) = 0 + 0.9*0.8 - 0.6 =  0.12
    #   delta(t1) = 0 + 0.9*0.6 - 0.4 =  0.14   (t4's value bootstraps across the result)
    #   delta(t0) = 0 + 0.9*0.4 - 0.5 = -0.14
    #   A(t5) = 0.2; A(t4) = 0.12 + 0.45*0.2 = 0.21; A(t1) = 0.14 + 0.45*0.21 = 0.2345;
    #   A(t0) = -0.14 + 0.45*0.2345 = -0.034475
    #   returns = A + V: 0.465525, 0.6345, 0.81, 1.0
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1]])
    values = torch.tensor([[0.5, 0.4, 9.0, 9.0, 0.6, 0.8]])
    rewards = outcome_token_rewards(torch.tensor([1.0]), mask)
    assert rewards.tolist() == [[0, 0, 0, 0, 0, 1.0]]
    adv, ret = gae_advantages_and_returns(rewards, values, mask, gamma=0.9, lam=0.5,
                                          whiten=False)
    assert adv[0].tolist() == pytest.approx([-0.034475, 0.2345, 0, 0, 0.21, 0.2], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([0.465525, 0.6345, 0, 0, 0.81, 1.0], abs=1e-6)


def _naive(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
           lam: float) -> tuple[list[list[float]], list[list[float]]]:
    """Per row: the decision tokens, their step rewards (rewards from a decision up to the
    next one), then A_k = sum_l (gamma lam)^l delta_{k+l} written out as a double loop."""
    advs, rets = [], []
    for r, v, m in zip(rewards.tolist(), values.tolist(), mask.tolist(), strict=True):
        steps = [t for t, x in enumerate(m) if x]
        bounds = steps[1:] + [len(m)]
        step_r = [sum(r[a:b]) for a, b in zip(steps, bounds, strict=True)]
        step_v = [v[t] for t in steps] + [0.0]
        deltas = [step_r[k] + gamma * step_v[k + 1] - step_v[k] for k in range(len(steps))]
        adv_row, ret_row = [0.0] * len(m), [0.0] * len(m)
        for k, t in enumerate(steps):
            a = 0.0
            for j in range(k, len(steps)):
                a += (gamma * lam) ** (j - k) * deltas[j]
            adv_row[t], ret_row[t] = a, a + step_v[k]
        advs.append(adv_row)
        rets.append(ret_row)
    return advs, rets


def _random_tool_batch(seed: int, rows: int = 5, width: int = 24):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, width)
    for i in range(rows):
        length = int(torch.randint(4, width + 1, (1,), generator=g))
        mask[i, length:] = 0
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):  # tool-result spans
            start = int(torch.randint(1, max(length - 1, 2), (1,), generator=g))
            mask[i, start : start + int(torch.randint(1, 5, (1,), generator=g))] = 0
    # Rewards anywhere, tool tokens included (they count for the decision before them).
    rewards = torch.randn(rows, width, generator=g) * (torch.rand(rows, width, generator=g) < .3)
    values = torch.randn(rows, width, generator=g)
    return rewards, values, mask


@pytest.mark.parametrize("seed, gamma, lam", [(0, 1.0, 1.0), (1, 0.9, 0.95), (2, 0.7, 0.3),
                                              (3, 1.0, 0.0)])
def test_matches_a_naive_loop_on_random_tool_trajectories(seed, gamma, lam):
    rewards, values, mask = _random_tool_batch(seed)
    adv, ret = gae_advantages_and_returns(rewards, values, mask, gamma=gamma, lam=lam,
                                          whiten=False)
    want_adv, want_ret = _naive(rewards, values, mask, gamma, lam)
    assert torch.allclose(adv, torch.tensor(want_adv), atol=1e-5)
    assert torch.allclose(ret, torch.tensor(want_ret), atol=1e-5)


@pytest.mark.parametrize("whiten", [False, True])
def test_tool_tokens_change_nothing_beyond_the_recursion(whiten):
    # Remove every tool-result token from each row: the model tokens keep exactly their
    # advantages and returns (whitening is over the same model tokens).
    rewards, values, mask = _random_tool_batch(7)
    rewards = rewards * mask  # here rewards sit on model tokens only, as in appo
    adv, ret = gae_advantages_and_returns(rewards, values, mask, gamma=0.95, lam=0.9,
                                          whiten=whiten)
    keep = [m.bool() for m in mask]
    width = max(int(k.sum()) for k in keep)
    squeeze = torch.zeros(len(keep), width)
    packed = [squeeze.clone() for _ in range(3)]
    for i, k in enumerate(keep):
        for tensor, out in zip((rewards, values, mask), packed, strict=True):
            out[i, : int(k.sum())] = tensor[i][k]
    adv2, ret2 = gae_advantages_and_returns(*packed, gamma=0.95, lam=0.9, whiten=whiten)
    for i, k in enumerate(keep):
        n = int(k.sum())
        assert torch.allclose(adv[i][k], adv2[i, :n], atol=1e-6)
        assert torch.allclose(ret[i][k], ret2[i, :n], atol=1e-6)
    # And the result values themselves never matter.
    noisy = torch.where(mask.bool(), values, values + 100.0)
    adv3, _ = gae_advantages_and_returns(rewards, noisy, mask, gamma=0.95, lam=0.9, whiten=whiten)
    assert torch.equal(adv3, adv)


def test_gamma_lam_one_is_return_minus_value():
    # With gamma = lam = 1 the advantage telescopes to (score - V_t) on every decision token.
    mask = torch.tensor([[1.0, 0, 1, 1, 0], [1, 1, 1, 0, 0]])
    values = torch.rand(2, 5)
    scores = torch.tensor([2.0, -1.0])
    adv, ret = gae_advantages_and_returns(outcome_token_rewards(scores, mask), values, mask,
                                          whiten=False)
    want = torch.where(mask.bool(), scores[:, None] - values, 0.0)
    assert torch.allclose(adv, want, atol=1e-6)
    assert torch.allclose(ret, scores[:, None] * mask, atol=1e-6)


def test_whitening_over_masked_tokens():
    x = torch.tensor([[1.0, 2.0, 50.0], [3.0, 4.0, -7.0]])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 0]])
    w = masked_whiten(x, mask)
    # Over 1,2,3,4: mean 2.5, unbiased var 5/3 -> (x - 2.5) / sqrt(5/3 + 1e-8).
    assert w[:, :2].flatten().tolist() == pytest.approx(
        [(v - 2.5) / (5 / 3 + 1e-8) ** 0.5 for v in (1, 2, 3, 4)], rel=1e-6)
    assert w[:, 2].tolist() == [0.0, 0.0]


def test_gae_estimator_in_the_registry():
    mask = torch.tensor([[1.0, 1, 0, 1], [1, 1, 1, 0]])
    values = torch.rand(2, 4)
    scores = torch.tensor([1.0, 0.0])
    params = AdvantageParams(gamma=0.9, lam=0.8, gae_whiten=True)
    adv, metrics = ADV_ESTIMATORS["gae"](scores, mask, ["a", "a"], params=params, values=values)
    want, _ = gae_advantages_and_returns(outcome_token_rewards(scores, mask), values, mask,
                                         gamma=0.9, lam=0.8, whiten=True)
    assert torch.equal(adv, want)
    assert adv[mask.bool()].mean().abs() < 1e-6
    assert "returns_mean" in metrics
    # Values equal to the returns (gamma = lam = 1: the score) explain all their variance.
    exact = torch.where(mask.bool(), scores[:, None], 0.0)
    _, m = ADV_ESTIMATORS["gae"](scores, mask, ["a", "a"], params=AdvantageParams(), values=exact)
    assert m["vf_explained_var"] == pytest.approx(1.0)
    with pytest.raises(AppoError, match="value model"):
        ADV_ESTIMATORS["gae"](scores, mask, ["a", "a"], params=params)
    with pytest.raises(AppoError, match="algorithm.lam"):
        AdvantageParams(lam=1.5)


def test_clipped_value_loss_by_hand_and_split_invariant():
    # old 0, c 0.5. Token a: v 1.0, R 2.0: unclipped (1-2)^2 = 1, clipped (0.5-2)^2 = 2.25 -> 2.25
    # Token b: v 0.2, R 0.0: unclipped 0.04, clipped 0.04 -> 0.04. Token c (masked) ignored.
    # loss = 0.5 * (2.25 + 0.04) / 2 = 0.5725; clipfrac 1/2.
    v = torch.tensor([[1.0, 0.2, 5.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    ret = torch.tensor([[2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    agg = LossAgg("token-mean", 2.0, 1.0)
    loss, m = clipped_value_loss(v, old, ret, mask, agg=agg, cliprange_value=0.5)
    assert float(loss.detach()) == pytest.approx(0.5725)
    assert m["vf_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    # d/dv: token a takes the clipped branch (v - old > c): no gradient; token b 0.5*2*0.2/2.
    assert v.grad[0].tolist() == pytest.approx([0.0, 0.1, 0.0])
    # Split in two micro-batches with the same normaliser: the shares add up.
    g = torch.Generator().manual_seed(0)
    vals, olds, rets = (torch.randn(4, 6, generator=g) for _ in range(3))
    msk = (torch.rand(4, 6, generator=g) < 0.7).float()
    full_agg = LossAgg.from_masks("token-mean", msk)
    full, _ = clipped_value_loss(vals, olds, rets, msk, agg=full_agg, cliprange_value=0.3)
    parts = sum(clipped_value_loss(vals[s], olds[s], rets[s], msk[s], agg=full_agg,
                                   cliprange_value=0.3)[0] for s in (slice(0, 1), slice(1, 4)))
    assert float(parts) == pytest.approx(float(full), rel=1e-6)
