"""Advantage estimators: hand-computed values, naive-loop equivalence, the APPO credit tree."""

from __future__ import annotations

import math
import random
from collections import defaultdict

import pytest
import torch

from appo.algos import (
    AdvantageParams,
    BranchTree,
    MaskedStats,
    appo_advantage,
    entropy_aware_advantage,
    group_index,
    grpo_advantage,
    reinforce_plus_plus_advantage,
    rloo_advantage,
)
from appo.errors import AppoError

EPS = 1e-6


def rows(adv: torch.Tensor) -> list[float]:
    """First-token advantage of each row (estimators that broadcast one value per row)."""
    return adv[:, 0].tolist()


# ---------------------------------------------------------------- grpo


def test_grpo_group_of_four_hand_computed():
    # rewards [1, 0, 0, 1]: mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = sqrt(1/3) = 0.577350
    # A = +-0.5 / (0.577350 + 1e-6) = +-0.866024
    adv, metrics = grpo_advantage(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.ones(4, 3), ["p"] * 4)
    expected = 0.5 / (math.sqrt(1 / 3) + EPS)
    assert rows(adv) == pytest.approx([expected, -expected, -expected, expected], abs=1e-6)
    assert torch.equal(adv[:, 0:1].expand(4, 3), adv)  # broadcast over the response
    assert metrics["zero_std_group_frac"] == 0.0


def test_grpo_groups_of_different_sizes_in_any_order():
    # uids a, b, a, b, b, c; scores 1, 2, 3, 4, 6, 5
    # a = [1, 3]: mean 2, std sqrt(2) -> -1/1.414214, +1/1.414214 = -0.707107, 0.707107
    # b = [2, 4, 6]: mean 4, std sqrt((4 + 0 + 4) / 2) = 2 -> -1, 0, 1
    # c = [5]: a group of one has mean 0, std 1 -> 5 / (1 + 1e-6)
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0, 5.0])
    uids = ["a", "b", "a", "b", "b", "c"]
    adv, _ = grpo_advantage(scores, torch.ones(6, 2), uids)
    s2 = math.sqrt(2) + EPS
    assert rows(adv) == pytest.approx(
        [-1 / s2, -2 / (2 + EPS), 1 / s2, 0.0, 2 / (2 + EPS), 5 / (1 + EPS)], abs=1e-6
    )
    # The same groups as an int tensor, and as numpy-like ints, give the same result.
    adv_int, _ = grpo_advantage(scores, torch.ones(6, 2), torch.tensor([7, 3, 7, 3, 3, 9]))
    assert torch.equal(adv, adv_int)


def test_dr_grpo_does_not_divide_by_std():
    # same groups as above; A = s - mean: a -> -1, 1; b -> -2, 0, 2; c -> 5 - 0
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 6.0, 5.0])
    uids = ["a", "b", "a", "b", "b", "c"]
    adv, _ = grpo_advantage(scores, torch.ones(6, 1), uids,
                            params=AdvantageParams(norm_adv_by_std=False))
    assert rows(adv) == pytest.approx([-1.0, -2.0, 1.0, 0.0, 2.0, 5.0])


def test_grpo_zero_outside_the_mask_and_all_equal_group():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv, metrics = grpo_advantage(torch.tensor([1.0, 1.0]), mask, ["x", "x"])
    # all-equal group: std 0 -> A = 0 / (0 + eps) = 0 everywhere
    assert torch.equal(adv, torch.zeros(2, 3))
    assert metrics["zero_std_group_frac"] == 1.0
    adv, _ = grpo_advantage(torch.tensor([1.0, 0.0]), mask, ["x", "x"])
    assert (adv[mask == 0] == 0).all() and (adv[mask == 1] != 0).all()


def naive_grpo(scores: list[float], uids: list[str], norm: bool) -> list[float]:
    members = defaultdict(list)
    for s, u in zip(scores, uids, strict=True):
        members[u].append(s)
    out = []
    for s, u in zip(scores, uids, strict=True):
        group = members[u]
        if len(group) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = sum(group) / len(group)
            std = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
        out.append((s - mean) / (std + EPS) if norm else s - mean)
    return out


