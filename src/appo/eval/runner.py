"""`appo eval`: run a model with tools over benchmarks, k samples per question
(docs/algorithms.md §8.1).

Generation is `appo.rollout.strategies.sample`, the same call that generates the trainer's
validation, `appo demo` and `grpo` rollouts: k independent trajectories per question,
through the same `ToolLoop` the trainer uses, on any engine (the local `hf` engine or an
OpenAI-compatible server, `appo.rollout.openai_engine`). Work is cut into chunks of
`batch_size` samples; each chunk is one batched rollout, then graded and appended to
`<out>/<benchmark>/samples.jsonl` (and the full trajectories to `trajectories.jsonl`, which
`appo view` renders), so an interrupted run resumes where it stopped.

Grading: the benchmark's reward function (routed by data source, `appo.rewards`) gives the
score, the strict verdict and the format check; the same function with lenient answer
extraction gives a second verdict for models never taught the `<answer>\\boxed{}` format.
With a judge (`appo.eval.judge`), samples the rule-based check rejects are judged.

The eval keeps the original's per-tool call limits (`eval.tool_call_limits`, e.g. 5 python /
10 search; `RolloutSettings.tool_call_limits` of the shared loop). A call over its tool's
limit is answered with a limit notice (`on_limit: notify`) or ends the row (`stop`).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appo.errors import AppoError
from appo.eval.records import (
    SampleRecord,
    append_lines,
    keep_trajectories,
    latest,
    read_samples,
    trajectory_ids,
)
from appo.eval.summary import (
    BenchmarkSummary,
    overall,
    render_markdown,
    render_text,
    summarize_benchmark,
)
from appo.eval.tokens import token_texts
from appo.outdir import write_output
from appo.rollout.loop import RolloutPrompt
from appo.rollout.records import RolloutStats, Trajectory
from appo.rollout.settings import RolloutSettings
from appo.rollout.strategies import sample

SAMPLES_FILE = "samples.jsonl"
TRAJECTORIES_FILE = "trajectories.jsonl"
IDENTITY_FILE = "eval.json"  # what produced the output directory (`eval_identity`)


# ---------------------------------------------------------------- benchmarks
@dataclass
class Benchmark:
    name: str
    spec: str
    examples: list  # appo.data.RLExample


def parse_data_arg(item: str) -> tuple[str, str]:
    """`NAME=SPEC` -> (NAME, SPEC); a bare SPEC is named after its file or synthetic task."""
    name, eq, spec = item.partition("=")
    if eq and name and "/" not in name and ":" not in name and "?" not in name:
        return name.strip(), spec.strip()
    from appo.data.rl import default_data_source
    from appo.data.sources import parse_spec

    parsed = parse_spec(item)
    if parsed.kind == "synth":
        return parsed.target, item
    return default_data_source(parsed.target), item


def check_benchmark_name(name: str) -> None:
    """A benchmark's outputs go to `<out>/<name>/`: a name that is not one plain directory
    name (`..`, `a/b`, empty) would write outside `--out` or into another benchmark's."""
    if name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise AppoError(f"benchmark name {name!r} is not a plain directory name (its outputs go "
                        "to <out>/<name>/); name it with NAME=SPEC, e.g. gsm8k=data/test.jsonl")


def eval_identity(cfg: Any, settings: RolloutSettings, tags: Sequence[str],
                  served_model: str | None = None) -> dict[str, Any]:
    """What makes two evaluations' samples the same kind of sample: the model, sampling,
    length cap, tools and their limits, prompt rendering and grading. Stored in the output
    directory (`IDENTITY_FILE`); a rerun into it must match, so resumed samples are never
    mixed with another model's or another sampling's. Not in it: k and --limit (more or
    fewer samples of the same kind), the seed, the batch size, the server's address."""
    s = settings.sampling
    return {
        "model.path": str(cfg.model.path), "--served-model": served_model,
        "eval.temperature": s.temperature, "eval.top_p": s.top_p, "eval.top_k": s.top_k,
        "eval.repetition_penalty": s.repetition_penalty,
        "eval.max_response_length": settings.max_response_length,
        "tools": list(tags), "eval.tool_call_limits": dict(settings.tool_call_limits or {}),
        "rollout.on_limit": settings.on_limit,
        "tools.format": settings.call_format, "data.template": cfg.data.template,
        "data.prompt_key": cfg.data.prompt_key,
        "data.appo_stage_prompt": bool(cfg.data.appo_stage_prompt),
        "custom_reward_function.path": cfg.custom_reward_function.path or None,
        "eval.judge_model": (cfg.eval.judge_model if cfg.eval.judge_base_url else None),
    }


