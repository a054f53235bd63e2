"""Evaluation records: one `SampleRecord` per (question, sample), stored as JSON Lines.

`<out>/<benchmark>/samples.jsonl` is append-only, which makes a run resumable: a rerun reads
it, skips every (question, sample) pair already finished and appends the rest. A sample
whose generation failed for infrastructure reasons (the server did not answer) is written
with `error` set, is not counted as finished, and is superseded by the rerun's line; when
one key has several lines, the last finished one wins.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from appo.errors import AppoError
from appo.jsonl import read_text


@dataclass
class SampleRecord:
    benchmark: str
    question_id: str  # position of the question in the benchmark file (after --limit)
    sample: int  # 0 .. k-1
    question: str
    ground_truth: str | list[str]
    data_source: str
    prediction: str  # the response text (model output and tool results)
    answer: str | None  # the final answer the grader extracted (strict format)
    score: float  # the reward function's score (training reward)
    correct: bool  # final verdict: rule-based, or the judge when one is configured
    correct_rule: bool  # the rule-based verdict (reward accuracy / math-verify)
    correct_lenient: bool  # rule-based, with lenient answer extraction (no format needed)
    format_ok: bool
    reason: str
    tool_calls: dict[str, int] = field(default_factory=dict)  # executed calls per tool
    tool_errors: int = 0  # executed calls whose result was an error
    limit_hits: int = 0  # calls refused because a tool's call limit was reached
    finish_reason: str | None = None
    truncated: bool = False
    prompt_tokens: int = 0
    response_tokens: int = 0
    judge: str | None = None  # Correct / Incorrect / None (not asked)
    judge_error: str | None = None
    error: str | None = None  # infrastructure failure: not finished, retried on rerun

    @property
    def key(self) -> tuple[str, int]:
        return (self.question_id, self.sample)

    @property
    def finished(self) -> bool:
        return self.error is None

    @property
    def total_tool_calls(self) -> int:
        return sum(self.tool_calls.values())

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SampleRecord:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise AppoError(f"unknown sample record fields {sorted(unknown)}")
        return cls(**data)


def read_samples(path: str | Path) -> list[SampleRecord]:
    """Every line of a samples file (missing file: empty). A torn last line (a run killed
    mid-write) is ignored; a bad line elsewhere is an error."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = read_text(path, hint="move the file away to start over").splitlines()
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(SampleRecord.from_dict(json.loads(line)))
        except (json.JSONDecodeError, TypeError, AppoError) as e:
            if lineno == len(lines) and isinstance(e, json.JSONDecodeError):
                break
            raise AppoError(f"{path}:{lineno}: not a sample record ({e}); move the file away "
                            "to start over") from None
    return out


def latest(records: list[SampleRecord]) -> dict[tuple[str, int], SampleRecord]:
    """One record per (question, sample): the last finished one, else the last one."""
    out: dict[tuple[str, int], SampleRecord] = {}
    for rec in records:
        prev = out.get(rec.key)
        if prev is None or rec.finished or not prev.finished:
            out[rec.key] = rec
    return out


def append_lines(path: Path, lines: list[str]) -> None:
    """Append lines and fsync, so a finished chunk survives a crash of the next one."""
    if not lines:
        return
    from appo.fsutil import write_error

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        drop_torn_tail(path)
        size = path.stat().st_size if path.exists() else 0
        with path.open("a", encoding="utf-8") as f:
            try:
                f.write("".join(line + "\n" for line in lines))
                f.flush()
                os.fsync(f.fileno())
            except OSError:
                f.truncate(size)  # no half-written chunk stays (a full disk, say)
                raise
    except OSError as e:
        raise write_error(e, path) from None


def drop_torn_tail(path: Path) -> None:
    """Cut a partial last line (a run killed mid-write): its sample is simply redone."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    with path.open("r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)


def _traj_lines(path: Path) -> list[tuple[str | None, str]]:
    """(trajectory id, line) of every complete line; a torn last line is left out."""
    if not path.is_file():
        return []
    text = read_text(path, hint="move the file away to start over")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    elif lines:
        lines.pop()  # no newline at the end: a torn last line
    out: list[tuple[str | None, str]] = []
    for line in lines:
        try:
            tid = json.loads(line).get("traj_id")
        except (json.JSONDecodeError, AttributeError):
            tid = None
        out.append((tid if isinstance(tid, str) else None, line))
    return out


def trajectory_ids(path: str | Path) -> set[str]:
    """The ids of the complete trajectory lines of an eval's `trajectories.jsonl`."""
    return {tid for tid, _ in _traj_lines(Path(path)) if tid is not None}


def keep_trajectories(path: str | Path, keep: set[str]) -> None:
    """Rewrite `trajectories.jsonl` (atomically) with only the lines whose id is in `keep`,
    the first of each: samples about to be generated again must not appear twice."""
    from appo.outdir import write_output

    path = Path(path)
    seen: set[str] = set()
    out = []
    for tid, line in _traj_lines(path):
        if tid is None or tid not in keep or tid in seen:
            continue
        seen.add(tid)
        out.append(line + "\n")
    write_output(path, "".join(out))
