"""Rollout strategies (`rollout.strategy`): grpo, arpo, aepo, appo (docs/algorithms.md §2).

- `grpo`: `n` independent trajectories per prompt.
- `arpo` (ARPO, 2507.19849): `initial_rollouts` trajectories; after each tool result a row
  branches with probability `clip(branch_probability + entropy_weight * delta)`,
  `delta = H_seg - H_init`, up to `beam_size - 1` copies while the prompt's budget `n`
  lasts; a prompt with no active rows starts one fresh trajectory per round, so every
  prompt ends with exactly `n`. Fix of the original: `H_init` lives in the rollout call
  (the original kept it on the worker and never reset it between batches).
- `aepo` (AEPO, 2510.14545): arpo plus entropy pre-monitoring (`m` initial rollouts from
  `H_root - H_tool`; `rollout.enable_dynamic_rollouts=false`, as both released AEPO scripts
  ran: fixed `initial_rollouts`) and a penalty on consecutive branching rounds: `c` counts
  the consecutive previous rounds in which the prompt got new rows (docs/algorithms.md §2.3
  aepo.3: branches, and the fresh row arpo's fill rule starts when the prompt has no active
  row), reset to 0 by a round in which it got none. As in the original, `c` is updated only
  after rounds in which some prompt of the batch got new rows. The initial rows are not
  counted.
- `appo` (seeds/appo_readme.md): full initial trajectories, then branches at the top-B
  tokens by Branching Score `z(H) * z(FV)`; branch tokens get `loss_mask=0`.

Every strategy has the signature of `Strategy` and returns a `RolloutBatch`; `rng` is
anything with `.random()` (a `random.Random`), used for branch decisions only. A user's
strategy is registered by name (`appo.register_strategy`, docs/extending.md) in the same
registry as these (`appo.registry.STRATEGIES`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from appo.errors import AppoError
from appo.registry import STRATEGIES as _REGISTRY
from appo.registry import get_strategy as _get_strategy
from appo.rollout.engine import Engine
from appo.rollout.loop import RolloutPrompt, RowState, ToolLoop, ToolRunner
from appo.rollout.records import BranchEvent, PremonitorRecord, RolloutBatch
from appo.rollout.settings import RolloutSettings, segment_entropy

ScoreFn = Callable[[list], list]


class Strategy(Protocol):
    def __call__(
        self,
        prompts: Sequence[RolloutPrompt],
        engine: Engine,
        tools: ToolRunner | None,
        settings: RolloutSettings,
        rng: Any = None,
        score_fn: ScoreFn | None = None,
    ) -> RolloutBatch: ...


def _check_prompts(prompts: Sequence[RolloutPrompt]) -> None:
    uids = [p.uid for p in prompts]
    if len(set(uids)) != len(uids):
        raise AppoError("prompt uids in one rollout call must be unique")


def _finish(loop: ToolLoop, rows: list[RowState]) -> RolloutBatch:
    loop.release(rows)
    loop.release_roots()
    stats = loop.finalize_stats()
    return RolloutBatch([r.traj for r in rows], stats, list(loop.events))


# A branching rule: one decision for a row that just got a tool result; returns the event
# describing the branch to make, or None.
Brancher = Callable[[ToolLoop, RowState, str, Any], BranchEvent | None]


def _drive(
    loop: ToolLoop,
    prompts: Sequence[RolloutPrompt],
    initial: dict[str, int],
    n: dict[str, int],
    brancher: Brancher | None,
    rng: Any,
    rows: dict[str, list[RowState]] | None = None,
    on_round_end: Callable[[dict[str, int]], None] | None = None,
) -> list[RowState]:
    """The arpo-family round loop (docs/algorithms.md §2.2 arpo.1, arpo.4, arpo.5). Returns all rows made."""
    rows = rows if rows is not None else {p.uid: [] for p in prompts}
    for p in prompts:
        for _ in range(initial[p.uid]):
            rows[p.uid].append(loop.start(p))
    while True:
        new_rows: dict[str, int] = {p.uid: 0 for p in prompts}  # rows each prompt gets
        # Step 5: a prompt with no active rows but fewer than n rows starts one fresh row.
        for p in prompts:
            group = rows[p.uid]
            if all(r.done for r in group) and len(group) < n[p.uid]:
                group.append(loop.start(p))
                new_rows[p.uid] += 1
        active = [r for p in prompts for r in rows[p.uid] if not r.done]
        if not active:
            break
        resulted = loop.run_round(active)
        if brancher is not None:
            for row in resulted:
                uid = row.traj.uid
                remaining = n[uid] - len(rows[uid])
                for _ in range(loop.settings.beam_size - 1):
                    if remaining <= 0:
                        break
                    event = brancher(loop, row, uid, rng)
                    if event is None:
                        continue
                    child = loop.branch(row, event=event)
                    rows[uid].append(child)
                    new_rows[uid] += 1
                    remaining -= 1
        if on_round_end is not None:
            on_round_end(new_rows)
    return [r for p in prompts for r in rows[p.uid]]


# ---------------------------------------------------------------- grpo
def sample(prompts: Sequence[RolloutPrompt], engine: Engine, tools: ToolRunner | None,
           settings: RolloutSettings) -> RolloutBatch:
    """One independent trajectory per entry of `prompts`, in order; a prompt may appear
    several times (its template is prefilled once). The generation of every evaluation
    (`appo eval`, training-time validation, `appo demo`) and of `grpo` rollouts."""
    loop = ToolLoop(engine, tools, settings)
    loop.prepare(list({p.uid: p for p in prompts}.values()))
    rows = [loop.start(p) for p in prompts]
    try:
        loop.run_until_done(rows)
    except BaseException:
        loop.release(rows)
        loop.release_roots()
        raise
    return _finish(loop, rows)


def rollout_grpo(prompts, engine, tools, settings, rng=None, score_fn=None) -> RolloutBatch:
    _check_prompts(prompts)
    return sample([p for p in prompts for _ in range(settings.n)], engine, tools, settings)


# ---------------------------------------------------------------- arpo
def arpo_branch_probability(delta: float, settings: RolloutSettings) -> float:
    """P(branch) of the arpo rule: `clip(branch_probability + entropy_weight * delta)`."""
    return min(1.0, max(0.0, settings.branch_probability + settings.entropy_weight * delta))


def _arpo_decide(loop: ToolLoop, row: RowState, uid: str, rng) -> BranchEvent | None:
    s = loop.settings
    delta = row.h_last - row.h_init
    p = min(1.0, max(0.0, rng.random() - s.entropy_weight * delta))
    if p > s.branch_probability:
        return None
    return BranchEvent(uid, row.traj.traj_id, "", loop.round, -1, row.h_last, row.h_init,
                       arpo_branch_probability(delta, s))


def rollout_arpo(prompts, engine, tools, settings, rng=None, score_fn=None) -> RolloutBatch:
    _check_prompts(prompts)
    rng = rng if rng is not None else random.Random(settings.seed)
    loop = ToolLoop(engine, tools, settings)
    loop.prepare(prompts)
    initial = {p.uid: settings.initial for p in prompts}
    n = {p.uid: settings.n for p in prompts}
    rows = _drive(loop, prompts, initial, n, _arpo_decide, rng)
    return _finish(loop, rows)


# ---------------------------------------------------------------- aepo
def aepo_initial_rollouts(n: int, h_root: float, h_tool: float, beta: float) -> int:
    """`m = clamp(int(n * sigmoid(beta * (H_root - H_tool))) + 1, 1, n)` (docs/algorithms.md §2.3 aepo.2)."""
    sig = 1.0 / (1.0 + math.exp(-beta * (h_root - h_tool)))
    return max(1, min(n, int(n * sig) + 1))


def aepo_branch_probability(delta: float, consecutive: int, settings: RolloutSettings,
                            u: float) -> float:
    """The aepo rule's `p` for a uniform draw `u`; branch iff `p >= branch_probability`."""
    p = u + settings.entropy_weight * delta
    p *= max(0.0, 1.0 - settings.branch_penalty * consecutive)
    return min(1.0, max(0.0, p))


