"""APPO: Branching Score, candidate selection, top-B, fill, entropy fallback, branch rows."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch
from rollout_fakes import FakeTools, ScriptedEngine, Step, tiny_tokenizer

from appo.errors import AppoError
from appo.rollout import RolloutPrompt, RolloutSettings, Segment, Trajectory, rollout
from appo.rollout.scoring import (
    branching_scores,
    future_value,
    is_punct_or_space,
    is_space,
    plan_branches,
    zscore,
)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_zscore_uses_population_std_over_the_mask():
    x = torch.tensor([1.0, 3.0, 100.0])
    z = zscore(x, torch.tensor([True, True, False]))
    # mean 2, population std 1 -> -1/(1+1e-6), +1/(1+1e-6); masked position -> 0
    assert z.tolist() == pytest.approx([-1 / (1 + 1e-6), 1 / (1 + 1e-6), 0.0])


def test_future_value_hand_computed():
    lr = torch.tensor([0.1, -0.3, 0.05])
    mask = torch.tensor([True, True, True])
    # gamma 1: S = [-0.15, -0.25, 0.05]; exp -> [0.8607, 0.7788 -> clip 0.8, 1.0513]
    fv = future_value(lr, mask, 1.0, 0.2)
    assert fv.tolist() == pytest.approx([math.exp(-0.15), 0.8, math.exp(0.05)], abs=1e-6)
    # gamma 0.5: S2 = 0.05, S1 = -0.3 + 0.025 = -0.275, S0 = 0.1 - 0.1375 = -0.0375
    fv = future_value(lr, mask, 0.5, 0.2)
    assert fv.tolist() == pytest.approx([math.exp(-0.0375), 0.8, math.exp(0.05)], abs=1e-6)
    # A masked (forced) position adds nothing but still counts in the discount distance.
    fv = future_value(lr, torch.tensor([True, False, True]), 0.5, 0.2)
    s2, s1 = 0.05, 0.025
    assert fv.tolist() == pytest.approx(
        [math.exp(0.1 + 0.5 * s1), math.exp(s1), math.exp(s2)], abs=1e-6)
    # Large sums are clamped at +-20 before exp, then clipped to [1-eps, 1+eps].
    big = future_value(torch.tensor([50.0, -80.0]), torch.tensor([True, True]), 1.0, 0.2)
    assert big.tolist() == pytest.approx([0.8, 0.8])
    # -inf (the current policy's top-k excludes the sampled token) gives 1 - eps where it
    # is covered, not NaN; at a masked position it counts 0.
    inf = float("-inf")
    fv = future_value(torch.tensor([0.1, inf, 0.05, inf]),
                      torch.tensor([True, True, True, False]), 1.0, 0.2)
    assert fv.tolist() == pytest.approx([0.8, 0.8, math.exp(0.05), 1.0], abs=1e-6)


def naive_scores(h, lpc, lpr, mask, gamma, eps):
    n = len(h)
    s = [0.0] * n
    for t in range(n):
        s[t] = sum(gamma ** (k - t) * (lpc[k] - lpr[k]) * mask[k] for k in range(t, n))
    fv = [min(1 + eps, max(1 - eps, math.exp(max(-20, min(20, v))))) for v in s]

    def z(x):
        vals = [x[i] for i in range(n) if mask[i]]
        mu, sd = statistics.fmean(vals), statistics.pstdev(vals)
        return [((x[i] - mu) / (sd + 1e-6)) if mask[i] else 0.0 for i in range(n)]

    zh, zfv = z(h), z(fv)
    return zh, zfv, [a * b for a, b in zip(zh, zfv, strict=True)]


def test_branching_scores_match_a_naive_loop():
    gen = random.Random(0)
    for _ in range(5):
        n = gen.randint(3, 40)
        h = [gen.uniform(0, 5) for _ in range(n)]
        lpr = [gen.uniform(-3, 0) for _ in range(n)]
        lpc = [v + gen.gauss(0, 0.05) for v in lpr]
        mask = [gen.random() < 0.8 for _ in range(n)]
        mask[0] = mask[1] = True
        got = branching_scores(torch.tensor(h), torch.tensor(lpc), torch.tensor(lpr),
                               torch.tensor(mask), 0.9, 0.2)
        zh, zfv, bs = naive_scores(h, lpc, lpr, mask, 0.9, 0.2)
        assert got.z_h.tolist() == pytest.approx(zh, abs=1e-4)
        assert got.z_fv.tolist() == pytest.approx(zfv, abs=1e-3)
        assert got.bs.tolist() == pytest.approx(bs, abs=1e-3)


def test_zero_variance_future_value_degrades_to_zero_not_nan():
    h = torch.tensor([1.0, 2.0, 3.0])
    lp = torch.tensor([-1.0, -2.0, -0.5])
    noise = lp + torch.tensor([1e-7, -1e-7, 2e-7])  # recompute noise, as on-policy
    got = branching_scores(h, noise, lp, torch.ones(3, dtype=torch.bool))
    assert got.z_fv.tolist() == [0.0, 0.0, 0.0]
    assert got.bs.tolist() == [0.0, 0.0, 0.0]
    assert torch.isfinite(got.z_h).all()


def test_punctuation_and_whitespace_tokens():
    assert is_punct_or_space(",") and is_punct_or_space("  ") and is_punct_or_space(" +=")
    assert not is_punct_or_space(" the") and not is_punct_or_space("7")
    assert is_space("  ") and is_space("\n") and is_space("")
    assert not is_space(",") and not is_space(" +=")


def test_default_excludes_whitespace_only_as_the_original(tok):
    """The original's rule (the default): only whitespace tokens are excluded, so row 1's
    "," (t=1, BS .67, see hand_built) is a candidate and its " " (t=2) is not. By BS:
    (0,1) 1.92, (1,1) .67, (0,3) .61, (1,3) .46."""
    trajs, current = hand_built(tok)
    s = RolloutSettings()
    assert s.appo_skip_punctuation is False
    assert picks(plan_branches(trajs, current, {"u": 4}, s, tok)) == [
        (0, 1), (1, 1), (0, 3), (1, 3)]


def make_traj(tok, uid, text, entropy, s_target, tid):
    """A one-segment trajectory whose FV has the exponent S_t = s_target[t] (gamma 1)."""
    ids = tok.encode(text)
    assert len(ids) == len(text)  # byte-level: one token per character
    lpr = [-1.0] * len(ids)
    lr = [s_target[t] - (s_target[t + 1] if t + 1 < len(ids) else 0.0) for t in range(len(ids))]
    current = torch.tensor([a + b for a, b in zip(lpr, lr, strict=True)])
    traj = Trajectory(uid=uid, traj_id=tid, prompt_ids=[1], response_ids=ids,
                      loss_mask=[1] * len(ids), logp_rollout=lpr, entropy=list(entropy),
                      segments=[Segment(0, len(ids), True)])
    return traj, current


def hand_built(tok):
    # Row 0 "abcde": H = [1,5,2,4,3] -> z(H) = [-1.41, 1.41, -0.71, 0.71, 0]
    #   S = [0, .15, -.1, .1, -.15] -> FV = [1, 1.162, .905, 1.105, .861], z(FV) signs
    #   [-, +, -, +, -] (z = [-.06, 1.36, -.89, .86, -1.27]).
    #   candidates: t=1 (BS 1.92), t=3 (BS .61); eligible only: t=0 (BS .08), t=2 (BS .63);
    #   t=4 is the segment's last token: never a split point.
    # Row 1 "f, gh": H = [2,9,9,8,1] -> z(H) = [-1.07, .90, .90, .62, -1.35]
    #   S = [0, .15, .15, .15, -.2] -> z(FV) = [-.45, .74, .74, .74, -1.78]
    #   t=1 "," and t=2 " " would score BS .67 but are punctuation/space: ineligible;
    #   candidate t=3 (BS .46); eligible only t=0 (BS .48).
    t0, c0 = make_traj(tok, "u", "abcde", [1, 5, 2, 4, 3], [0, .15, -.1, .1, -.15], "r0")
    t1, c1 = make_traj(tok, "u", "f, gh", [2, 9, 9, 8, 1], [0, .15, .15, .15, -.2], "r1")
    return [t0, t1], [c0, c1]


def picks(plan):
    return [(c.row, c.split) for c in plan]


def test_top_b_candidates_by_branching_score(tok):
    trajs, current = hand_built(tok)
    s = RolloutSettings(appo_skip_punctuation=True)
    assert picks(plan_branches(trajs, current, {"u": 2}, s, tok)) == [(0, 1), (0, 3)]
    assert picks(plan_branches(trajs, current, {"u": 3}, s, tok)) == [(0, 1), (0, 3), (1, 3)]


def test_short_candidates_are_filled_from_eligible_tokens_by_score(tok):
    trajs, current = hand_built(tok)
    s = RolloutSettings(appo_skip_punctuation=True)
    # 3 candidates, then eligible non-candidates by BS: (0,2) .63, (1,0) .48, (0,0) .08
    assert picks(plan_branches(trajs, current, {"u": 6}, s, tok)) == [
        (0, 1), (0, 3), (1, 3), (0, 2), (1, 0), (0, 0)]
    # More than the 6 eligible tokens: the ranking is reused from the top.
    plan = plan_branches(trajs, current, {"u": 8}, s, tok)
    assert picks(plan)[6:] == [(0, 1), (0, 3)]


def test_on_policy_scores_rank_by_entropy(tok):
    trajs, _ = hand_built(tok)
    on_policy = [torch.tensor(t.logp_rollout) + 1e-7 for t in trajs]
    s = RolloutSettings(appo_skip_punctuation=True)
    plan = plan_branches(trajs, on_policy, {"u": 4}, s, tok)
    # BS = 0 everywhere; eligible tokens by entropy: (1,3) 8, (0,1) 5, (0,3) 4, then the
    # tie at 2 between (0,2) and (1,0) goes to the earlier row.
    assert picks(plan) == [(1, 3), (0, 1), (0, 3), (0, 2)]
    assert all(math.isfinite(c.score) for c in plan)


def results_so_far(engine, ids):
    return engine.count(ids, "<result>")


def test_appo_rollout_branches_are_untrained_continuations(tok):
    calls_seen = []

    def script(engine, rid, ids):
        k = results_so_far(engine, ids)
        if k == 0:
            # entropies rise along the segment: the high-entropy tokens are late ones
            return Step("<python>calc</python>", entropy=[0.1 * i for i in range(20)])
        return Step("<answer>yes</answer>", entropy=[0.2] * 20, finish="eos")

    eng = ScriptedEngine(tok, script)
    tools = FakeTools()

    def score_fn(trajs):
        calls_seen.append(len(trajs))
        return [torch.tensor(t.logp_rollout) for t in trajs]  # on-policy

    s = RolloutSettings(n=5, initial_rollouts=2)
    prompts = [RolloutPrompt("a", tok.encode("q a")), RolloutPrompt("b", tok.encode("q b"))]
    batch = rollout(prompts, eng, tools, s, strategy="appo", score_fn=score_fn)
    assert calls_seen == [4]  # scored once, the initial rows only
    for group in batch.by_uid().values():
        assert len(group) == 5
        initial = [t for t in group if not t.is_branch]
        branches = [t for t in group if t.is_branch]
        assert len(initial) == 2 and len(branches) == 3
        by_id = {t.traj_id: t for t in group}
        for b in branches:
            parent = by_id[b.parent_id]
            t = b.branch_token_index
            assert b.response_ids[: t + 1] == parent.response_ids[: t + 1]
            assert b.loss_mask == [0] * len(b.response_ids)  # branches only give reward
            assert parent.loss_mask[t] == 1  # split at a sampled token
            # The prefix ends before the tool call: the branch makes its own call.
            assert len(b.tool_calls) == 1 and b.tool_calls[0].result_start > t
            assert b.finish_reason == "eos"
        for t in initial:
            assert sum(t.loss_mask) > 0 and t.parent_id is None
    assert batch.stats.branches == 6


def test_appo_needs_a_score_fn(tok):
    eng = ScriptedEngine(tok, lambda e, r, i: Step("x", finish="eos"))
    with pytest.raises(AppoError, match="score_fn"):
        rollout([RolloutPrompt("a", [1, 2])], eng, FakeTools(), RolloutSettings(),
                strategy="appo")


def test_on_policy_is_judged_by_each_log_ratio_not_by_the_fv_spread():
    # 400 tokens whose log-ratios are recompute-sized noise (|lr| <= 5e-5, as measured on
    # SmolLM2 in float32): FV sums them over the rest of the row, so its spread exceeds 1e-4,
    # yet every lr is within lr_noise_tol (1e-3) -> on-policy: z(FV) = 0.
    gen = torch.Generator().manual_seed(0)
    size = 400
    lpr = -torch.rand(size, generator=gen)
    noise = (torch.rand(size, generator=gen) * 2 - 1) * 5e-5 + 2e-5  # a slight drift
    h = torch.rand(size, generator=gen)
    mask = torch.ones(size, dtype=torch.bool)
    got = branching_scores(h, lpr + noise, lpr, mask)
    assert float(got.fv.std(unbiased=False)) > 1e-4
    assert got.z_fv.abs().max() == 0 and got.bs.abs().max() == 0
    # One token moved by 2e-3 (an optimizer step's size, not noise): FV is scored.
    moved = noise.clone()
    moved[100] = 2e-3
    got = branching_scores(h, lpr + moved, lpr, mask)
    assert got.z_fv.abs().max() > 0
    # A token the current policy excludes (lr = -inf) is a difference, never noise.
    excluded = noise.clone()
    excluded[5] = float("-inf")
    got = branching_scores(h, lpr + excluded, lpr, mask)
    assert got.z_fv.abs().max() > 0 and torch.isfinite(got.bs).all()


def test_default_noise_tolerance_follows_the_scoring_dtype(tok):
    from appo.rollout.scoring import LR_NOISE_TOL

    trajs, _ = hand_built(tok)
    # lr of 0.05 at every token: noise for a bfloat16 scorer, a real difference in float32.
    shifted = [torch.tensor(t.logp_rollout) + 0.05 * (-1) ** torch.arange(len(t.logp_rollout))
               for t in trajs]
    assert LR_NOISE_TOL[torch.float32] < 0.05 < LR_NOISE_TOL[torch.bfloat16]
    s = RolloutSettings()
    by_entropy = picks(plan_branches(trajs, [torch.tensor(t.logp_rollout) for t in trajs],
                                     {"u": 4}, s, tok))
    assert picks(plan_branches(trajs, shifted, {"u": 4}, s, tok,
                               score_dtype=torch.bfloat16)) == by_entropy
    assert picks(plan_branches(trajs, shifted, {"u": 4}, s, tok,
                               score_dtype=torch.float32)) != by_entropy
    # An explicit rollout.lr_noise_tol wins over the dtype's default.
    loose = RolloutSettings(lr_noise_tol=1.0)
    assert picks(plan_branches(trajs, shifted, {"u": 4}, loose, tok,
                               score_dtype=torch.float32)) == by_entropy


def test_score_fn_rows_must_match_the_responses(tok):
    trajs, current = hand_built(tok)
    with pytest.raises(AppoError, match="score_fn returned 4 log-probs for trajectory"):
        plan_branches(trajs, [current[0][:-1], current[1]], {"u": 2}, RolloutSettings(), tok)


def test_hf_score_fn_reproduces_the_behaviour_log_probs_under_processed_sampling():
    # On-policy, the score_fn's log-probs must equal the engine's logp_rollout, which is
    # under the distribution actually sampled (repetition penalty, temperature, top-k,
    # top-p): lr ~ 0 for every sampled token, so FV is 1 and nothing ranks by noise.
    from appo.models import load_model
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams
    from appo.rollout.scoring import hf_score_fn

    lm = load_model("tiny-test", device="cpu")
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, repetition_penalty=1.3)
    s = RolloutSettings(n=3, initial_rollouts=3, max_response_length=40, sampling=params)
    prompts = [RolloutPrompt("a", lm.tokenizer.encode("score me")),
               RolloutPrompt("b", lm.tokenizer.encode("and me too, please"))]
    batch = rollout(prompts, HFEngine(lm.model, lm.tokenizer, seed=5), None, s,
                    strategy="grpo")
    score = hf_score_fn(lm.model, params)
    assert score.dtype == torch.float32
    for traj, current in zip(batch.trajectories, score(batch.trajectories), strict=True):
        assert current.shape == (len(traj.response_ids),)
        lr = current - torch.tensor(traj.logp_rollout)
        assert lr.abs().max() < 1e-4, traj.traj_id
    # At the temperature alone (as verl recomputes), top-k/top-p/penalty leave a gap.
    plain = hf_score_fn(lm.model, SamplingParams(temperature=0.7))(batch.trajectories)
    gaps = [float((c - torch.tensor(t.logp_rollout)).abs().max())
            for t, c in zip(batch.trajectories, plain, strict=True)]
    assert max(gaps) > 1e-2
    with pytest.raises(AppoError, match="SamplingParams"):
        hf_score_fn(lm.model, 0.7)


def test_prompt_only_branches_reach_the_credit_mapping(tok):
    # Every initial row answers with EOS at once: no token can be a split point, so the
    # branches fall back to the prompt (split -1). The appo advantages must accept them:
    # they count in the branch z-scores and credit no token of their parent.
    from appo.algos.advantages import AdvantageParams
    from appo.trainer.batch import TrainBatch, compute_advantages

    eng = ScriptedEngine(tok, lambda e, r, ids: Step("", finish="eos"))
    batch = rollout([RolloutPrompt("a", tok.encode("q"))], eng, FakeTools(),
                    RolloutSettings(n=4, initial_rollouts=2), strategy="appo",
                    score_fn=lambda ts: [torch.tensor(t.logp_rollout) for t in ts])
    branches = [t for t in batch.trajectories if t.is_branch]
    assert len(branches) == 2 and {t.branch_token_index for t in branches} == {-1}
    for reward, traj in zip([1.0, 0.0, 1.0, 1.0], batch.trajectories, strict=True):
        traj.reward = reward
    train, _ = compute_advantages(TrainBatch.collate(batch.trajectories, 0), "appo",
                                  AdvantageParams())
    adv = [train.advantages[i, : len(t.response_ids)].tolist()
           for i, t in enumerate(batch.trajectories)]
    z = 0.5 / (0.5 + 1e-6)  # initial rows: rewards 1, 0 -> +-z; no branch credit
    assert [a for a in adv[:2]] == [pytest.approx([z]), pytest.approx([-z])]
    assert adv[2:] == [[0.0], [0.0]]
