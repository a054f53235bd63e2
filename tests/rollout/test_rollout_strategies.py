"""grpo / arpo / aepo exactness with a scripted engine (controllable tokens and entropies)."""

from __future__ import annotations

import math
import random

import pytest
from rollout_fakes import FakeTools, ScriptedEngine, ScriptedRng, Step, tiny_tokenizer

from appo.config import CHOICES, load_config
from appo.rollout import STRATEGIES, RolloutPrompt, RolloutSettings, rollout
from appo.rollout.strategies import aepo_initial_rollouts, arpo_branch_probability


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def results_so_far(engine, ids):
    return engine.count(ids, "<result>")


def script_calls(calls, entropy=lambda k: 1.0 + k):
    """Every row: `calls` tool calls (segment k has entropy entropy(k)), then an answer."""

    def script(engine, rid, ids):
        k = results_so_far(engine, ids)
        if k < calls:
            return Step(f"<python>{k}</python>", entropy=entropy(k))
        return Step("<answer>a</answer>", entropy=entropy(k), finish="eos")

    return script


def scripted_settings(**kw) -> RolloutSettings:
    """Settings whose H_seg is the mean of the scripted per-token entropies (`mean`), so the
    hand computations below read the script's numbers directly."""
    return RolloutSettings(entropy_measure="mean", **kw)


def prompts(tok, count):
    return [RolloutPrompt(f"p{i}", tok.encode(f"question {i}")) for i in range(count)]


def test_strategy_registry_matches_config_choices():
    from appo.rollout import ENGINES

    assert tuple(STRATEGIES) == CHOICES["rollout.strategy"]
    assert ENGINES == CHOICES["rollout.name"]


def test_grpo_makes_n_independent_rows(tok):
    eng = ScriptedEngine(tok, script_calls(1))
    batch = rollout(prompts(tok, 3), eng, FakeTools(), RolloutSettings(n=5), strategy="grpo")
    groups = batch.by_uid()
    assert sorted(groups) == ["p0", "p1", "p2"]
    assert all(len(g) == 5 for g in groups.values())
    assert all(t.parent_id is None and not t.is_branch for t in batch.trajectories)
    assert len({t.traj_id for t in batch.trajectories}) == 15


@pytest.mark.parametrize("n,initial,beam,calls,seed", [
    (8, 4, 2, 3, 0), (16, 8, 3, 2, 1), (5, 8, 2, 1, 2), (6, 1, 4, 0, 3), (7, 3, 2, 5, 4),
])
def test_arpo_fills_exactly_n_per_prompt(tok, n, initial, beam, calls, seed):
    rng = random.Random(seed)
    entropies = {}

    def entropy(k):  # random segment entropies: branch decisions go both ways
        return entropies.setdefault(k, rng.uniform(0.0, 4.0))

    eng = ScriptedEngine(tok, script_calls(calls, entropy))
    s = RolloutSettings(n=n, initial_rollouts=initial, beam_size=beam)
    batch = rollout(prompts(tok, 4), eng, FakeTools(), s, strategy="arpo",
                    rng=random.Random(seed))
    for uid, group in batch.by_uid().items():
        assert len(group) == n, uid
        ids = {t.traj_id for t in group}
        for t in group:
            if t.parent_id is not None:
                assert t.parent_id in ids
                parent = next(p for p in group if p.traj_id == t.parent_id)
                # The branch shares the parent's tokens up to the split (a tool result end).
                cut = t.branch_token_index + 1
                assert t.response_ids[:cut] == parent.response_ids[:cut]
                assert t.loss_mask[:cut] == parent.loss_mask[:cut]
                assert t.logp_rollout[:cut] == parent.logp_rollout[:cut]
                assert parent.loss_mask[t.branch_token_index] == 0  # last token of a result
    assert batch.stats.trajectories == 4 * n


def _branch_stats(tok, delta, draws=3000, seed=0):
    """Fraction branching at decision 1 (delta 0) and at decision 2 (delta given)."""
    h0 = 1.0

    def entropy(k):
        return h0 if k == 0 else h0 + delta

    eng = ScriptedEngine(tok, script_calls(2, entropy))
    s = scripted_settings(n=2, initial_rollouts=1, beam_size=2, branch_probability=0.5,
                        entropy_weight=0.2)
    batch = rollout(prompts(tok, draws), eng, FakeTools(), s, strategy="arpo",
                    rng=random.Random(seed))
    first = {e.uid for e in batch.branch_events if e.round == 1}
    second = {e.uid for e in batch.branch_events if e.round == 2}
    for e in batch.branch_events:
        expected = arpo_branch_probability(e.h_seg - e.h_init, s)
        assert e.probability == pytest.approx(expected)
    return len(first) / draws, len(second) / (draws - len(first))