def _premonitor(loop: ToolLoop, prompts: Sequence[RolloutPrompt]) -> tuple[
        dict[str, float], dict[str, float], dict[str, RowState]]:
    """AEPO entropy pre-monitoring: `H_root` from a short generation, `H_tool` from one
    complete tool-using pre-rollout, per prompt (all prompts batched)."""
    s = loop.settings
    short = [loop.start(p) for p in prompts]
    outs = loop.engine.decode([r.erow for r in short],
                              [min(s.initial_entropy_tokens, s.max_response_length)] * len(short),
                              s.sampling)
    h_root = {r.traj.uid: segment_entropy(o, s, loop.vocab_size)
              for r, o in zip(short, outs, strict=True)}
    loop.release(short)
    loop.stats.trajectories -= len(short)  # not trajectories of the batch
    pre = [loop.start(p) for p in prompts]
    loop.run_until_done(pre)
    h_tool = {}
    for r in pre:
        seg_h = [seg.entropy for seg in r.traj.segments if seg.is_model]
        h_tool[r.traj.uid] = sum(seg_h) / len(seg_h) if seg_h else 0.0
        r.h_init = None
    loop.stats.premonitor_trajectories += len(pre)
    loop.round = 0  # branch events count the rounds of the main phase
    return h_root, h_tool, {r.traj.uid: r for r in pre}


