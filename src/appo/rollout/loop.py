"""The tool loop shared by every strategy (docs/algorithms.md §1): rounds of decode -> tools -> results.

One `run_round` decodes one segment for every active row (batched in the engine), runs
the tool calls of all rows that stopped at a closing tag concurrently through the tool
executor, and appends each result as forced tokens. Strategies decide what happens between
rounds (branching, fresh trajectories).

How calls are written, where a segment stops and what text answers a turn's calls is the
call format's (`tools.format`, `appo.tools.formats`: `tags` or `hermes`, docs/algorithms.md
§5.4); the loop only asks it. A turn's calls (hermes: possibly several) are answered by one
forced segment.

Token-in/token-out: the trajectory holds exactly the ids the engine sampled plus the ids of
the formatted tool results; nothing is decoded and re-tokenised on the way to the trainer.
Text is decoded only to find a tool call's content.

Deviation from the original (docs/algorithms.md §1.4, §9 D10): at `tools.call_limit` the original appended EOS; with
`on_limit: notify` (our default) the row gets a result saying the limit is reached and may
still answer; `on_limit: stop` ends it (EOS appended as a forced token).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from appo.errors import AppoError, ToolFatalError
from appo.rollout.engine import Engine, SegmentOutput
from appo.rollout.records import (
    BranchEvent,
    RolloutStats,
    Segment,
    ToolCallRecord,
    Trajectory,
)
from appo.rollout.settings import RolloutSettings, segment_entropy
from appo.tools.formats import ParsedCall, make_call_format

LIMIT_MESSAGE = (
    "Tool call limit reached ({limit} calls). No more tools: give the final answer now."
)
TOOL_LIMIT_MESSAGE = (
    "Tool call limit reached: {tool} may be called at most {limit} times. "
    "No more {tool} calls: continue without it and give the final answer."
)


class ToolRunner(Protocol):
    """What the loop needs from `appo.tools.executor.ToolExecutor`."""

    @property
    def tags(self) -> list[str]: ...

    def execute_many(self, calls: list) -> list: ...


@dataclass
class RolloutPrompt:
    """A prompt as token ids (chat template already applied) plus pass-through metadata."""

    uid: str
    prompt_ids: list[int]
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RowState:
    """A trajectory under construction and its engine row."""

    traj: Trajectory
    erow: int
    prompt: RolloutPrompt
    calls: int = 0
    h_init: float | None = None  # entropy of the row's first (post-branch) segment
    h_last: float | None = None  # entropy of the segment that ended in the latest round
    trainable: bool = True  # False: sampled tokens get loss_mask=0 (appo branches)
    done: bool = False
    got_result: bool = False  # a tool result was appended in the latest round

    @property
    def response_len(self) -> int:
        return len(self.traj.response_ids)


@dataclass
class _Slot:
    """One call of a tool turn and, once known, its result."""

    call: ParsedCall
    result: Any = None  # appo.tools.base.ToolResult


@dataclass
class _Turn:
    """The calls a row made in one segment; answered together by one forced segment."""

    row: RowState
    slots: list[_Slot]


class ToolLoop:
    """Drives an engine and a tool executor for a set of rows (see module docstring)."""

    def __init__(
        self,
        engine: Engine,
        tools: ToolRunner | None,
        settings: RolloutSettings,
        vocab_size: int | None = None,
    ):
        self.engine = engine
        self.tools = tools
        self.settings = settings
        self.tokenizer = engine.tokenizer
        self.tags = list(tools.tags) if tools is not None else []
        schemas = getattr(tools, "schemas", None) if tools is not None else []
        self.format = make_call_format(settings.call_format, self.tokenizer, self.tags,
                                       schemas, settings.result_template)
        engine.set_stop_strings(self.format.stop_strings())
        self.vocab_size = vocab_size or len(self.tokenizer)
        self.stats = RolloutStats()
        self.events: list[BranchEvent] = []
        self.round = 0
        self._roots: dict[str, int] = {}
        self._ids = itertools.count()
        self._counters_at_start = replace(engine.counters)
        self._t0 = time.perf_counter()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self._eos_id = None if eos is None else int(eos)

    # ------------------------------------------------------------------ rows
    def _root(self, prompt: RolloutPrompt) -> int:
        if prompt.uid not in self._roots:
            limit = self.settings.max_prompt_length
            if limit is not None and len(prompt.prompt_ids) > limit:
                raise AppoError(
                    f"prompt {prompt.uid!r} has {len(prompt.prompt_ids)} tokens, more than "
                    f"data.max_prompt_length={limit}; shorten it or raise the limit"
                )
            self._roots[prompt.uid] = self.engine.add_row(list(prompt.prompt_ids))
        return self._roots[prompt.uid]

    def prepare(self, prompts: Sequence[RolloutPrompt]) -> None:
        """Root rows for all prompts, prefilled together (one forward for the batch)."""
        roots = [self._root(p) for p in prompts]
        prefill = getattr(self.engine, "prefill", None)  # optional: stateless engines lack it
        if prefill is not None:
            prefill(roots)

    def _new_id(self, prompt: RolloutPrompt) -> str:
        return f"{prompt.uid}-{next(self._ids)}"

    def start(self, prompt: RolloutPrompt) -> RowState:
        """A fresh trajectory: a fork of the prompt's root row (one prefill per prompt)."""
        [erow] = self.engine.fork(self._root(prompt), 1)
        traj = Trajectory(
            uid=prompt.uid,
            traj_id=self._new_id(prompt),
            prompt_ids=list(prompt.prompt_ids),
            extra=dict(prompt.extra),
        )
        self.stats.trajectories += 1
        return RowState(traj=traj, erow=erow, prompt=prompt)

    def branch(self, row: RowState, split: int | None = None, trainable: bool = True,
               event: BranchEvent | None = None) -> RowState:
        """A copy of `row` (its tokens, masks, log-probs, call counter and KV cache).

        `split=None` copies the whole row (arpo: after a tool result). `split=t` copies
        `prompt + response[:t+1]` (appo); `t=-1` shares the prompt only.
        """
        parent = row.traj
        size = len(parent.response_ids)
        keep = size if split is None else split + 1
        if not 0 <= keep <= size:
            raise AppoError(f"branch split {split} outside a response of {size} tokens")
        segments = []
        for seg in parent.segments:
            if seg.start >= keep:
                break
            segments.append(replace(seg, end=min(seg.end, keep)))
        seg_start = len(parent.prompt_ids) + (
            segments[-1].start if segments and segments[-1].is_model else keep
        )
        at = None if split is None else len(parent.prompt_ids) + keep
        [erow] = self.engine.fork(row.erow, 1, at=at, segment_start=seg_start)
        calls = [c for c in parent.tool_calls if c.result_end <= keep]
        traj = Trajectory(
            uid=parent.uid,
            traj_id=self._new_id(row.prompt),
            prompt_ids=list(parent.prompt_ids),
            response_ids=parent.response_ids[:keep],
            loss_mask=parent.loss_mask[:keep] if trainable else [0] * keep,
            logp_rollout=parent.logp_rollout[:keep],
            entropy=parent.entropy[:keep],
            segments=segments,
            tool_calls=[replace(c) for c in calls],
            parent_id=parent.traj_id,
            branch_token_index=keep - 1,
            is_branch=not trainable,
            extra=dict(parent.extra),
        )
        self.stats.trajectories += 1
        self.stats.branches += 1
        if event is not None:
            event.child_id = traj.traj_id
            event.branch_token_index = keep - 1
            self.events.append(event)
        return RowState(traj=traj, erow=erow, prompt=row.prompt, calls=len(calls),
                        trainable=trainable)

    def release(self, rows: Sequence[RowState]) -> None:
        self.engine.release([r.erow for r in rows])

    def release_roots(self) -> None:
        self.engine.release(list(self._roots.values()))
        self._roots.clear()

    # ------------------------------------------------------------------ records
    def _add_model(self, row: RowState, out: SegmentOutput, h_seg: float) -> None:
        traj = row.traj
        start = len(traj.response_ids)
        count = len(out.token_ids)
        traj.response_ids.extend(out.token_ids)
        traj.loss_mask.extend([1 if row.trainable else 0] * count)
        traj.logp_rollout.extend(out.logps)
        traj.entropy.extend(out.entropies)
        self.stats.tokens_sampled += count
        if traj.segments and traj.segments[-1].is_model:  # an appo branch continues a segment
            traj.segments[-1].end = start + count
        else:
            traj.segments.append(Segment(start, start + count, True, h_seg))

    def _add_forced(self, row: RowState, ids: list[int]) -> tuple[int, int]:
        traj = row.traj
        start = len(traj.response_ids)
        traj.response_ids.extend(ids)
        traj.loss_mask.extend([0] * len(ids))
        traj.logp_rollout.extend([0.0] * len(ids))
        traj.entropy.extend([0.0] * len(ids))
        traj.segments.append(Segment(start, start + len(ids), False))
        self.engine.append(row.erow, ids)
        self.stats.tokens_forced += len(ids)
        return start, start + len(ids)

    def _finish(self, row: RowState, reason: str, truncated: bool = False) -> None:
        row.done = True
        row.traj.finish_reason = reason
        row.traj.truncated = row.traj.truncated or truncated

    def _budget(self, row: RowState) -> int:
        return self.settings.max_response_length - row.response_len

    # ------------------------------------------------------------------ one round
    def run_round(self, rows: Sequence[RowState]) -> list[RowState]:
        """Decode one segment per active row, run the tool calls, append the results.

        Returns the rows that got a tool result appended this round (branch candidates),
        in the order given.
        """
        active = [r for r in rows if not r.done]
        if not active:
            return []
        self.round += 1
        self.stats.rounds += 1
        for r in active:
            r.got_result = False
        outs = self.engine.decode(
            [r.erow for r in active], [self._budget(r) for r in active], self.settings.sampling
        )
        turns: list[_Turn] = []
        for row, out in zip(active, outs, strict=True):
            h_seg = segment_entropy(out, self.settings, self.vocab_size)
            self._add_model(row, out, h_seg)
            row.h_last = h_seg
            if row.h_init is None:
                row.h_init = h_seg
            calls = self._calls(row, out) if out.finish != "error" else []
            if out.finish == "error":
                row.traj.error = out.error or "generation failed"
                self._finish(row, "error")
            elif calls and self._budget(row) <= 0:
                self._finish(row, "length", truncated=True)  # no room for the results
            elif calls:
                turn = self._turn(row, calls)
                if turn is not None:
                    turns.append(turn)
            elif out.finish == "eos":
                self._finish(row, "eos")
            elif out.finish == "length" or self._budget(row) <= 0:
                self._finish(row, "length", truncated=True)
            elif out.finish == "stop":
                raise AppoError(f"engine stopped on unknown stop string {out.stop_string!r}")
            else:
                raise AppoError(f"engine returned unknown finish reason {out.finish!r}")
        if turns:
            self._run_calls(turns)
        return [r for r in active if r.got_result]

    def _calls(self, row: RowState, out: SegmentOutput) -> list[ParsedCall]:
        """The calls of the row's current model segment ([]: not a call turn)."""
        last = out.token_ids[-1] if out.token_ids else None
        if not self.format.may_call(out.finish, last):
            return []
        seg = row.traj.segments[-1]
        text = self.tokenizer.decode(row.traj.response_ids[seg.start : seg.end])
        return self.format.parse(text, out.stop_string)

    def _context(self, row: RowState, tool: str) -> tuple[str, ...]:
        """The row's response so far, one step per segment, for tools that read it (the
        search tool's page step); decoded only for them."""
        resolve = getattr(self.tools, "resolve", None)
        target = resolve(tool) if callable(resolve) else None
        if not getattr(target, "takes_context", False):
            return ()
        ids = row.traj.response_ids
        return tuple(self.tokenizer.decode(ids[s.start : s.end]) for s in row.traj.segments)

    def _turn(self, row: RowState, calls: list[ParsedCall]) -> _Turn | None:
        """Slots for a turn's calls: limit notices and parse errors answered now, the rest
        left for the executor. None: the row stopped at the call limit (on_limit=stop)."""
        from appo.tools.base import ToolResult

        limit = self.settings.call_limit
        if row.calls >= limit and self.settings.on_limit == "stop":
            self._stop_at_limit(row)
            return None
        used = {}
        for c in row.traj.tool_calls:
            if c.error_kind != "limit":
                used[c.tool] = used.get(c.tool, 0) + 1
        limits = self.settings.tool_call_limits or {}
        slots, planned = [], row.calls
        for call in calls:
            slot = _Slot(call)
            if planned >= limit:
                slot.result = ToolResult(LIMIT_MESSAGE.format(limit=limit), ok=False,
                                         error_kind="limit")
            elif call.tool in limits and used.get(call.tool, 0) >= limits[call.tool]:
                if self.settings.on_limit == "stop" and len(calls) == 1:
                    self._stop_at_limit(row)
                    return None
                text = TOOL_LIMIT_MESSAGE.format(tool=call.tool, limit=limits[call.tool])
                slot.result = ToolResult(text, ok=False, error_kind="limit")
            else:
                planned += 1
                used[call.tool] = used.get(call.tool, 0) + 1
                if call.error is not None:
                    slot.result = ToolResult(call.error, ok=False, error_kind="error")
            slots.append(slot)
        return _Turn(row, slots)

    def _stop_at_limit(self, row: RowState) -> None:
        """on_limit=stop (the original): the row ends; tags append EOS as a forced token."""
        if self.format.eos_after_limit and self._eos_id is not None and self._budget(row) > 0:
            self._add_forced(row, [self._eos_id])
        self._finish(row, "call_limit")

    def _run_calls(self, turns: list[_Turn]) -> None:
        from appo.tools.base import ToolResult
        from appo.tools.executor import ToolCall

        todo = [(t, s) for t in turns for s in t.slots if s.result is None]
        calls = [ToolCall(tool=s.call.tool, content=s.call.content,
                          context=self._context(t.row, s.call.tool)) for t, s in todo]
        todo = [s for _, s in todo]
        t0 = time.perf_counter()
        try:
            results = list(self.tools.execute_many(calls)) if calls else []
        except ToolFatalError:
            raise  # a tool that cannot work at all (appo.errors): stop, do not feed the model
        except Exception as e:  # noqa: BLE001 - the executor raises nothing else; be safe
            results = [ToolResult(f"Error: tool execution failed ({type(e).__name__}: {e}).",
                                  ok=False, error_kind="infra") for _ in calls]
        if len(results) != len(calls):
            raise AppoError(f"tool executor returned {len(results)} results for {len(calls)} calls")
        self.stats.tool_seconds += time.perf_counter() - t0
        for slot, result in zip(todo, results, strict=True):
            slot.result = result
        for turn in turns:
            counted = [s for s in turn.slots if s.result.error_kind != "limit"]
            self.stats.tool_calls += len(counted)
            turn.row.calls += len(counted)
            self._append_results(turn.row, turn.slots)

    def _append_results(self, row: RowState, slots: list[_Slot]) -> None:
        """One forced segment answering every call of the turn (tags: one call)."""
        text = self.format.forced_text([(s.call, str(s.result.text)) for s in slots])
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        budget = self._budget(row)
        truncated = len(ids) >= budget
        ids = ids[:budget]
        start, end = self._add_forced(row, ids)
        for s in slots:
            r = s.result
            row.traj.tool_calls.append(ToolCallRecord(
                tool=s.call.tool, content=s.call.content, result=str(r.text), ok=bool(r.ok),
                error_kind=r.error_kind, latency_s=float(r.latency_s), cached=bool(r.cached),
                result_start=start, result_end=end,
            ))
        if truncated:
            self._finish(row, "length", truncated=True)
        else:
            row.got_result = True

    # ------------------------------------------------------------------ driving
    def run_until_done(self, rows: Sequence[RowState]) -> None:
        """Rounds without branching until every row has finished."""
        while any(not r.done for r in rows):
            self.run_round(rows)

    def finalize_stats(self) -> RolloutStats:
        self.stats.wall_seconds = time.perf_counter() - self._t0
        counters = self.engine.counters.minus(self._counters_at_start)
        self.stats.tokens_prefilled = counters.prefilled
        self.stats.tokens_decoded = counters.decoded
        self.stats.tokens_reused = counters.reused
        return self.stats