def naive_rloo(scores: list[float], uids: list[str]) -> list[float]:
    out = []
    for i, (s, u) in enumerate(zip(scores, uids, strict=True)):
        others = [scores[j] for j in range(len(scores)) if uids[j] == u and j != i]
        out.append(s - sum(others) / len(others) if others else s)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_grpo_and_rloo_equal_naive_loops(seed):
    rng = random.Random(seed)
    size = rng.randint(1, 30)
    uids = [f"p{rng.randint(0, 6)}" for _ in range(size)]
    scores = [rng.choice([0.0, 1.0, rng.uniform(-2, 2)]) for _ in range(size)]
    t = torch.tensor(scores)
    mask = torch.ones(size, 1)
    for norm in (True, False):
        adv, _ = grpo_advantage(t, mask, uids, params=AdvantageParams(norm_adv_by_std=norm))
        assert rows(adv) == pytest.approx(naive_grpo(scores, uids, norm), rel=1e-5, abs=1e-5)
    adv, _ = rloo_advantage(t, mask, uids)
    assert rows(adv) == pytest.approx(naive_rloo(scores, uids), rel=1e-5, abs=1e-5)


# ---------------------------------------------------------------- rloo / reinforce++


def test_rloo_hand_computed():
    # [1, 0, 0, 1]: A_0 = 1 - (0 + 0 + 1) / 3 = 2/3; A_1 = 0 - (1 + 0 + 1) / 3 = -2/3
    # singleton [4]: no leave-one-out baseline -> A = 4
    adv, _ = rloo_advantage(torch.tensor([1.0, 0.0, 0.0, 1.0, 4.0]), torch.ones(5, 2),
                            ["g", "g", "g", "g", "h"])
    assert rows(adv) == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 4.0])


def test_reinforce_plus_plus_hand_computed():
    # group x = [1, 0] -> s - mean = 0.5, -0.5; group y = [3] (one row, baseline 0) -> 3
    # valid tokens: row 0 has 2, rows 1 and 2 have 1 -> token values [0.5, 0.5, -0.5, 3]
    # mean = 3.5 / 4 = 0.875; deviations -0.375, -0.375, -1.375, 2.125
    # unbiased var = (0.140625 * 2 + 1.890625 + 4.515625) / 3 = 6.6875 / 3 = 2.229167
    # std = 1.493039 -> A = -0.251166 (row 0), -0.920942 (row 1), 1.423268 (row 2)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 1, 0]])
    adv, _ = reinforce_plus_plus_advantage(torch.tensor([1.0, 0.0, 3.0]), mask, ["x", "x", "y"])
    std = math.sqrt(6.6875 / 3) + EPS
    expected = torch.tensor([[-0.375 / std, -0.375 / std, 0.0], [-1.375 / std, 0.0, 0.0],
                             [0.0, 2.125 / std, 0.0]])
    torch.testing.assert_close(adv, expected)


def test_non_finite_scores_and_bad_shapes_are_reported():
    with pytest.raises(AppoError, match="not finite"):
        grpo_advantage(torch.tensor([1.0, float("nan")]), torch.ones(2, 2), ["a", "a"])
    with pytest.raises(AppoError, match=r"\[B\]"):
        grpo_advantage(torch.ones(3), torch.ones(2, 2), ["a", "a", "a"])
    with pytest.raises(AppoError, match="group ids"):
        grpo_advantage(torch.ones(3), torch.ones(3, 2), ["a", "a"])


def test_group_index_first_appearance_order():
    index, count = group_index(["q", "p", "q", "r"])
    assert index.tolist() == [0, 1, 0, 2] and count == 3


# ---------------------------------------------------------------- appo tree credit


