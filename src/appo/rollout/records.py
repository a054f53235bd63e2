"""Typed records of a rollout: trajectories, their segments and tool calls, counters.

A `Trajectory` is stored flat, the way the trainer consumes it: `prompt_ids` + `response_ids`
with one `loss_mask` / `logp_rollout` / `entropy` value per response token (forced tool-result
tokens carry `loss_mask=0`, `logp_rollout=0`, `entropy=0`). `segments` keeps the
model/tool boundaries for inspection and the tree view; `tool_calls` keeps what each call did.

Branch provenance (docs/algorithms.md §2.2 arpo.6, §2.4 appo.4): `parent_id` names the trajectory a branch was copied from and
`branch_token_index` is the split index `t`: the branch is `prompt + parent.response[:t+1]`
followed by its own continuation (the split token is shared, as in
`appo.algos.advantages.BranchTree`).

Serialisation is JSON Lines, one trajectory per line, lossless: ids are ints and the
float32 log-probs / entropies are stored as Python floats, whose `repr` round-trips exactly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from appo.errors import AppoError

# Why a trajectory ended.
FINISH_REASONS = ("eos", "length", "call_limit")


@dataclass
class ToolCallRecord:
    """One tool call: what the model asked for and what it got back.

    `result_start` / `result_end` index the forced result tokens in `response_ids`.
    """

    tool: str
    content: str
    result: str
    ok: bool
    error_kind: str | None = None
    latency_s: float = 0.0
    cached: bool = False
    result_start: int = 0
    result_end: int = 0


@dataclass
class Segment:
    """A run of response tokens `[start, end)`: sampled by the model or forced (tool result).

    `entropy` is the segment entropy `H_seg` the branching rules use (model segments only).
    """

    start: int
    end: int
    is_model: bool
    entropy: float | None = None


@dataclass
class Trajectory:
    uid: str  # prompt group
    traj_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logp_rollout: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    tool_calls: list[ToolCallRecord] = field(default_factory=list)
    parent_id: str | None = None
    branch_token_index: int | None = None
    is_branch: bool = False
    finish_reason: str | None = None
    truncated: bool = False
    error: str | None = None  # why generation failed (finish_reason "error"), else None
    reward: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # pass-through (data_source, truth)

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def num_tool_calls(self) -> int:
        return len(self.tool_calls)

    def sampled_mask(self) -> list[int]:
        """1 where the response token was sampled by the model (independent of loss_mask)."""
        mask = [0] * len(self.response_ids)
        for seg in self.segments:
            if seg.is_model:
                mask[seg.start : seg.end] = [1] * (seg.end - seg.start)
        return mask

    def check(self) -> None:
        """Raise AppoError if the per-token arrays disagree in length or segments leave gaps."""
        size = len(self.response_ids)
        for name in ("loss_mask", "logp_rollout", "entropy"):
            if len(getattr(self, name)) != size:
                raise AppoError(
                    f"trajectory {self.traj_id}: {name} has {len(getattr(self, name))} values "
                    f"for {size} response tokens"
                )
        pos = 0
        for seg in self.segments:
            if seg.start != pos or seg.end < seg.start:
                raise AppoError(f"trajectory {self.traj_id}: segments are not contiguous")
            pos = seg.end
        if pos != size:
            raise AppoError(f"trajectory {self.traj_id}: segments cover {pos} of {size} tokens")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        if not isinstance(data, dict):
            raise AppoError(f"a trajectory record must be a JSON object, got "
                            f"{type(data).__name__}")
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k not in TEXT_FIELDS}
        unknown = set(data) - known
        if unknown:
            raise AppoError(f"unknown trajectory fields {sorted(unknown)}")
        data = dict(data)
        data["segments"] = [Segment(**s) for s in data.get("segments", [])]
        data["tool_calls"] = [ToolCallRecord(**c) for c in data.get("tool_calls", [])]
        return cls(**data)


@dataclass
class BranchEvent:
    """One branch decision that created a row (arpo / aepo / appo), for the tree view."""

    uid: str
    parent_id: str
    child_id: str
    round: int
    branch_token_index: int
    h_seg: float | None = None  # arpo/aepo: entropy of the segment that ended
    h_init: float | None = None
    # arpo: P(branch) of the rule, clip(branch_probability + entropy_weight * delta);
    # aepo: the penalised draw p that was compared with branch_probability.
    probability: float | None = None
    score: float | None = None  # appo: Branching Score of the split token


@dataclass
class PremonitorRecord:
    """AEPO entropy pre-monitoring of one prompt: `m` initial rollouts from H_root - H_tool."""

    uid: str
    h_root: float
    h_tool: float
    initial_rollouts: int


@dataclass
class RolloutStats:
    """Counters of one rollout call.

    `tokens_prefilled`: tokens pushed through the model in prefill forwards (prompts, tool
    results, a branch's first token); `tokens_decoded`: single-token decode steps;
    `tokens_reused`: context tokens whose keys/values came from the cache instead of being
    recomputed. `prefilled + reused` is what an engine without any cache reuse would prefill
    (every row re-reading its whole context at every round).
    """

    tokens_prefilled: int = 0
    tokens_decoded: int = 0
    tokens_reused: int = 0
    tokens_sampled: int = 0
    tokens_forced: int = 0
    tool_calls: int = 0
    tool_seconds: float = 0.0
    branches: int = 0
    rounds: int = 0
    trajectories: int = 0
    wall_seconds: float = 0.0
    premonitor_trajectories: int = 0

    @property
    def recompute_tokens(self) -> int:
        return self.tokens_prefilled + self.tokens_reused

    def add_engine(self, other: EngineCounters) -> None:
        self.tokens_prefilled += other.prefilled
        self.tokens_decoded += other.decoded
        self.tokens_reused += other.reused


@dataclass
class EngineCounters:
    prefilled: int = 0
    decoded: int = 0
    reused: int = 0

    def minus(self, earlier: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.prefilled - earlier.prefilled,
            self.decoded - earlier.decoded,
            self.reused - earlier.reused,
        )


@dataclass
class RolloutBatch:
    """What a strategy returns: trajectories (grouped by `uid`), counters, branch events."""

    trajectories: list[Trajectory]
    stats: RolloutStats
    branch_events: list[BranchEvent] = field(default_factory=list)
    premonitor: list[PremonitorRecord] = field(default_factory=list)

    def by_uid(self) -> dict[str, list[Trajectory]]:
        groups: dict[str, list[Trajectory]] = {}
        for traj in self.trajectories:
            groups.setdefault(traj.uid, []).append(traj)
        return groups


TEXT_FIELDS = ("prompt_text", "response_text")  # derived from the ids, for reading only


def _finite(value: Any) -> Any:
    # JSON has no NaN/inf; a non-finite log-prob or reward is a bug upstream, so say so.
    if isinstance(value, float) and not math.isfinite(value):
        raise AppoError(f"non-finite value {value!r} in a trajectory; refusing to write it")
    return value


MODEL_KEY = "model"  # extra["model"]: the model spec that wrote a dump line (`appo view`)


def model_record(spec: str | Path) -> str:
    """A model spec as a dump records it: a local path made absolute (so `appo view` finds it
    from another directory), an alias or hub id as given."""
    text = str(spec)
    path = Path(text).expanduser()
    return str(path.resolve()) if path.exists() else text


def write_jsonl(trajectories: Iterable[Trajectory], path: str | Path, tokenizer=None,
                annotations: Sequence[dict[str, Any]] | None = None,
                model: str | Path | None = None) -> int:
    """Write one trajectory per line; returns the number written.

    `model`: the model spec that produced them (`model.path`), recorded in each line's
    `extra["model"]` (`model_record`), so `appo view` reads the dump with its tokenizer.

    With a tokenizer, each line also carries `prompt_text` and `response_text` (decoded
    ids, special tokens kept) so a dump can be read with `jq`/`grep`; the ids stay the
    record, and `read_jsonl` drops the text again. `annotations[i]` (e.g. the reward's
    accuracy, the mean advantage) is merged into line i's `extra` for `appo view`.
    """
    from appo.fsutil import output_file

    path = Path(path)
    count = 0
    with output_file(path) as tmp, tmp.open("w", encoding="utf-8") as f:
        for i, traj in enumerate(trajectories):
            data = traj.to_dict()
            if annotations is not None:
                data["extra"] = {**data["extra"], **annotations[i]}
            if model is not None:
                data["extra"] = {**data["extra"], MODEL_KEY: model_record(model)}
            for key in ("logp_rollout", "entropy"):
                data[key] = [_finite(float(v)) for v in data[key]]
            if data["reward"] is not None:
                data["reward"] = _finite(float(data["reward"]))
            if tokenizer is not None:
                data["prompt_text"] = tokenizer.decode(traj.prompt_ids)
                data["response_text"] = tokenizer.decode(traj.response_ids)
            f.write(json.dumps(data, ensure_ascii=False, allow_nan=False) + "\n")
            count += 1
    return count


def read_jsonl(path: str | Path) -> list[Trajectory]:
    path = Path(path)
    if not path.is_file():
        raise AppoError(f"trajectory file not found: {path}")
    out = []
    from appo.jsonl import iter_lines

    for lineno, line in iter_lines(path):
        if not line.strip():
            continue
        try:
            out.append(Trajectory.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TypeError, AppoError) as e:
            raise AppoError(f"{path}:{lineno}: not a trajectory record ({e})") from None
    return out
