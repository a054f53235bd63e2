"""The comparison report from whatever has finished: `report.md` and PNG plots.

Per variant: final accuracy per eval set (greedy pass@1, sampled pass@k) with a 95% t-interval
over seeds, tool calls per answer, sampled tokens, branches and wall time (from each run's
`metrics.jsonl` and `result.json`); learning curves against step and against sampled tokens;
for each pair of variants the difference on the seeds both have finished, with a paired
bootstrap interval over questions and seeds (`appo.compare.stats`).
"""

from __future__ import annotations

import io
import json
import math
import warnings
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np

from appo.compare.runner import PairResult, load_result, pair_state
from appo.compare.spec import BUDGET_KEYS, START, CompareSpec
from appo.compare.stats import Interval, paired_bootstrap, t_interval, t_quantile_975
from appo.outdir import write_output

CURVE_KEYS = ("reward/accuracy", "rollout/tool_calls_per_traj")
METRICS = {"greedy": "greedy pass@1", "pass@k": "sampled pass@k"}


@dataclass
class RunCurve:
    """One run's per-step training metrics (from its metrics.jsonl)."""

    steps: list[int] = field(default_factory=list)
    values: dict[str, list[float]] = field(default_factory=dict)
    tokens: list[float] = field(default_factory=list)  # sampled tokens per step
    branches: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)


def _num(value: Any) -> float:
    """A metrics.jsonl value: null (a NaN or infinity, appo.trainer.metrics) or absent is NaN."""
    return math.nan if value is None else float(value)


def read_curve(run_dir: Path) -> RunCurve:
    rows: dict[int, dict] = {}
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a kill
            if isinstance(row, dict) and row.get("step", 0) > 0 and "time/step" in row:
                rows[int(row["step"])] = row  # a redone step: the last one counts
    curve = RunCurve()
    for step in sorted(rows):
        r = rows[step]
        curve.steps.append(step)
        for k in CURVE_KEYS:
            curve.values.setdefault(k, []).append(_num(r.get(k)))
        curve.tokens.append(_num(r.get("rollout/tokens_decoded")))
        curve.branches.append(_num(r.get("rollout/branches", 0.0)))
        curve.seconds.append(_num(r["time/step"]))
    return curve


def has_set(spec: CompareSpec, result: PairResult, set_name: str) -> bool:
    """The result holds this set as the spec names it now (a set whose file or k changed
    since the pair was evaluated is left out rather than compared with the new one)."""
    s = result.sets.get(set_name)
    return s is not None and s.files == spec.eval.sets[set_name] and s.k == spec.eval.k


def scores(result: PairResult, set_name: str, metric: str) -> list[float]:
    s = result.sets[set_name]
    return list(s.greedy) if metric == "greedy" else s.pass_at_k


def _fmt(iv: Interval, pct: bool = True, digits: int = 2) -> str:
    """Percent with one decimal, or a plain number with `digits` decimals."""
    f = (lambda x: f"{100 * x:.1f}") if pct else (lambda x: f"{x:.{digits}f}")
    if math.isnan(iv.mean):
        return "-"
    if math.isnan(iv.low):
        return f"{f(iv.mean)} (1 seed)"
    return f"{f(iv.mean)} [{f(iv.low)}, {f(iv.high)}]"