def appo_tree():
    """Prompt P: initial rows o0 (row 0), o1 (row 3); branches b2 (row 1) of o0 split at 1,
    b3 (row 4) of o0 split at 3, b4 (row 5) of o1 split at 2. Prompt Q: one initial row q0
    (row 2). Rows are interleaved on purpose."""
    parent = torch.tensor([-1, 0, -1, -1, 0, 3])
    split = torch.tensor([-1, 1, -1, -1, 3, 2])
    scores = torch.tensor([1.0, 1.0, 7.0, 0.0, 0.0, 1.0])  # o0 b2 q0 o1 b3 b4
    uids = ["P", "P", "Q", "P", "P", "P"]
    return scores, uids, BranchTree(parent, split)


def test_appo_credit_on_hand_built_tree():
    scores, uids, tree = appo_tree()
    mask = torch.ones(6, 5)
    mask[0, 4] = 0  # a tool-result token of o0 gets no advantage
    adv, metrics = appo_advantage(scores, mask, uids, tree=tree)
    # Initial rows of P: [1, 0], mean 0.5, population std 0.5 -> A_init = +1, -1 (/(0.5+eps)).
    # Branch rows of P: b2 = 1, b3 = 0, b4 = 1: mean 2/3, pop var = (2 (1/3)^2 + (2/3)^2) / 3
    #   = 2/9, std 0.471405 -> z: b2 = 0.707107, b3 = -1.414214, b4 = 0.707107.
    # o0, t = 0, 1: b2 (split 1) and b3 (split 3) cover t -> 1 + (0.707107 - 1.414214) / 2
    #   = 0.646447; t = 2, 3: only b3 -> 1 - 1.414214 = -0.414214; t = 4: masked -> 0.
    # o1, t = 0..2: b4 (split 2) -> -1 + 0.707107 = -0.292893; t = 3, 4: -1.
    # q0: group of one -> A_init = 0, no branches -> 0. Branch rows -> 0.
    a_init = 0.5 / (0.5 + EPS)
    std_b = math.sqrt(2 / 9) + EPS
    z_hi, z_lo = (1 / 3) / std_b, -(2 / 3) / std_b
    expected = torch.zeros(6, 5)
    expected[0] = torch.tensor([a_init + (z_hi + z_lo) / 2] * 2 + [a_init + z_lo] * 2 + [0.0])
    expected[3] = torch.tensor([-a_init + z_hi] * 3 + [-a_init] * 2)
    torch.testing.assert_close(adv, expected)
    assert expected[0, 0] == pytest.approx(0.646447, abs=1e-5)
    assert metrics["branch_frac"] == pytest.approx(0.5)


def test_appo_discounted_credit_on_hand_built_tree():
    scores, uids, tree = appo_tree()
    adv, _ = appo_advantage(scores, torch.ones(6, 5), uids, tree=tree,
                            params=AdvantageParams(appo_discount_credit=True,
                                                   reward_scale_discount=0.9))
    # Each branch term is scaled by 0.9^(split - t):
    # o0 t=0: mean(0.707107 * 0.9, -1.414214 * 0.9^3) = mean(0.636396, -1.030962) = -0.197283
    #   -> 0.802717; t=1: mean(0.707107, -1.414214 * 0.81) = -0.219203 -> 0.780797;
    #   t=2: -1.414214 * 0.9 = -1.272792 -> -0.272792; t=3: -0.414214; t=4: 1.
    # o1 t=0: 0.707107 * 0.81 -> -0.427243; t=1: * 0.9 -> -0.363604; t=2: -0.292893; t=3,4: -1.
    assert adv[0].tolist() == pytest.approx([0.802717, 0.780797, -0.272792, -0.414214, 1.0],
                                            abs=1e-5)
    assert adv[3].tolist() == pytest.approx([-0.427243, -0.363604, -0.292893, -1.0, -1.0],
                                            abs=1e-5)
    assert adv[[1, 2, 4, 5]].abs().max() == 0


