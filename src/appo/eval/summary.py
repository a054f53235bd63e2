"""Benchmark summaries from sample records: pass@1, unbiased pass@k, tool statistics
(docs/algorithms.md §8.2).

Per benchmark, over its finished samples (failed generations are counted, not graded):

- `pass@1`: mean over questions of `c / n` (the mean over samples when every question has
  `n = k` samples); `pass@k`: the unbiased estimator (`appo.eval.passk`) over questions with
  at least `k` finished samples; `lenient pass@1`: the same with lenient answer extraction;
- tool calls per answer (executed calls per sample), per tool, and the tool usage rate
  (fraction of samples with at least one executed call); tool error rate per call;
- format failures (the grader found no well-formed answer), truncations, response length.

The overall row is the unweighted mean of the benchmark rows (each benchmark counts once,
as in the papers' "Avg." column); question and sample counts are summed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from appo.eval.passk import mean_pass_at_k
from appo.eval.records import SampleRecord


@dataclass
class BenchmarkSummary:
    name: str
    questions: int = 0
    samples: int = 0  # finished samples graded
    k: int = 1
    pass_at_1: float = 0.0
    pass_at_k: float = 0.0
    pass_at_1_lenient: float = 0.0
    mean_score: float = 0.0
    tool_calls_per_answer: float = 0.0
    tool_calls_per_tool: dict[str, float] = field(default_factory=dict)
    tool_usage_rate: float = 0.0
    tool_error_rate: float = 0.0  # per executed call
    format_failure_rate: float = 0.0
    truncation_rate: float = 0.0
    mean_response_tokens: float = 0.0
    incomplete_questions: int = 0  # fewer than k finished samples (left out of pass@k)
    failed_samples: int = 0  # generation failed (server error); rerun to retry
    judged: int = 0  # samples the judge was asked about
    judge_errors: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summarize_benchmark(name: str, records: list[SampleRecord], k: int) -> BenchmarkSummary:
    """Summary of one benchmark from its latest record per (question, sample)."""
    done = [r for r in records if r.finished]
    by_question: dict[str, list[SampleRecord]] = defaultdict(list)
    for r in done:
        by_question[r.question_id].append(r)
    s = BenchmarkSummary(name=name, k=k)
    s.questions = len({r.question_id for r in records})
    s.samples = len(done)
    s.failed_samples = len(records) - len(done)
    counts = [(len(g), sum(r.correct for r in g)) for g in by_question.values()]
    lenient = [(len(g), sum(r.correct_lenient for r in g)) for g in by_question.values()]
    s.pass_at_1 = mean_pass_at_k(counts, 1)
    s.pass_at_1_lenient = mean_pass_at_k(lenient, 1)
    full = [(n, c) for n, c in counts if n >= k]
    s.incomplete_questions = s.questions - len(full)
    s.pass_at_k = mean_pass_at_k(full, k)
    if not done:
        return s
    s.mean_score = _mean([r.score for r in done])
    calls = [r.total_tool_calls for r in done]
    s.tool_calls_per_answer = _mean(calls)
    tools = sorted({t for r in done for t in r.tool_calls})
    s.tool_calls_per_tool = {t: _mean([r.tool_calls.get(t, 0) for r in done]) for t in tools}
    s.tool_usage_rate = _mean([float(c > 0) for c in calls])
    s.tool_error_rate = sum(r.tool_errors for r in done) / sum(calls) if sum(calls) else 0.0
    s.format_failure_rate = _mean([float(not r.format_ok) for r in done])
    s.truncation_rate = _mean([float(r.truncated) for r in done])
    s.mean_response_tokens = _mean([r.response_tokens for r in done])
    s.judged = sum(r.judge is not None for r in done)
    s.judge_errors = sum(r.judge_error is not None for r in done)
    return s


RATE_FIELDS = ("pass_at_1", "pass_at_k", "pass_at_1_lenient", "mean_score",
               "tool_calls_per_answer", "tool_usage_rate", "tool_error_rate",
               "format_failure_rate", "truncation_rate", "mean_response_tokens")
COUNT_FIELDS = ("questions", "samples", "incomplete_questions", "failed_samples", "judged",
                "judge_errors")


def overall(rows: list[BenchmarkSummary], k: int) -> BenchmarkSummary:
    """Unweighted mean of the benchmark rows (counts summed)."""
    out = BenchmarkSummary(name="overall", k=k)
    if not rows:
        return out
    for f in RATE_FIELDS:
        setattr(out, f, _mean([getattr(r, f) for r in rows]))
    for f in COUNT_FIELDS:
        setattr(out, f, sum(getattr(r, f) for r in rows))
    tools = sorted({t for r in rows for t in r.tool_calls_per_tool})
    out.tool_calls_per_tool = {t: _mean([r.tool_calls_per_tool.get(t, 0.0) for r in rows])
                               for t in tools}
    return out


# ---------------------------------------------------------------- rendering
def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def table_rows(rows: list[BenchmarkSummary], k: int) -> tuple[list[str], list[list[str]]]:
    tools = sorted({t for r in rows for t in r.tool_calls_per_tool})
    header = ["benchmark", "questions", "samples", "pass@1 %"]
    if k > 1:
        header.append(f"pass@{k} %")
    header += ["lenient pass@1 %", "calls/answer", *[f"{t} calls" for t in tools],
               "tool use %", "tool err %", "format fail %", "truncated %", "resp tokens"]
    body = []
    for r in rows:
        line = [r.name, str(r.questions), str(r.samples), _pct(r.pass_at_1)]
        if k > 1:
            line.append(_pct(r.pass_at_k))
        line += [_pct(r.pass_at_1_lenient), f"{r.tool_calls_per_answer:.2f}",
                 *[f"{r.tool_calls_per_tool.get(t, 0.0):.2f}" for t in tools],
                 _pct(r.tool_usage_rate), _pct(r.tool_error_rate), _pct(r.format_failure_rate),
                 _pct(r.truncation_rate), f"{r.mean_response_tokens:.0f}"]
        body.append(line)
    return header, body


def render_markdown(rows: list[BenchmarkSummary], k: int) -> str:
    header, body = table_rows(rows, k)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return "\n".join(lines)


def render_text(rows: list[BenchmarkSummary], k: int) -> str:
    header, body = table_rows(rows, k)
    widths = [max(len(c) for c in col) for col in zip(header, *body, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*cells) for cells in [header, *body])