def write_report(spec: CompareSpec, resamples: int = 2000) -> Path:
    """Write `output_dir/report/report.md` (+ PNGs) from the finished pairs; returns the path."""
    out = spec.output_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    names = [v.name for v in spec.variants]
    results: dict[str, dict[int, PairResult]] = {n: {} for n in names}
    curves: dict[str, dict[int, RunCurve]] = {n: {} for n in names}
    for v, s in spec.pairs():
        r = load_result(spec, v, s)
        if r is not None:
            results[v][s] = r
        if spec.run_dir(v, s).is_dir():
            curves[v][s] = read_curve(spec.run_dir(v, s))
    done = sum(len(x) for x in results.values())
    lines = [f"# Comparison: {spec.path.name}", "",
             f"Spec `{spec.path}`; regenerate with `appo compare {spec.path} --report`.", "",
             f"Finished pairs: {done} of {len(spec.pairs())}."]
    pending = [f"{v}/seed{s} ({pair_state(spec, v, s)})" for v, s in spec.pairs()
               if s not in results[v]]
    if pending:
        lines.append("Not finished (not in the tables): " + ", ".join(pending) + ".")
    stale = [f"{v}/seed{s} `{name}`" for v, s in spec.pairs() if s in results[v]
             for name in spec.eval.sets if not has_set(spec, results[v][s], name)]
    if stale:
        lines.append("Evaluated on another version of an eval set (file or k changed; left "
                     "out of that set's table): " + ", ".join(stale) + ".")
    lines += ["", "## Budget", "", "| variant | " + " | ".join(BUDGET_KEYS) + " | marked |",
              "|" + " --- |" * (len(BUDGET_KEYS) + 2)]
    for v in spec.variants:
        b = spec.budgets.get(v.name, {})
        if not v.train:
            lines.append(f"| {v.name} | " + " | ".join("-" for _ in BUDGET_KEYS)
                         + " | the starting checkpoint, not trained |")
            continue
        lines.append(f"| {v.name} | " + " | ".join(str(b.get(k)) for k in BUDGET_KEYS)
                     + f" | {'allow_budget_difference' if v.allow_budget_difference else ''} |")
    lines += ["", "## Cost (training, mean over finished seeds)", "",
              "Sampled tokens: decoded in all training rollouts (95% t-interval); step time:"
              " the sum of the runs' step times (start-up and evaluation excluded).", "",
              "| variant | seeds | steps | sampled tokens | branches / step | step time (s) | "
              "eval time (s) |", "|" + " --- |" * 7]
    for n in names:
        fin = [curves[n][s] for s in results[n] if s in curves[n]]
        if not spec.variant(n).train and results[n]:
            lines.append(f"| {n} | {len(results[n])} | 0 | - | - | - | "
                         f"{np.mean([r.eval_seconds for r in results[n].values()]):.0f} |")
            continue
        if not fin:
            lines.append(f"| {n} | 0 | - | - | - | - | - |")
            continue
        tok = t_interval([np.nansum(c.tokens) for c in fin], (0.0, math.inf))
        lines.append(
            f"| {n} | {len(fin)} | {np.mean([len(c.steps) for c in fin]):.0f} | "
            f"{_fmt(tok, pct=False, digits=0)} | "
            f"{np.mean([np.mean(c.branches or [0]) for c in fin]):.2f} | "
            f"{np.mean([sum(c.seconds) for c in fin]):.0f} | "
            f"{np.mean([r.eval_seconds for r in results[n].values()]):.0f} |")
    tested: list[_Diff] = []
    for set_name in spec.eval.sets:
        finished = {n: [r for r in results[n].values() if has_set(spec, r, set_name)]
                    for n in names}
        lines += ["", f"## Eval set `{set_name}`: `{spec.eval.sets[set_name]}`", "",
                  "Accuracy in %, mean over seeds with a 95% t-interval"
                  f"{_t_note([len(rs) for rs in finished.values()])}, clipped to [0, 100] "
                  "(tool calls to >= 0); pass@k with "
                  f"k={spec.eval.k} samples at temperature {spec.eval.temperature}."
                  + (f" `{START}` is the same checkpoint for every seed, so its greedy answers "
                     "do not depend on the seed (an interval of width 0); only its sampled "
                     "answers do." if any(not v.train for v in spec.variants) else ""), "",
                  "| variant | seeds | questions | greedy pass@1 | sampled pass@k | "
                  "tool calls / answer |", "|" + " --- |" * 6]
        for n, rs in finished.items():
            if not rs:
                lines.append(f"| {n} | 0 | - | - | - | - |")
                continue
            g = t_interval([np.mean(scores(r, set_name, "greedy")) for r in rs], (0.0, 1.0))
            k = t_interval([np.mean(scores(r, set_name, "pass@k")) for r in rs], (0.0, 1.0))
            calls = t_interval([np.mean(r.sets[set_name].tool_calls) for r in rs],
                               (0.0, math.inf))
            lines.append(f"| {n} | {len(rs)} | {len(rs[0].sets[set_name].greedy)} | {_fmt(g)} "
                         f"| {_fmt(k)} | {_fmt(calls, pct=False)} |")
        lines += ["", "Differences (first minus second variant, points), paired bootstrap "
                  f"over questions and the seeds both finished ({resamples} resamples):", "",
                  "| pair | seeds | greedy pass@1 | sampled pass@k |", "|" + " --- |" * 4]
        for a, b in combinations(names, 2):
            common = sorted(s for s in results[a] if s in results[b]
                            and has_set(spec, results[a][s], set_name)
                            and has_set(spec, results[b][s], set_name))
            if not common:
                lines.append(f"| {a} - {b} | 0 | - | - |")
                continue
            cells = []
            for metric in METRICS:
                xa = np.array([scores(results[a][s], set_name, metric) for s in common])
                xb = np.array([scores(results[b][s], set_name, metric) for s in common])
                iv = paired_bootstrap(xa, xb, resamples=resamples)
                cells.append(_fmt(iv))
                tested.append(_Diff(f"{a} vs {b} on `{set_name}`", METRICS[metric], xa, xb,
                                    iv))
            lines.append(f"| {a} - {b} | {len(common)} | " + " | ".join(cells) + " |")
    lines += ["", "## Which differences are distinguishable from noise", "",
              *_noise_words(tested, resamples)]
    lines += ["", "## Learning curves", "", "Mean over the seeds run so far (finished or not); "
              "the band spans the lowest to the highest seed.",
              "", "![against step](curves_step.png)", "",
              "![against sampled tokens](curves_tokens.png)", ""]
    plot_curves(curves, out)
    path = out / "report.md"
    write_output(path, "\n".join(lines))
    return path


