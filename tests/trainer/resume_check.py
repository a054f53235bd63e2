"""Shared scaffolding of the "resume equals uninterrupted" tests: one run straight to
`steps`, one to `resume_at` in another directory, then that one resumed to `steps`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appo.trainer.loop import RLTrainer


@dataclass
class ResumeRuns:
    straight: RLTrainer  # ran to `steps` without a break (in `a`)
    resumed: RLTrainer  # ran to `resume_at`, then resumed to `steps` (in `b`)
    full: list[dict[str, Any]]  # the straight run's metrics, every step
    rest: list[dict[str, Any]]  # the resumed run's metrics, the steps after the resume
    a: Path
    b: Path
    resume_at: int

    def assert_same_metrics(self, keys: list[str]) -> None:
        """The steps after the resume logged the same `keys` bit for bit (CPU)."""
        assert [h["step"] for h in self.rest] == [h["step"] for h in self.full[self.resume_at:]]
        assert self.rest, "the resumed run ran no step"
        for a, b in zip(self.full[self.resume_at:], self.rest, strict=True):
            for k in keys:
                assert a[k] == b[k], (a["step"], k, a[k], b[k])


def straight_and_resumed(toy: dict[str, Path], tmp_path: Path, *overrides: str,
                         steps: int = 3, resume_at: int = 2) -> ResumeRuns:
    """Run the toy config with `overrides` straight to `steps` (`tmp_path/a`) and to
    `resume_at` then resumed to `steps` (`tmp_path/b`); checks the resume starts at
    `resume_at`."""
    from test_trainer_rl import toy_config  # here: test_trainer_rl imports this module

    def trainer(out: Path, total: int, *extra: str) -> RLTrainer:
        return RLTrainer(toy_config(toy, *overrides, f"trainer.total_steps={total}",
                                    f"trainer.default_local_dir={out}", *extra),
                         progress=False)

    a, b = tmp_path / "a", tmp_path / "b"
    straight = trainer(a, steps)
    full = straight.fit()
    trainer(b, resume_at).fit()
    resumed = trainer(b, steps, "trainer.resume=true")
    assert resumed.step == resume_at
    rest = resumed.fit()
    return ResumeRuns(straight, resumed, full, rest, a, b, resume_at)