def load_benchmarks(items: Sequence[str], template: str, tools: Sequence[str],
                    prompt_key: str = "prompt", limit: int | None = None,
                    stage_prompt: bool = False, call_format: str = "tags") -> list[Benchmark]:
    from appo.data import load_rl_data

    out: list[Benchmark] = []
    for item in items:
        name, spec = parse_data_arg(item)
        check_benchmark_name(name)
        if any(b.name == name for b in out):
            raise AppoError(f"benchmark name {name!r} given twice; name them with NAME=PATH")
        examples = load_rl_data([spec], template=template, tools=list(tools),
                                prompt_key=prompt_key, stage_prompt=stage_prompt,
                                call_format=call_format).examples
        if limit is not None:
            examples = examples[:limit]
        out.append(Benchmark(name, spec, examples))
    return out


# ---------------------------------------------------------------- settings
def tool_limits(limits: dict[str, int] | Any, tags: Sequence[str], default: int) -> dict[str, int]:
    """Per-tool call limits for the configured tool tags (a tag without one gets `default`)."""
    given = dict(limits or {})
    return {tag: int(given.get(tag, default)) for tag in tags}


def eval_settings(cfg: Any, k: int, tags: Sequence[str]) -> RolloutSettings:
    """Rollout settings of an evaluation: eval.* sampling, response length and tool limits."""
    from appo.rollout.sampling import SamplingParams

    e = cfg.eval
    limits = tool_limits(e.tool_call_limits, tags, int(cfg.tools.call_limit))
    sampling = SamplingParams(temperature=float(e.temperature), top_p=float(e.top_p),
                              top_k=int(e.top_k), repetition_penalty=float(e.repetition_penalty))
    settings = RolloutSettings.from_config(
        cfg, n=k, sampling=sampling, max_response_length=int(e.max_response_length),
        # The loop checks the total first; the per-tool limits are the binding ones.
        call_limit=max(1, sum(limits.values())) if limits else int(cfg.tools.call_limit),
        tool_call_limits=limits,
        max_prompt_length=None,  # an evaluation grades every question it was given
    )
    return settings


# ---------------------------------------------------------------- grading
class Grader:
    """Rule-based verdicts (strict + lenient) and, optionally, the judge's."""

    def __init__(self, router, lenient_router, judge=None):
        self.router = router
        self.lenient_router = lenient_router
        self.judge = judge

    def grade(self, ex, text: str) -> tuple[Any, Any]:
        strict = self.router(ex.data_source, text, ex.ground_truth, ex.extra_info, ex.ability)
        lenient = self.lenient_router(ex.data_source, text, ex.ground_truth, ex.extra_info,
                                      ex.ability)
        return strict, lenient

    def apply_judge(self, items: list[tuple[SampleRecord, Any, str | None]]) -> None:
        """Judge the samples the rule-based check rejected (math-verify as a first check).

        `items`: (record, example, lenient answer); the judge sees the strict answer, else
        the lenient one (a model that never learnt the format still gets judged).
        """
        if self.judge is None:
            return
        from appo.eval.judge import JudgeRequest
        from appo.rewards.base import as_answer_list
        from appo.rewards.math_reward import is_equivalent

        asks, targets = [], []
        for rec, ex, lenient_answer in items:
            if rec.error is not None or rec.correct_rule:
                continue
            prediction = rec.answer if rec.answer is not None else lenient_answer
            if prediction and any(is_equivalent(prediction, g)
                                  for g in as_answer_list(ex.ground_truth)):
                rec.correct = True
                continue
            if not prediction:
                continue  # nothing to judge: no answer at all
            asks.append(JudgeRequest(rec.question, ex.ground_truth, prediction))
            targets.append(rec)
        for rec, verdict in zip(targets, self.judge(asks), strict=True):
            rec.judge = verdict.verdict
            rec.judge_error = verdict.error
            if verdict.verdict == "Correct":
                rec.correct = True


def _tool_counts(traj: Trajectory) -> tuple[dict[str, int], int, int]:
    calls: Counter = Counter()
    errors = limits = 0
    for c in traj.tool_calls:
        if c.error_kind == "limit":
            limits += 1
            continue
        calls[c.tool] += 1
        errors += not c.ok
    return dict(calls), errors, limits


