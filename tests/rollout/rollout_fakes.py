"""Test doubles for the rollout tests: a scripted engine, fake tools, a scripted rng.

`ScriptedEngine` implements the engine protocol without a model: each decode asks a script
for the next segment of a row (text, per-token entropy, finish), given the row's tokens, so
tests control exactly which tool calls happen and what the segment entropies are. Forks copy
a row's tokens, as the real engines do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from appo.rollout.engine import SegmentOutput
from appo.rollout.records import EngineCounters
from appo.rollout.sampling import SamplingParams, sampling_log_probs
from appo.tools.base import ToolResult


@dataclass
class Step:
    """One scripted segment: its text, the entropy of every token, how it ends."""

    text: str
    entropy: float | list[float] = 1.0
    finish: str = "stop"  # "stop" (ends with a tool closing tag), "eos", "length"
    logp: float = -0.5


# script(engine, row_id, ids) -> Step
Script = Callable[["ScriptedEngine", int, list[int]], Step]


class ScriptedEngine:
    def __init__(self, tokenizer, script: Script):
        self.tokenizer = tokenizer
        self.script = script
        self.counters = EngineCounters()
        self.rows: dict[int, list[int]] = {}
        self.next_id = 0
        self.stop_strings: list[str] = []
        self.decode_calls: list[list[int]] = []  # row ids of each decode call
        self.released: list[int] = []

    def set_stop_strings(self, stop_strings):
        self.stop_strings = list(stop_strings)

    def reseed(self, seed):
        pass  # scripted: nothing is sampled

    def _new(self, ids):
        rid = self.next_id
        self.next_id += 1
        self.rows[rid] = list(ids)
        return rid

    def add_row(self, prompt_ids):
        return self._new(prompt_ids)

    def prefill(self, rows):
        pass

    def fork(self, row, k=1, at=None, segment_start=None):
        ids = self.rows[row] if at is None else self.rows[row][:at]
        return [self._new(ids) for _ in range(k)]

    def append(self, row, token_ids):
        self.rows[row].extend(token_ids)

    def row_ids(self, row):
        return list(self.rows[row])

    def release(self, rows):
        for r in rows:
            self.released.append(r)
            self.rows.pop(r, None)

    def decode(self, rows, max_new_tokens, params):
        self.decode_calls.append(list(rows))
        outs = []
        for rid, budget in zip(rows, max_new_tokens, strict=True):
            step = self.script(self, rid, self.rows[rid])
            ids = self.tokenizer.encode(step.text, add_special_tokens=False)
            if step.finish == "eos":
                ids = ids + [self.tokenizer.eos_token_id]
            ent = step.entropy
            ents = list(ent) if isinstance(ent, list) else [float(ent)] * len(ids)
            ents = (ents + [ents[-1]] * len(ids))[: len(ids)]
            finish, stop = step.finish, None
            if finish == "stop":
                stop = next(s for s in self.stop_strings if step.text.endswith(s))
            if len(ids) > budget:
                ids, ents, finish, stop = ids[:budget], ents[:budget], "length", None
            self.rows[rid].extend(ids)
            self.counters.decoded += len(ids)
            outs.append(SegmentOutput(ids, [step.logp] * len(ids), ents, finish, stop,
                                      topk_entropies=[e / 2 for e in ents]))
        return outs

    def count(self, ids: list[int], text: str) -> int:
        """How many times `text` occurs in the decoded ids (e.g. results so far)."""
        return self.tokenizer.decode(ids).count(text)


@dataclass
class FakeTools:
    """A tool executor: `python` answers `out:<content>`; records every batch of calls."""

    tags: list[str] = field(default_factory=lambda: ["python"])
    batches: list[list] = field(default_factory=list)
    reply: Callable[[str, str], str] | None = None

    def execute_many(self, calls):
        self.batches.append(list(calls))
        out = []
        for c in calls:
            if not c.content.strip():
                out.append(ToolResult(f"Error: empty <{c.tool}> call", ok=False,
                                      error_kind="error"))
            else:
                text = self.reply(c.tool, c.content) if self.reply else f"out:{c.content}"
                out.append(ToolResult(text, ok=True, latency_s=0.001))
        return out


class ScriptedRng:
    """`.random()` returns the given values in order (then repeats the last one)."""

    def __init__(self, values: list[float]):
        self.values = list(values)
        self.i = 0

    def random(self) -> float:
        v = self.values[min(self.i, len(self.values) - 1)]
        self.i += 1
        return v


def full_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


class Recorder:
    """Tracks, per engine row, which absolute positions were sampled with which logp/entropy."""

    def __init__(self, engine):
        self.engine = engine
        self.sampled: dict[int, dict[int, tuple[float, float]]] = {}

    def decode(self, rows, budgets, params):
        starts = {r: len(self.engine.row_ids(r)) for r in rows}
        outs = self.engine.decode(rows, budgets, params)
        for r, out in zip(rows, outs, strict=True):
            rec = self.sampled.setdefault(r, {})
            for k, (lp, ent) in enumerate(zip(out.logps, out.entropies, strict=True)):
                rec[starts[r] + k] = (lp, ent)
        return outs

    def fork(self, row, k=1, at=None):
        kids = self.engine.fork(row, k, at=at)
        for kid in kids:
            inherited = {p: v for p, v in self.sampled.get(row, {}).items()
                         if at is None or p < at}
            self.sampled[kid] = dict(inherited)
        return kids

    def max_error(self, model, row, params=SamplingParams()) -> float:
        ids = self.engine.row_ids(row)
        logits = full_logits(model, ids)
        worst = 0.0
        for pos, (lp, ent) in self.sampled[row].items():
            seen = None
            if params.repetition_penalty != 1.0:
                seen = torch.zeros((1, logits.shape[-1]), dtype=torch.bool)
                seen[0, torch.tensor(ids[:pos])] = True
            ref = sampling_log_probs(logits[pos - 1 : pos], params, seen)[0]
            ref_ent = -(ref.exp() * torch.nan_to_num(ref, neginf=0.0)).sum()
            worst = max(worst, abs(float(ref[ids[pos]]) - lp), abs(float(ref_ent) - ent))
        return worst


def tiny_tokenizer():
    from appo.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()