def rollout_aepo(prompts, engine, tools, settings, rng=None, score_fn=None) -> RolloutBatch:
    _check_prompts(prompts)
    rng = rng if rng is not None else random.Random(settings.seed)
    s = settings
    loop = ToolLoop(engine, tools, settings)
    loop.prepare(prompts)
    rows: dict[str, list[RowState]] = {p.uid: [] for p in prompts}
    initial: dict[str, int] = {p.uid: s.initial for p in prompts}
    records: list[PremonitorRecord] = []
    if s.enable_dynamic_rollouts:
        _dynamic_initial(loop, prompts, rows, initial, records)
    consecutive = {p.uid: 0 for p in prompts}

    def decide(loop: ToolLoop, row: RowState, uid: str, rng) -> BranchEvent | None:
        delta = row.h_last - row.h_init
        p = aepo_branch_probability(delta, consecutive[uid], s, rng.random())
        if p < s.branch_probability:
            return None
        return BranchEvent(uid, row.traj.traj_id, "", loop.round, -1, row.h_last, row.h_init, p)

    def round_end(new_rows: dict[str, int]) -> None:
        # The original updates the counters only after a round in which some prompt of the
        # batch got new rows; a round with none leaves every counter as it was.
        if not any(new_rows.values()):
            return
        for uid, count in new_rows.items():
            consecutive[uid] = consecutive[uid] + 1 if count else 0

    n = {p.uid: s.n for p in prompts}
    all_rows = _drive(loop, prompts, initial, n, decide, rng, rows=rows, on_round_end=round_end)
    batch = _finish(loop, all_rows)
    batch.premonitor = records
    return batch


def _dynamic_initial(loop: ToolLoop, prompts: Sequence[RolloutPrompt],
                     rows: dict[str, list[RowState]], initial: dict[str, int],
                     records: list[PremonitorRecord]) -> None:
    """aepo.1-2: pre-monitor every prompt and set its `m` initial rollouts (in `initial`;
    with `reuse_premonitor`, the pre-rollout joins `rows` as one of them)."""
    s = loop.settings
    h_root, h_tool, pre = _premonitor(loop, prompts)
    reused = int(s.reuse_premonitor)
    for p in prompts:
        m = aepo_initial_rollouts(s.n, h_root[p.uid], h_tool[p.uid], s.beta)
        if s.reuse_premonitor:
            rows[p.uid].append(pre[p.uid])
            m -= 1
        else:
            loop.release([pre[p.uid]])
            loop.stats.trajectories -= 1
        initial[p.uid] = m
        records.append(PremonitorRecord(p.uid, h_root[p.uid], h_tool[p.uid], m + reused))


# ---------------------------------------------------------------- appo
def rollout_appo(prompts, engine, tools, settings, rng=None, score_fn=None) -> RolloutBatch:
    from appo.rollout.scoring import noisiest, plan_branches

    _check_prompts(prompts)
    s = settings
    if score_fn is None:
        raise AppoError(
            "the appo strategy needs a score_fn (current-policy log-probs of each response "
            "token); build one with appo.rollout.scoring.hf_score_fn(model)"
        )
    loop = ToolLoop(engine, tools, settings)
    loop.prepare(prompts)
    initial_rows = [loop.start(p) for p in prompts for _ in range(s.initial)]
    loop.run_until_done(initial_rows)
    trajs = [r.traj for r in initial_rows]
    current = score_fn(trajs)
    if len(current) != len(trajs):
        raise AppoError(f"score_fn returned {len(current)} results for {len(trajs)} trajectories")
    budget = {p.uid: s.n - s.initial for p in prompts}
    plan = plan_branches(trajs, current, budget, s, engine.tokenizer,
                         score_dtype=noisiest(getattr(score_fn, "dtype", None),
                                              getattr(engine, "matmul_dtype", None)))
    branches = []
    for choice in plan:
        parent = initial_rows[choice.row]
        event = BranchEvent(parent.traj.uid, parent.traj.traj_id, "", loop.round + 1,
                            choice.split, score=choice.score, h_seg=choice.entropy)
        branches.append(loop.branch(parent, split=choice.split, trainable=False, event=event))
    loop.run_until_done(branches)
    return _finish(loop, initial_rows + branches)


# The names live in one registry (`appo.registry.STRATEGIES`), which config validation
# reads: the built-ins are registered there by reference to the functions above, a user's
# strategy by `appo.register_strategy` or a `--plugin` module.
STRATEGIES = _REGISTRY
get_strategy = _get_strategy
