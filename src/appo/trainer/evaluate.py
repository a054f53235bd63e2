"""Evaluation inside a training process: roll out held-out prompts with the current policy,
score them, and summarise (training-time validation and `appo demo` both call `evaluate`).

Generation is `appo.rollout.strategies.sample` (through the `grpo` strategy), the call
`appo eval` (`appo.eval.runner`) makes too; the runner adds what a standalone benchmark
needs around it: pass@k over many samples, per-tool call limits, an LLM judge, resumable
sample files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from appo.data.records import RLExample
    from appo.rewards.base import RewardOutput
    from appo.rollout import Trajectory


@dataclass
class Evaluation:
    """Every rank's trajectories with their rewards and the example each answers."""

    trajectories: list[Trajectory]
    rewards: list[RewardOutput]
    examples: list[RLExample]  # aligned with `trajectories`
    questions: int

    def metrics(self, prefix: str = "val") -> dict[str, float]:
        """pass@1 (mean accuracy over all samples), mean reward and tool use."""
        n = max(len(self.trajectories), 1)
        return {
            f"{prefix}/pass@1": sum(o.accuracy for o in self.rewards) / n,
            f"{prefix}/reward": sum(o.score for o in self.rewards) / n,
            f"{prefix}/tool_calls_per_answer":
                sum(t.num_tool_calls for t in self.trajectories) / n,
            f"{prefix}/tool_usage_rate":
                sum(1.0 for t in self.trajectories if t.num_tool_calls) / n,
            f"{prefix}/questions": float(self.questions),
        }

    def by(self, key: Any) -> dict[Any, Evaluation]:
        """Split by `key(example)` (e.g. the synthetic task's level)."""
        parts: dict[Any, list[int]] = {}
        for i, ex in enumerate(self.examples):
            parts.setdefault(key(ex), []).append(i)
        return {k: Evaluation([self.trajectories[i] for i in idx],
                              [self.rewards[i] for i in idx],
                              [self.examples[i] for i in idx],
                              questions=len({id(self.examples[i]) for i in idx}))
                for k, idx in sorted(parts.items())}


def evaluate(trainer: Any, examples: list[RLExample], tag: str, seed: int,
             settings: Any) -> Evaluation:
    """Sample `settings.n` independent answers (grpo) per example from the trainer's current
    policy and score them; gathered over ranks. Examples go in chunks of
    `data.val_batch_size` prompts, one rollout each (chunk `c > 0` has tag `{tag}.{c}` and
    seed `seed + c`), so one chunk's KV cache is alive at a time."""
    size = max(1, int(trainer.cfg.data.val_batch_size))
    trajs, rewards, by_uid = [], [], {}
    for c, start in enumerate(range(0, len(examples), size)):
        batch, uids = trainer.rollout(examples[start : start + size],
                                      tag if c == 0 else f"{tag}.{c}", seed + c,
                                      settings=settings, strategy="grpo")
        trajs += batch.trajectories
        rewards += trainer.score(batch.trajectories, uids)
        by_uid.update(uids)
        del batch  # the next chunk's rows reuse the memory
    dp = trainer.dp
    trajs = dp.gather_objects(trajs)
    rewards = dp.gather_objects(rewards)
    return Evaluation(trajs, rewards, [by_uid[t.uid] for t in trajs], questions=len(examples))