def test_branch_tree_from_rollout_ids_matches_rows():
    _, _, tree = appo_tree()
    built = BranchTree.from_ids(
        ["o0", "b2", "q0", "o1", "b3", "b4"],
        [None, "o0", None, None, "o0", "o1"],
        [None, 1, None, None, 3, 2],
    )
    assert torch.equal(built.parent, tree.parent)
    assert torch.equal(built.split_index, tree.split_index)
    with pytest.raises(AppoError, match="not in the batch"):
        BranchTree.from_ids(["a", "b"], [None, "zz"], [None, 0])


def test_branch_of_a_branch_credits_the_root_up_to_the_shared_prefix():
    # o (row 0) -> b1 (row 1, split 3) -> b2 (row 2, split 1 in b1's coordinates, < 3, so
    # b2 shares o's prefix up to token 1). Branch z over [b1=0, b2=1]: -1, +1 (/(0.5+eps)).
    # Initial group of one -> A_init = 0. o: t=0,1: mean(-1, 1) = 0; t=2,3: -1; t=4: 0.
    tree = BranchTree(torch.tensor([-1, 0, 1]), torch.tensor([-1, 3, 1]))
    assert tree.resolve() == ([0, 0, 0], [-1, 3, 1])
    adv, _ = appo_advantage(torch.tensor([5.0, 0.0, 1.0]), torch.ones(3, 5), ["g"] * 3, tree=tree)
    z = 0.5 / (0.5 + EPS)
    assert adv[0].tolist() == pytest.approx([0.0, 0.0, -z, -z, 0.0], abs=1e-6)


def test_a_branch_from_the_prompt_counts_in_the_z_scores_and_credits_no_token():
    # Rows: o0 (score 1), o1 (0), b (branch of o0 at the prompt, split -1, score 1),
    # b2 (branch of o0 at token 2, score 0). Initial z over [1, 0]: +-0.5 / (0.5 + eps) = +-z;
    # branch z over [1, 0]: b = +z, b2 = -z. o0: t <= 2 gets z + mean(b2) = z - z = 0 (b's
    # split -1 covers no token), t = 3: z. o1: -z everywhere. Branch rows: 0.
    tree = BranchTree(torch.tensor([-1, -1, 0, 0]), torch.tensor([-1, -1, -1, 2]))
    adv, _ = appo_advantage(torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.ones(4, 4),
                            ["g"] * 4, tree=tree)
    z = 0.5 / (0.5 + EPS)
    assert adv[0].tolist() == pytest.approx([0.0, 0.0, 0.0, z], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([-z] * 4, abs=1e-6)
    assert adv[2:].abs().max() == 0


def naive_appo(scores, uids, parent, split, width, discount):
    def zscores(rows_):
        out = {}
        by_group = defaultdict(list)
        for r in rows_:
            by_group[uids[r]].append(r)
        for members in by_group.values():
            vals = [scores[r] for r in members]
            mean = sum(vals) / len(vals)
            std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))
            for r in members:
                out[r] = 0.0 if len(members) == 1 else (scores[r] - mean) / (std + EPS)
        return out

    initial = [r for r in range(len(scores)) if parent[r] < 0]
    branches = [r for r in range(len(scores)) if parent[r] >= 0]
    z_init, z_branch = zscores(initial), zscores(branches)
    adv = [[0.0] * width for _ in scores]
    for o in initial:
        for t in range(width):
            terms = [z_branch[b] * (discount ** (split[b] - t) if discount else 1.0)
                     for b in branches if parent[b] == o and split[b] >= t]
            adv[o][t] = z_init[o] + (sum(terms) / len(terms) if terms else 0.0)
    return adv


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("discount", [None, 0.8])
def test_appo_equals_naive_loop_on_random_forests(seed, discount):
    rng = random.Random(seed)
    width = rng.randint(1, 9)
    uids, parent, split, scores = [], [], [], []
    for p in range(rng.randint(1, 4)):
        roots = []
        for _ in range(rng.randint(1, 4)):
            roots.append(len(uids))
            uids.append(f"p{p}"), parent.append(-1), split.append(-1)
            scores.append(rng.choice([0.0, 1.0, rng.uniform(-1, 1)]))
        for _ in range(rng.randint(0, 5)):
            uids.append(f"p{p}"), parent.append(rng.choice(roots))
            # split -1: a branch sharing only the prompt (credits no token)
            split.append(rng.randrange(-1, width)), scores.append(rng.choice([0.0, 1.0]))
    order = list(range(len(uids)))
    rng.shuffle(order)  # rows in any order: remap parents
    where = {old: new for new, old in enumerate(order)}
    uids = [uids[o] for o in order]
    scores = [scores[o] for o in order]
    split = [split[o] for o in order]
    parent = [where[parent[o]] if parent[o] >= 0 else -1 for o in order]
    params = AdvantageParams(appo_discount_credit=discount is not None,
                             reward_scale_discount=discount or 0.9)
    adv, _ = appo_advantage(torch.tensor(scores), torch.ones(len(uids), width), uids,
                            tree=BranchTree(torch.tensor(parent), torch.tensor(split)),
                            params=params)
    expected = naive_appo(scores, uids, parent, split, width, discount)
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_appo_reports_bad_trees():
    mask = torch.ones(3, 4)
    with pytest.raises(AppoError, match="branch provenance"):
        appo_advantage(torch.ones(3), mask, ["a"] * 3)
    with pytest.raises(AppoError, match="prompt group"):
        appo_advantage(torch.ones(3), mask, ["a", "a", "b"],
                       tree=BranchTree(torch.tensor([-1, -1, 0]), torch.tensor([-1, -1, 1])))
    with pytest.raises(AppoError, match="split index -2"):
        appo_advantage(torch.ones(3), mask, ["a"] * 3,
                       tree=BranchTree(torch.tensor([-1, -1, 0]), torch.tensor([-1, -1, -2])))
    with pytest.raises(AppoError, match="split index 4"):
        appo_advantage(torch.ones(3), mask, ["a"] * 3,
                       tree=BranchTree(torch.tensor([-1, -1, 0]), torch.tensor([-1, -1, 4])))
    with pytest.raises(AppoError, match="cycle"):
        BranchTree(torch.tensor([1, 0]), torch.tensor([0, 0])).resolve()