def _finite(values: list[float]) -> list[float]:
    return [float(v) if math.isfinite(v) else 0.0 for v in values]


# ---------------------------------------------------------------- the evaluator
def _traj_id(bench: str, index: int, sample: int) -> str:
    """A trajectory's id in `trajectories.jsonl`: its benchmark, question and sample."""
    return f"{bench}:{index}/s{sample}"


def chunk_seed(seed: int, start: int) -> int:
    """The sampler seed of the chunk whose first sample is number `start` of the run's full
    list (benchmarks, questions, samples in order): a function of the two alone, so a
    resumed run reseeds each chunk as the uninterrupted one did. The first chunk keeps
    `seed` itself."""
    return seed if start == 0 else (seed * 1_000_003 + start) % 2**62


@dataclass
class _Work:
    bench: Benchmark
    index: int  # question position
    sample: int


@dataclass
class EvalResult:
    summaries: list[BenchmarkSummary]
    overall: BenchmarkSummary
    k: int
    generated: int  # samples generated by this run
    resumed: int  # samples found finished in the output dir
    failed: int  # samples whose generation failed in this run
    wall_seconds: float
    stats: RolloutStats = field(default_factory=RolloutStats)
    summary_path: Path | None = None

    def table(self) -> str:
        return render_text([*self.summaries, self.overall], self.k)