@pytest.mark.parametrize("delta,expected", [(1.5, 0.8), (-1.0, 0.3), (5.0, 1.0), (-5.0, 0.0)])
def test_arpo_branch_probability_follows_the_entropy_rule(tok, delta, expected):
    # P(branch) = clip(branch_probability + entropy_weight * delta, 0, 1). Decision 1 has
    # delta = 0 (the first segment is H_init itself): P = 0.5. With 3000 draws the std of a
    # frequency is <= 0.0091 at decision 1 and <= 0.013 at decision 2; 0.05 is ~4 sigma.
    p1, p2 = _branch_stats(tok, delta)
    assert p1 == pytest.approx(0.5, abs=0.05)
    assert p2 == pytest.approx(expected, abs=0.05)


def test_arpo_h_init_is_reset_between_rollout_calls(tok):
    eng = ScriptedEngine(tok, script_calls(2, lambda k: 5.0))
    s = scripted_settings(n=4, initial_rollouts=2, branch_probability=0.5)
    rollout(prompts(tok, 3), eng, FakeTools(), s, strategy="arpo", rng=random.Random(0))
    # Second call, same engine: every segment has entropy 1.0. If H_init leaked from the
    # first call (5.0), delta would be -4 and P(branch) = 0.5 - 0.8 -> 0.
    eng.script = script_calls(2, lambda k: 1.0)
    batch = rollout(prompts(tok, 50), eng, FakeTools(), s, strategy="arpo",
                    rng=random.Random(1))
    assert batch.branch_events
    assert all(e.h_init == 1.0 and e.probability == 0.5 for e in batch.branch_events)


def test_arpo_starts_fresh_rows_one_per_round_when_a_prompt_has_none_active(tok):
    eng = ScriptedEngine(tok, script_calls(0))  # every row answers at once: nothing to branch
    s = RolloutSettings(n=5, initial_rollouts=2)
    batch = rollout(prompts(tok, 1), eng, FakeTools(), s, strategy="arpo")
    # round 1: the 2 initial rows; rounds 2..4: one fresh row each.
    assert [len(c) for c in eng.decode_calls] == [2, 1, 1, 1]
    assert len(batch.trajectories) == 5 and batch.stats.rounds == 4
    assert all(t.parent_id is None for t in batch.trajectories)


def test_arpo_initial_rollouts_are_clamped_to_n(tok):
    eng = ScriptedEngine(tok, script_calls(1))
    s = RolloutSettings(n=3, initial_rollouts=8)
    batch = rollout(prompts(tok, 2), eng, FakeTools(), s, strategy="arpo")
    assert [len(c) for c in eng.decode_calls][0] == 6
    assert all(len(g) == 3 for g in batch.by_uid().values())


def test_aepo_initial_rollouts_formula():
    # m = clamp(int(n * sigmoid(beta * (H_root - H_tool))) + 1, 1, n)
    # n=8, beta=0.5, dH=1.5: sigmoid(0.75) = 0.679179 -> int(5.433) + 1 = 6
    assert aepo_initial_rollouts(8, 3.0, 1.5, 0.5) == 6
    # dH=0: sigmoid(0) = 0.5 -> int(4) + 1 = 5
    assert aepo_initial_rollouts(8, 2.0, 2.0, 0.5) == 5
    # very confident root: int(8 * ~1.0) + 1 = 9 -> clamped to n = 8
    assert aepo_initial_rollouts(8, 40.0, 0.0, 0.5) == 8
    # very uncertain tool calls: int(8 * ~0) + 1 = 1
    assert aepo_initial_rollouts(8, 0.0, 40.0, 0.5) == 1


def test_aepo_premonitor_sets_m(tok):
    # Short generation: entropy 3.0 per token -> H_root = 3.0. Pre-rollout: segments with
    # entropies 1.0 (tool call) and 2.0 (answer) -> H_tool = 1.5. m = 6 (see formula test).
    seen_first = set()

    def script(engine, rid, ids):
        k = results_so_far(engine, ids)
        key = tuple(ids)
        if k == 0 and key not in seen_first and len(seen_first) < 1:
            seen_first.add(key)
            return Step("short generation", entropy=3.0, finish="length")
        if k == 0:
            return Step("<python>1</python>", entropy=1.0)
        return Step("<answer>a</answer>", entropy=2.0, finish="eos")

    eng = ScriptedEngine(tok, script)
    s = scripted_settings(n=8, initial_rollouts=4, beta=0.5, branch_probability=1.0)
    batch = rollout(prompts(tok, 1), eng, FakeTools(), s, strategy="aepo", rng=random.Random(0))
    [rec] = batch.premonitor
    assert rec.h_root == pytest.approx(3.0) and rec.h_tool == pytest.approx(1.5)
    assert rec.initial_rollouts == 6
    sizes = [len(c) for c in eng.decode_calls]
    # short generation (1), pre-rollout (2 rounds of 1), then the 6 initial rows
    assert sizes[:4] == [1, 1, 1, 6]
    assert len(batch.trajectories) == 8
    assert batch.stats.premonitor_trajectories == 1


