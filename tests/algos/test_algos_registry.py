"""Registry names are the config choices, and every registered function shares one call."""

from __future__ import annotations

import torch

from appo.algos import (
    ADV_ESTIMATORS,
    AGG_MODES,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageParams,
    BranchTree,
    LossAgg,
    PolicyLossParams,
)
from appo.config import CHOICES


def test_registry_names_equal_config_choices():
    assert tuple(ADV_ESTIMATORS) == CHOICES["algorithm.adv_estimator"]
    assert tuple(POLICY_LOSSES) == CHOICES["actor.policy_loss"]
    assert tuple(KL_ESTIMATORS) == CHOICES["actor.kl_loss_type"]
    assert tuple(AGG_MODES) == CHOICES["actor.loss_agg_mode"]


def test_every_estimator_takes_the_same_call():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.5])
    mask = torch.ones(4, 3)
    tree = BranchTree(torch.tensor([-1, -1, 0, -1]), torch.tensor([-1, -1, 1, -1]))
    for name, fn in ADV_ESTIMATORS.items():
        adv, metrics = fn(scores, mask, ["a", "a", "a", "b"], params=AdvantageParams(), tree=tree,
                          values=torch.zeros(4, 3))
        assert adv.shape == (4, 3), name
        assert adv.dtype == torch.float32, name
        assert all(isinstance(v, float) for v in metrics.values()), name


def test_every_policy_loss_takes_the_same_call():
    torch.manual_seed(0)
    logp = torch.randn(3, 5, requires_grad=True)
    old = logp.detach() + 0.3 * torch.randn(3, 5)
    adv = torch.randn(3, 5)
    mask = torch.ones(3, 5)
    entropy = torch.rand(3, 5)
    params = PolicyLossParams(entropy_clip_scope="high_entropy")
    for mode in AGG_MODES:
        agg = LossAgg.from_masks(mode, mask)
        for name, fn in POLICY_LOSSES.items():
            loss, metrics = fn(logp, old, adv, mask, agg=agg, params=params, entropy=entropy)
            assert loss.dim() == 0 and loss.requires_grad, (name, mode)
            assert {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"} <= set(metrics), name
            assert all(isinstance(v, float) for v in metrics.values()), name