# ---------------------------------------------------------------- AEPO entropy-aware advantage


def test_entropy_aware_advantage_hand_computed():
    # valid H = [1, 2, 3]: mean 2, population std sqrt(2/3) = 0.816497
    # z = -1.224745, 0, 1.224745; alpha 0.2 -> factors 0.755051, 1, 1.244949; A = 2
    # -> 1.510102, 2, 2.489898. The masked 4th token (H = 100) neither counts nor changes.
    adv = torch.full((1, 4), 2.0)
    entropy = torch.tensor([[1.0, 2.0, 3.0, 100.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0]])
    out, metrics = entropy_aware_advantage(adv, entropy, mask, alpha=0.2)
    assert out[0].tolist() == pytest.approx([1.510102, 2.0, 2.489898, 2.0], abs=1e-5)
    assert not out.requires_grad  # sg(z(H)): no gradient reaches the entropy
    assert metrics["entropy_adv_factor_mean"] == pytest.approx(1.0, abs=1e-6)


def test_entropy_aware_advantage_with_mini_batch_stats():
    # stats from another (whole) batch: mean 1, std 2 -> z(3) = 1 -> factor 1 + 0.5 * 1 = 1.5
    out, _ = entropy_aware_advantage(torch.ones(1, 1), torch.tensor([[3.0]]), torch.ones(1, 1),
                                     alpha=0.5, stats=MaskedStats(mean=1.0, std=2.0))
    assert out.item() == pytest.approx(1.5, abs=1e-5)
    # The same token alone in its micro-batch has z = 0: the stats matter.
    out_local, _ = entropy_aware_advantage(torch.ones(1, 1), torch.tensor([[3.0]]),
                                           torch.ones(1, 1), alpha=0.5)
    assert out_local.item() == pytest.approx(1.0)