def aepo_script(calls, entropy):
    """The AEPO short generation first (entropy 0: H_root = 0), then every row: `calls` tool
    calls (segment k has entropy entropy(k)) and an answer."""
    short_done = []

    def script(engine, rid, ids):
        k = results_so_far(engine, ids)
        if k == 0 and not short_done:
            short_done.append(rid)
            return Step("warm up", entropy=0.0, finish="length")
        if k < calls:
            return Step(f"<python>{k}</python>", entropy=entropy(k))
        return Step("<answer>a</answer>", entropy=entropy(k), finish="eos")

    return script


def test_aepo_consecutive_branch_penalty_matches_hand_computation(tok):
    """One prompt, m = 1, n = 4, beam 2; every row makes 4 tool calls, segment k has
    entropy 1 + k; branch_probability 0.5, entropy_weight 0.2, branch_penalty 0.25.

    p = (u + 0.2 * delta) * max(0, 1 - 0.25 * c), branch iff p >= 0.5, c = consecutive
    previous rounds with new rows, updated (as the original does) only after rounds in
    which some prompt of the batch got new rows.
    round 1: R0 delta 0, c 0: p = 0.6                      -> branch C1        (c -> 1)
    round 2: R0 delta 2-1=1:  p = (0.5+0.2)*0.75 = 0.525   -> branch C2
             C1 delta 0 (its H_init = 2): p = 0.6*0.75 = 0.45 -> no         (c -> 2)
    round 3: R0 delta 2: p = (0.1+0.4)*0.5 = 0.25 no; C1 delta 3-2=1: (0.2+0.2)*0.5 = 0.2
             no; C2 delta 0: 0.3*0.5 = 0.15 no.  No prompt got new rows: c stays 2.
    round 4: R0 delta 3, c 2: p = (0.0+0.6)*0.5 = 0.3 -> no (a reset c would give 0.6 and a
             branch of R0); C1 delta 4-2=2: p = (0.99+0.4)*0.5 = 0.695 -> branch C3 (n reached)
    """
    eng = ScriptedEngine(tok, aepo_script(4, lambda k: 1.0 + k))
    s = scripted_settings(n=4, initial_rollouts=4, beam_size=2, branch_probability=0.5,
                          entropy_weight=0.2, branch_penalty=0.25, beta=5.0, call_limit=10)
    rng = ScriptedRng([0.6, 0.5, 0.6, 0.1, 0.2, 0.3, 0.0, 0.99])
    batch = rollout(prompts(tok, 1), eng, FakeTools(), s, strategy="aepo", rng=rng)
    # H_root = 0 (warm-up), H_tool = mean(1..5) = 3: m = int(4 * sigmoid(-15)) + 1 = 1
    assert batch.premonitor[0].initial_rollouts == 1
    events = [(e.round, e.probability) for e in batch.branch_events]
    assert [r for r, _ in events] == [1, 2, 4]
    assert [p for _, p in events] == pytest.approx([0.6, 0.525, 0.695])
    first, _, last = batch.branch_events
    assert last.parent_id == first.child_id  # C3 branches from C1, not from R0
    assert rng.i == 8
    assert len(batch.trajectories) == 4


