"""Algorithm core: pure torch functions for advantages, policy losses, KL and aggregation.

No models, no config objects: tensors and scalars in, `(value, metrics)` out. Four
registries, whose names are the config choices (`appo.config.CHOICES`); a user's estimator
or loss registered through `appo.register_advantage` / `appo.register_policy_loss`
(`appo.registry`, which this package does not import) is written into the first two:

- `ADV_ESTIMATORS` (`algorithm.adv_estimator`): grpo, rloo, reinforce_plus_plus, appo, gae
  (the last reads a value model's `values`; its clipped value loss is `clipped_value_loss`).
- `POLICY_LOSSES` (`actor.policy_loss`): vanilla, entropy_balanced, future_kl.
- `KL_ESTIMATORS` (`actor.kl_loss_type`): k1, k2, k3, low_var_kl.
- `AGG_MODES` (`actor.loss_agg_mode`): token-mean, seq-mean-token-sum, seq-mean-token-mean,
  seq-mean-token-sum-norm.

How a trainer uses them, per mini-batch (`mb` = micro-batches, `a` = actor config):

    adv, m = ADV_ESTIMATORS[est](scores, loss_mask, uids, params=AdvantageParams(...), tree=tree)
    agg = LossAgg.from_masks(a.loss_agg_mode, [mb.loss_mask for mb in mbs], max_len=L)
    params = PolicyLossParams(clip_low=a.clip_ratio_low, ...)
    for mb in mbs:
        logp, ent = token_logprobs_and_entropy(h, lm_head.weight, mb.targets,
                                               chunk_size=a.logprob_chunk_size, entropy_grad=...)
        adv_mb = entropy_aware_advantage(mb.adv, ent, mb.loss_mask, alpha=...)[0]  # if AEPO
        pg, m = POLICY_LOSSES[a.policy_loss](logp, mb.old_logp, adv_mb, mb.loss_mask,
                                             agg=agg, params=params, entropy=ent)
        kl, _ = kl_loss(logp, mb.ref_logp, mb.loss_mask, agg=agg, kind=a.kl_loss_type)
        ent_bonus, _ = entropy_bonus(ent, mb.loss_mask, agg=agg)
        (pg + a.kl_loss_coef * kl - a.entropy_coeff * ent_bonus).backward()

The summed micro-batch losses equal the full-mini-batch loss, value and gradient.
"""

from appo.algos.advantages import (
    ADV_ESTIMATORS,
    AdvantageParams,
    BranchTree,
    appo_advantage,
    entropy_aware_advantage,
    gae_advantage,
    group_index,
    grpo_advantage,
    reinforce_plus_plus_advantage,
    rloo_advantage,
)
from appo.algos.aggregation import AGG_MODES, LossAgg, MaskedStats, aggregate, token_share
from appo.algos.gae import (
    clipped_value_loss,
    gae_advantages_and_returns,
    masked_whiten,
    outcome_token_rewards,
)
from appo.algos.kl import KL_ESTIMATORS, entropy_bonus, kl_loss
from appo.algos.logprobs import (
    logprobs_and_entropy_direct,
    logprobs_and_entropy_from_logits,
    token_logprobs_and_entropy,
)
from appo.algos.policy_losses import (
    POLICY_LOSSES,
    PolicyLossParams,
    discounted_future_sum,
    entropy_balanced_policy_loss,
    future_kl_kept_rows,
    future_kl_policy_loss,
    vanilla_policy_loss,
)

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "AdvantageParams",
    "BranchTree",
    "LossAgg",
    "MaskedStats",
    "PolicyLossParams",
    "aggregate",
    "appo_advantage",
    "clipped_value_loss",
    "discounted_future_sum",
    "entropy_aware_advantage",
    "entropy_balanced_policy_loss",
    "entropy_bonus",
    "future_kl_kept_rows",
    "future_kl_policy_loss",
    "gae_advantage",
    "gae_advantages_and_returns",
    "group_index",
    "grpo_advantage",
    "kl_loss",
    "logprobs_and_entropy_direct",
    "logprobs_and_entropy_from_logits",
    "masked_whiten",
    "outcome_token_rewards",
    "reinforce_plus_plus_advantage",
    "rloo_advantage",
    "token_logprobs_and_entropy",
    "token_share",
    "vanilla_policy_loss",
]