class Evaluator:
    def __init__(self, engine, tools, tokenizer, settings: RolloutSettings,
                 grader: Grader, batch_size: int = 64,
                 log: Callable[[str], None] = print, run_info: dict | None = None):
        if batch_size < 1:
            raise AppoError(f"batch size must be >= 1, got {batch_size}")
        self.engine = engine
        self.tools = tools
        self.tokenizer = tokenizer
        self.settings = settings
        self.limits = dict(settings.tool_call_limits or {})
        self.grader = grader
        self.batch_size = batch_size
        self.log = log
        self.run_info = dict(run_info or {})
        self._prompt_ids: dict[tuple[str, int], list[int]] = {}

    def _template_tools(self) -> list[dict] | None:
        """The tools' function schemas for the chat template (tools.format=hermes)."""
        if self.settings.call_format != "hermes" or self.tools is None:
            return None
        return list(getattr(self.tools, "schemas", None) or []) or None

    def _prompt(self, bench: Benchmark, index: int) -> RolloutPrompt:
        key = (bench.name, index)
        ex = bench.examples[index]
        if key not in self._prompt_ids:
            try:
                ids = self.tokenizer.apply_chat_template(ex.prompt, tools=self._template_tools(),
                                                         add_generation_prompt=True,
                                                         tokenize=True, return_dict=False)
            except Exception as e:  # noqa: BLE001 - no template, or a template error
                raise AppoError(f"cannot render the chat prompt of {bench.name} question "
                                f"{index} with the model's chat template ({type(e).__name__}: "
                                f"{e}); evaluate a chat model or give its tokenizer") from None
            self._prompt_ids[key] = [int(i) for i in ids]
        extra = {"benchmark": bench.name, "question_id": str(index),
                 "data_source": ex.data_source, "ground_truth": ex.ground_truth,
                 "question": ex.question}
        return RolloutPrompt(f"{bench.name}:{index}", self._prompt_ids[key], extra)

    def _pending(self, benchmarks: list[Benchmark], out: Path, k: int) -> tuple[list[_Work], int]:
        work: list[_Work] = []
        resumed = 0
        for bench in benchmarks:
            done = {key: rec for key, rec in latest(read_samples(out / bench.name / SAMPLES_FILE)
                                                    ).items() if rec.finished}
            # A finished sample counts only with its trajectory (written first, so a kill
            # between the two writes, or a torn trajectory line, redoes the sample).
            trajs = out / bench.name / TRAJECTORIES_FILE
            have = trajectory_ids(trajs)
            for i, ex in enumerate(bench.examples):
                for s in range(k):
                    rec = done.get((str(i), s))
                    if rec is None or (trajs.exists() and _traj_id(bench.name, i, s) not in have):
                        work.append(_Work(bench, i, s))
                        continue
                    if rec.question != ex.question:
                        raise AppoError(
                            f"{out / bench.name / SAMPLES_FILE} holds question {i} as "
                            f"{rec.question[:60]!r}, but {bench.spec} has {ex.question[:60]!r}: "
                            "the output directory belongs to another run; use a new --out"
                        )
                    resumed += 1
            redo = have & {_traj_id(bench.name, w.index, w.sample)
                           for w in work if w.bench is bench}
            if redo:  # lines of samples about to be redone: they must not stay twice
                keep_trajectories(trajs, have - redo)
        return work, resumed

    def _record(self, w: _Work, traj: Trajectory) -> tuple[SampleRecord, str | None]:
        """The graded record of one sample, and its lenient answer (for the judge)."""
        error = traj.error
        ex = w.bench.examples[w.index]
        text = self.tokenizer.decode(traj.response_ids, skip_special_tokens=True)
        calls, tool_errors, limit_hits = _tool_counts(traj)
        rec = SampleRecord(
            benchmark=w.bench.name, question_id=str(w.index), sample=w.sample,
            question=ex.question, ground_truth=ex.ground_truth, data_source=ex.data_source,
            prediction=text, answer=None, score=0.0, correct=False, correct_rule=False,
            correct_lenient=False, format_ok=False, reason="", tool_calls=calls,
            tool_errors=tool_errors, limit_hits=limit_hits, finish_reason=traj.finish_reason,
            truncated=traj.truncated, prompt_tokens=len(traj.prompt_ids),
            response_tokens=len(traj.response_ids), error=error,
        )
        lenient_answer = None
        if error is None:
            strict, lenient = self.grader.grade(ex, text)
            rec.answer, rec.score, rec.format_ok = strict.answer, float(strict.score), \
                bool(strict.format_ok)
            rec.reason = strict.reason
            rec.correct_rule = rec.correct = float(strict.accuracy) >= 1.0
            rec.correct_lenient = float(lenient.accuracy) >= 1.0
            lenient_answer = lenient.answer
        else:
            rec.reason = f"generation failed: {error}"
        return rec, lenient_answer

    def _traj_line(self, w: _Work, traj: Trajectory, rec: SampleRecord) -> str:
        # Loop-local ids restart every chunk; name the trajectory by its sample instead.
        traj.traj_id = _traj_id(w.bench.name, w.index, w.sample)
        traj.reward = rec.score
        traj.extra.update({"sample": w.sample, "correct": rec.correct, "answer": rec.answer,
                           "token_text": token_texts(self.tokenizer, traj.response_ids)})
        data = traj.to_dict()
        data["logp_rollout"] = _finite(data["logp_rollout"])
        data["entropy"] = _finite(data["entropy"])
        return json.dumps(data, ensure_ascii=False, allow_nan=False)

    def _run_chunk(self, chunk: list[_Work]) -> tuple[list[tuple[_Work, SampleRecord, str]],
                                                      RolloutStats]:
        """Generate, grade and serialise one chunk: (work, record, trajectory line) each."""
        batch = sample([self._prompt(w.bench, w.index) for w in chunk], self.engine,
                       self.tools, self.settings)
        graded = [(*self._record(w, traj), w.bench.examples[w.index])
                  for w, traj in zip(chunk, batch.trajectories, strict=True)]
        self.grader.apply_judge([(rec, ex, lenient) for rec, lenient, ex in graded])
        out = []
        for w, traj, (rec, _, _) in zip(chunk, batch.trajectories, graded, strict=True):
            out.append((w, rec, self._traj_line(w, traj, rec) if rec.error is None else ""))
        return out, batch.stats

    def run(self, benchmarks: list[Benchmark], out: str | Path, k: int) -> EvalResult:
        """Generate every sample not yet in `out`. The samples run in fixed chunks of the
        full list (`batch_size` each, the same on every run into `out`: the identity
        checks it), each from its own sampler seed (`chunk_seed`): a resumed run generates
        what the uninterrupted one would, never the first chunk's texts again. A chunk with
        any sample missing is generated whole, its finished samples' texts dropped."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        work, resumed = self._pending(benchmarks, out, k)
        pending = {(w.bench.name, w.index, w.sample) for w in work}
        total = len(work) + resumed
        if resumed:
            self.log(f"resuming: {resumed} of {total} samples already in {out}")
        stats = RolloutStats()
        generated = failed = done = 0
        everything = [_Work(b, i, s) for b in benchmarks for i in range(len(b.examples))
                      for s in range(k)]
        for start in range(0, len(everything), self.batch_size):
            chunk = everything[start : start + self.batch_size]
            if not any((w.bench.name, w.index, w.sample) in pending for w in chunk):
                continue
            self.engine.reseed(chunk_seed(self.settings.seed, start))
            lines, chunk_stats = self._run_chunk(chunk)
            lines = [line for line in lines
                     if (line[0].bench.name, line[0].index, line[0].sample) in pending]
            _add_stats(stats, chunk_stats)
            by_bench: dict[str, tuple[list[str], list[str]]] = {}
            for w, rec, traj_line in lines:
                samples, trajs = by_bench.setdefault(w.bench.name, ([], []))
                samples.append(rec.to_json())
                if traj_line:
                    trajs.append(traj_line)
                generated += rec.error is None
                failed += rec.error is not None
            for name, (samples, trajs) in by_bench.items():
                # Trajectories first: a sample line is the record that its work is done.
                append_lines(out / name / TRAJECTORIES_FILE, trajs)
                append_lines(out / name / SAMPLES_FILE, samples)
            done += len(lines)
            elapsed = time.perf_counter() - t0
            correct = sum(rec.correct for _, rec, _ in lines)
            self.log(f"{done}/{len(work)} samples  chunk acc "
                     f"{correct}/{len(lines)}  {stats.tokens_decoded / max(elapsed, 1e-9):.0f} "
                     f"tok/s  {elapsed:.0f} s" + (f"  failed {failed}" if failed else ""))
        wall = time.perf_counter() - t0
        result = self.summarize(benchmarks, out, k)
        result.generated, result.resumed, result.failed = generated, resumed, failed
        result.wall_seconds, result.stats = wall, stats
        result.summary_path = self.write_summary(result, out)
        return result

    def summarize(self, benchmarks: list[Benchmark], out: Path, k: int) -> EvalResult:
        rows = []
        for bench in benchmarks:
            records = list(latest(read_samples(out / bench.name / SAMPLES_FILE)).values())
            wanted = {(str(i), s) for i in range(len(bench.examples)) for s in range(k)}
            rows.append(summarize_benchmark(bench.name, [r for r in records if r.key in wanted],
                                            k))
        return EvalResult(rows, overall(rows, k), k, 0, 0, 0, 0.0)

    def write_summary(self, result: EvalResult, out: Path) -> Path:
        s = result.stats
        run = {
            **self.run_info,
            "k": result.k,
            "wall_seconds": round(result.wall_seconds, 2),
            "samples_generated": result.generated,
            "samples_resumed": result.resumed,
            "samples_failed": result.failed,
            "tokens_decoded": s.tokens_decoded,
            "tokens_sampled": s.tokens_sampled,
            "tokens_forced": s.tokens_forced,
            "tool_calls": s.tool_calls,
            "tool_seconds": round(s.tool_seconds, 3),
            "tool_call_limits": self.limits,
            "sampling": {
                "temperature": self.settings.sampling.temperature,
                "top_p": self.settings.sampling.top_p,
                "top_k": self.settings.sampling.top_k,
                "repetition_penalty": self.settings.sampling.repetition_penalty,
            },
            "max_response_length": self.settings.max_response_length,
        }
        judge = self.grader.judge
        if judge is not None:
            run["judge"] = {"model": judge.model, "calls": judge.calls,
                            "cache_hits": judge.cache_hits, "errors": judge.errors}
        data = {"run": run, "benchmarks": [r.to_dict() for r in result.summaries],
                "overall": result.overall.to_dict()}
        path = out / "summary.json"
        write_output(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
        md = [f"# Evaluation: {self.run_info.get('model', '')}", ""]
        md.append(render_markdown([*result.summaries, result.overall], result.k))
        md += ["", f"k = {result.k}; sampling {run['sampling']}; max response "
               f"{run['max_response_length']} tokens; tool limits {self.limits}.",
               f"Wall time of this run: {run['wall_seconds']} s for "
               f"{result.generated} samples ({result.resumed} resumed, {result.failed} failed)."]
        write_output(out / "summary.md", "\n".join(md) + "\n")
        return path


def _add_stats(total: RolloutStats, part: RolloutStats) -> None:
    for name in ("tokens_prefilled", "tokens_decoded", "tokens_reused", "tokens_sampled",
                 "tokens_forced", "tool_calls", "tool_seconds", "rounds", "trajectories"):
        setattr(total, name, getattr(total, name) + getattr(part, name))