def test_aepo_without_dynamic_rollouts_is_fixed_initial_rollouts_with_the_penalty(tok):
    """`rollout.enable_dynamic_rollouts=false` (both released AEPO scripts): no
    pre-monitoring, `initial_rollouts` rows per prompt, the aepo.3 rule and penalty on.

    Two prompts, 1 initial row each, n = 3, beam 2, penalty 0.25; every segment has entropy
    1.0 (delta = 0), so p = u * max(0, 1 - 0.25 c); rows make 3 calls then answer.
    round 1: R0 (P0) u .9 -> p .9 branch A1; S0 (P1) u .1 no.            c = (1, 0)
    round 2: R0 .1*.75, A1 .1*.75, S0 .1: no new rows: counters unchanged   c = (1, 0)
    round 3: R0 u .6: .6*.75 = .45 no (a reset c0 would give .6 and a branch); A1 u .7:
             .7*.75 = .525 -> branch A2 (P0 full); S0 u .1 no.           c = (2, 0)
    round 4: every row answers (3 results each): no decision, counters unchanged.
    round 5: P1 has 1 finished row: fresh row F; its call, u .6, c1 = 0: .6 -> branch B1.
    """
    def script(engine, rid, ids):
        k = results_so_far(engine, ids)
        if k < 3:
            return Step(f"<python>{k}</python>", entropy=1.0)
        return Step("<answer>a</answer>", entropy=1.0, finish="eos")

    eng = ScriptedEngine(tok, script)
    s = scripted_settings(n=3, initial_rollouts=1, beam_size=2, branch_probability=0.5,
                          entropy_weight=0.2, branch_penalty=0.25, enable_dynamic_rollouts=False)
    rng = ScriptedRng([0.9, 0.1, 0.1, 0.1, 0.1, 0.6, 0.7, 0.1, 0.6])
    batch = rollout(prompts(tok, 2), eng, FakeTools(), s, strategy="aepo", rng=rng)
    assert batch.premonitor == [] and batch.stats.premonitor_trajectories == 0
    assert len(eng.decode_calls[0]) == 2  # the two initial rows, no short generation first
    events = [(e.round, e.uid, e.probability) for e in batch.branch_events]
    assert [(r, u) for r, u, _ in events] == [(1, "p0"), (3, "p0"), (5, "p1")]
    assert [p for _, _, p in events] == pytest.approx([0.9, 0.525, 0.6])
    assert rng.i == 9
    assert all(len(g) == 3 for g in batch.by_uid().values())
    cfg = load_config(overrides=["rollout.strategy=aepo", "rollout.enable_dynamic_rollouts=false"])
    assert RolloutSettings.from_config(cfg).enable_dynamic_rollouts is False
    assert RolloutSettings().enable_dynamic_rollouts is True  # aepo.1-2 on by default


def test_aepo_a_fresh_row_counts_as_a_new_row_for_the_penalty(tok):
    """One prompt, m = 1, n = 3, beam 2, branch_penalty 0.25; every row makes 2 tool calls
    (entropy 1.0 everywhere, so delta = 0) and then answers: p = u * max(0, 1 - 0.25 c).

    rounds 1-2: R0's calls, u = 0.0, 0.0 -> no branch; round 3: R0 answers (c stays 0).
    round 4: R0 done, 1 < n rows: fresh row F1 (a new row of round 4); F1's first call,
             u = 0.0 -> no branch; c -> 1.
    round 5: F1's second call, u = 0.6: p = 0.6 * 0.75 = 0.45 < 0.5 -> no branch (counting
             only branches as new rows, c would be 0, p = 0.6 and F1 would branch); c -> 0.
    round 6: F1 answers. round 7: fresh F2 fills the budget: no more decisions.
    So the budget is filled by fresh rows only, after 4 draws.
    """
    eng = ScriptedEngine(tok, aepo_script(2, lambda k: 1.0))
    s = scripted_settings(n=3, initial_rollouts=3, beam_size=2, branch_probability=0.5,
                        entropy_weight=0.2, branch_penalty=0.25, beta=5.0)
    rng = ScriptedRng([0.0, 0.0, 0.0, 0.6])
    batch = rollout(prompts(tok, 1), eng, FakeTools(), s, strategy="aepo", rng=rng)
    # H_root = 0, H_tool = 1: m = int(3 * sigmoid(-5)) + 1 = 1
    assert batch.premonitor[0].initial_rollouts == 1
    assert batch.branch_events == [] and rng.i == 4
    assert len(batch.trajectories) == 3
    assert all(t.parent_id is None for t in batch.trajectories)


def test_arpo_branch_probability_is_clipped():
    s = RolloutSettings(branch_probability=0.5, entropy_weight=0.2)
    assert arpo_branch_probability(0.0, s) == 0.5
    assert arpo_branch_probability(1.0, s) == pytest.approx(0.7)
    assert arpo_branch_probability(10.0, s) == 1.0
    assert arpo_branch_probability(-10.0, s) == 0.0
    assert math.isclose(arpo_branch_probability(-1.0, s), 0.3)


def test_tree_view_shows_branch_points_entropies_calls_and_finish(tok):
    from appo.rollout.tree import render_tree

    eng = ScriptedEngine(tok, script_calls(2, lambda k: 1.0 + k))
    s = scripted_settings(n=4, initial_rollouts=2, branch_probability=1.0)
    batch = rollout(prompts(tok, 1), eng, FakeTools(), s, strategy="arpo", rng=random.Random(0))
    text = render_tree(batch, tok)
    assert "prompt p0" in text and "4 trajectories" in text
    child = next(t for t in batch.trajectories if t.parent_id)
    assert f"{child.traj_id} [branch]  from {child.parent_id} after response token " \
           f"{child.branch_token_index}" in text
    # first-round decision: delta 0, P = clip(1.0 + 0.2 * 0) = 1
    assert "round 1: H_seg=1.000 H_init=1.000 p=1.000" in text
    assert "python [ok" in text and "finish=eos" in text
