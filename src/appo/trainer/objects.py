"""Python objects a run takes besides its config: a reward function, rows in memory, a
rollout strategy (`RLTrainer(cfg, reward_fn=..., train_data=..., strategy=...)`).

The config stays the one source of every value; these are what a config cannot hold. Each
is recorded in the run directory's `run.json` under `objects` (a function by its qualified
name, rows by their count and content hash), so a resume says which of them differ from the
run's start, as it does for changed config keys (a warning per difference: the user may
have fixed a bug in their reward on purpose).

A strategy object is registered (`appo.registry.STRATEGIES`) under the name it already has
there, else its qualified name, and `rollout.strategy` is set to that name: the config (and
every checkpoint's copy of it) says which strategy ran.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appo.data.sources import InMemoryRows, rows_from_object
from appo.errors import AppoError
from appo.fsutil import atomic_write_text
from appo.registry import STRATEGIES, qualified_name
from appo.rewards.user_fn import reward_form

RUN_RECORD = "run.json"  # appo.trainer.rundir.RUN_MARKER


def _describe_rows(rows: InMemoryRows) -> str:
    text = json.dumps(list(rows.rows), sort_keys=True, default=str)
    return f"{len(rows.rows)} rows in memory, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"


@dataclass
class PythonObjects:
    """What `RLTrainer` was given besides the config; None where the config decides."""

    reward_fn: Any = None
    train_data: InMemoryRows | None = None
    val_data: InMemoryRows | None = None
    strategy: Any = None

    @classmethod
    def given(cls, cfg: Any, reward_fn: Any = None, train_data: Any = None,
              val_data: Any = None, strategy: Any = None) -> PythonObjects:
        """Checked (one line per problem) and, for a strategy, registered and named in
        `cfg.rollout.strategy`."""
        if reward_fn is not None and not callable(reward_fn):
            raise AppoError(f"reward_fn: {type(reward_fn).__name__} is not callable")
        if reward_fn is not None:
            reward_form(reward_fn, qualified_name(reward_fn))  # either form, else one line
        if reward_fn is not None and cfg.custom_reward_function.path:
            raise AppoError("reward_fn= and custom_reward_function.path="
                            f"{cfg.custom_reward_function.path}: give one reward function")
        objects = cls(
            reward_fn=reward_fn,
            train_data=rows_from_object(train_data, "train_data") if train_data is not None
            else None,
            val_data=rows_from_object(val_data, "val_data") if val_data is not None else None,
            strategy=strategy,
        )
        if strategy is not None:
            if not callable(strategy):
                raise AppoError(f"strategy: {type(strategy).__name__} is not callable (give a "
                                "function with the signature of appo.rollout.strategies."
                                "Strategy)")
            name = STRATEGIES.name_of(strategy)
            if name is None:
                name = qualified_name(strategy)
                STRATEGIES.register(name, strategy)
            cfg.rollout.strategy = name
        return objects

    def identity(self) -> dict[str, str]:
        """What `run.json` records: one description per object given."""
        out: dict[str, str] = {}
        if self.reward_fn is not None:
            out["reward_fn"] = qualified_name(self.reward_fn)
        if self.train_data is not None:
            out["train_data"] = _describe_rows(self.train_data)
        if self.val_data is not None:
            out["val_data"] = _describe_rows(self.val_data)
        if self.strategy is not None:
            out["strategy"] = qualified_name(self.strategy)
        return out

    def record(self, run_dir: Path, resume: bool, announce: bool = True) -> list[str]:
        """Compare with (on a resume) and write `run_dir/run.json`'s `objects`; returns the
        differences, each also printed as a warning when `announce`."""
        file = Path(run_dir) / RUN_RECORD
        try:
            record = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
        except (OSError, ValueError, UnicodeDecodeError):
            record = {}
        record = record if isinstance(record, dict) else {}
        old = record.get("objects", {}) if isinstance(record.get("objects"), dict) else {}
        new = self.identity()
        changes = [f"{key}: {old.get(key, 'none (config)')} -> {new.get(key, 'none (config)')}"
                   for key in sorted(set(old) | set(new)) if old.get(key) != new.get(key)]
        if resume and announce:
            for line in changes:
                print(f"appo: warning: resuming with another Python object: {line}",
                      file=sys.stderr)
        if new or old:
            record["objects"] = new
            atomic_write_text(file, json.dumps(record, indent=1, sort_keys=True) + "\n")
        return changes if resume else []