def _t_note(seed_counts: list[int]) -> str:
    """The t quantiles behind the intervals, for the seed counts in the table: with few seeds
    they are large (12.71 for 2 seeds), which is what makes those intervals wide."""
    counts = sorted({n for n in seed_counts if n > 1})
    if not counts:
        return ""
    return " (t quantile " + ", ".join(f"{t_quantile_975(n - 1):.2f} for {n} seeds"
                                       for n in counts) + ")"


@dataclass
class _Diff:
    """One pairwise difference of the report: which pair and metric, the two `[S, Q]` score
    arrays and the 95% interval."""

    where: str  # "a vs b on `set`"
    metric: str
    a: np.ndarray
    b: np.ndarray
    interval: Interval


def _noise_words(tested: list[_Diff], resamples: int) -> list[str]:
    """The report's verdict in words. Besides each 95% interval that excludes 0 it says how
    many intervals were computed (with no difference anywhere, about 1 in 20 would exclude 0
    by chance), which of them hold at a family-wise 95% (Bonferroni: each interval at
    1 - 0.05/N, with enough resamples for its tails), and which rest on one seed (the
    bootstrap then resamples questions only: two checkpoints differ, not two methods)."""
    if not tested:
        return ["No pair of variants has a finished seed in common yet."]
    n = len(tested)
    hits = [d for d in tested if d.interval.excludes_zero()]
    if not hits:
        return [f"No difference is distinguishable from noise: all {n} 95% paired bootstrap "
                "intervals include 0."]

    def one_seed(d: _Diff) -> str:
        return " (one seed)" if d.a.shape[0] == 1 else ""

    words = ["These differences have a 95% paired bootstrap interval that excludes 0: "
             + "; ".join(f"{d.where} ({d.metric}: {_fmt(d.interval)}){one_seed(d)}"
                         for d in hits)
             + ". Every other difference is within noise."]
    words.append(f"{n} intervals were computed; if no variant differed from another, about "
                 f"{n / 20:.1f} of them would exclude 0 by chance.")
    if n > 1:
        level = 1 - 0.05 / n
        wide_resamples = max(resamples, math.ceil(40 / (0.05 / n)))  # >= 20 per tail
        held = [d for d in hits
                if paired_bootstrap(d.a, d.b, resamples=wide_resamples,
                                    level=level).excludes_zero()]
        words.append(f"Held to a family-wise 95% over all {n} (Bonferroni: each interval at "
                     f"{100 * level:.2f}%, {wide_resamples} resamples), "
                     + ("these remain: " + "; ".join(f"{d.where} ({d.metric})" for d in held)
                        + "."
                        if held else "none remains."))
    if any(one_seed(d) for d in hits):
        words.append("A difference marked (one seed) rests on a single seed of each variant: "
                     "its interval resamples questions only, so it shows that two trained "
                     "checkpoints differ on these questions, not that the methods do; another "
                     "seed of the same method may differ as much.")
    return [" ".join(words)]


def _mean_curve(runs: list[RunCurve], key: str) -> tuple[np.ndarray, ...]:
    """Over the steps every run reached: steps, the mean, lowest and highest value over the
    runs, and the mean cumulative sampled tokens."""
    n = min(len(r.steps) for r in runs)
    steps = np.array(runs[0].steps[:n])
    values = np.array([r.values[key][:n] for r in runs])  # [runs, steps]
    with warnings.catch_warnings():  # a metric a run did not log: nan, not a warning
        warnings.simplefilter("ignore", RuntimeWarning)
        mean, low, high = (np.nanmean(values, axis=0), np.nanmin(values, axis=0),
                           np.nanmax(values, axis=0))
    toks = np.nanmean([np.nancumsum(r.tokens[:n]) for r in runs], axis=0)
    return steps, mean, low, high, toks


def plot_curves(curves: dict[str, dict[int, RunCurve]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for x_name, fname in (("step", "curves_step.png"), ("sampled tokens", "curves_tokens.png")):
        fig, axes = plt.subplots(1, len(CURVE_KEYS), figsize=(5 * len(CURVE_KEYS), 3.6))
        for ax, key in zip(axes, CURVE_KEYS, strict=True):
            for name, runs in curves.items():
                runs_ = [r for r in runs.values() if r.steps]
                if not runs_:
                    continue
                steps, mean, low, high, toks = _mean_curve(runs_, key)
                x = steps if x_name == "step" else toks
                [line] = ax.plot(x, mean, marker=".", label=f"{name} ({len(runs_)} seeds)")
                if len(runs_) > 1:  # the spread over seeds: lowest to highest
                    ax.fill_between(x, low, high, color=line.get_color(), alpha=0.15)
            ax.set_xlabel(x_name)
            ax.set_title(key)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=100)
        plt.close(fig)
        write_output(out / fname, buf.getvalue())  # atomic, like every report file
