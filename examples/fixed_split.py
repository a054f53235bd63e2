"""A rollout strategy of your own, as a plugin: `appo train --plugin examples/fixed_split.py
rollout.strategy=fixed_split` (docs/extending.md).

The rule, deliberately simple: sample `rollout.initial_rollouts` whole answers per prompt,
then fill the prompt's budget of `rollout.n` rows with branches that restart every answer
after its first `SPLIT` tokens (the branches share that prefix with their parent and are
trained like any row). Every row is tagged in `extra`, so a rollout dump shows which
strategy made it.
"""

from __future__ import annotations

import appo
from appo.rollout import RolloutBatch, ToolLoop
from appo.rollout.records import BranchEvent

SPLIT = 3  # tokens of the parent's answer a branch keeps


@appo.register_strategy("fixed_split")
def fixed_split(prompts, engine, tools, settings, rng=None, score_fn=None) -> RolloutBatch:
    loop = ToolLoop(engine, tools, settings)
    loop.prepare(prompts)
    rows = [loop.start(p) for p in prompts for _ in range(settings.initial)]
    loop.run_until_done(rows)
    branches = []
    for p in prompts:
        parents = [r for r in rows if r.traj.uid == p.uid and r.traj.response_ids]
        for i in range(settings.n - settings.initial):
            if not parents:
                break
            parent = parents[i % len(parents)]
            split = min(SPLIT, len(parent.traj.response_ids)) - 1  # keep tokens 0..split
            event = BranchEvent(p.uid, parent.traj.traj_id, "", loop.round + 1, split)
            branches.append(loop.branch(parent, split=split, event=event))
    loop.run_until_done(branches)
    everything = rows + branches
    for row in everything:
        row.traj.extra["strategy"] = "fixed_split"
    loop.release(everything)
    loop.release_roots()
    return RolloutBatch([r.traj for r in everything], loop.finalize_stats(), list(loop.events))
