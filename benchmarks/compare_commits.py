"""Two source trees on the same work, interleaved in one run: the RL step and rollout decode.

For a change that must not make appo slower (e.g. a refactor), check out the commit before
it as a git worktree and run:

    git worktree add ../appo-base <old-commit>
    .venv/bin/python benchmarks/compare_commits.py --old ../appo-base

Each repeat runs, in alternating order (old, new / new, old), each tree's own benchmark
scripts in a child process with that tree's `src` first on `PYTHONPATH`:
- `step`: `benchmarks/train_step.py` part (1), one arpo + python RL step on SmolLM2-135M
  (16 trajectories of up to 256 tokens), medians of `--steps` steps after a warm-up: wall,
  phases, rollout and training tokens/s (the like-for-like figures: at temperature 1 the
  two trees sample different trajectories as soon as their float rounding differs);
- `decode`: `benchmarks/rollout.py --only-a --repeats 1`, (a) engine decode tok/s at 128 and
  384 new tokens on 8 rows and (a2) with EOS and tool stops on, each with its ratio to
  `model.generate` measured in the same child.
Every measurement is appended to `--log` (JSONL) as soon as it exists; a restarted run skips
what is logged, so the script can be stopped and resumed. The summary (medians per tree and
the new/old ratio) is printed and written to `--out`.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def git_head(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "?"


def run(tree: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    return subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True,
                          text=True)


def measure_step(tree: Path, steps: int) -> dict:
    proc = run(tree, ["benchmarks/train_step.py", "--worker", "appo", "--model", "smollm2-135m",
                      "--steps", str(steps), "--response-len", "256", "--strategy", "arpo",
                      "--tools"])
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"step benchmark failed in {tree}:\n{proc.stderr[-3000:]}")
    r = json.loads(lines[-1][len("RESULT "):])
    # Sampled trajectories differ between trees whenever their float rounding does, so the
    # per-token rates are the like-for-like figures; walls and lengths are context.
    return {k: r[k] for k in ("wall", "time/rollout", "time/update", "peak_rss_mb",
                              "perf/rollout_tokens_per_s", "perf/train_tokens_per_s",
                              "rollout/response_len", "rollout/tool_calls_per_traj")}


def measure_decode(tree: Path) -> dict:
    proc = run(tree, ["benchmarks/rollout.py", "--only-a", "--repeats", "1"])
    rows = [ast.literal_eval(line) for line in proc.stdout.splitlines()
            if line.startswith("{'new_tokens'")]
    fixed = [r for r in rows if "total_ratio_median" in r]  # (a): a fixed number of tokens
    stops = [r for r in rows if "seeds" in r]  # (a2): EOS and tool stops on
    if proc.returncode != 0 or len(fixed) != 2 or len(stops) != 1:
        raise SystemExit(f"decode benchmark failed in {tree}:\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-2000:]}")
    out = {}
    for r in fixed:
        n = r["new_tokens"]
        out[f"engine_tok_s_{n}"] = r["engine_tok_s"]
        out[f"vs_generate_{n}"] = r["ratio_median"]
    out["a2_engine_tok_s"] = stops[0]["engine_tok_s"]
    out["a2_vs_generate"] = stops[0]["ratio_median"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, type=Path, help="source tree of the old commit")
    p.add_argument("--new", type=Path, default=REPO, help="source tree of the new commit")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--parts", default="step,decode")
    p.add_argument("--log", type=Path, default=HERE / "results" / "compare_commits.jsonl")
    p.add_argument("--out", type=Path, default=HERE / "results" / "compare_commits.md")
    args = p.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    heads = {k: git_head(t) for k, t in trees.items()}
    args.log.parent.mkdir(parents=True, exist_ok=True)
    done = [json.loads(x) for x in args.log.read_text().splitlines()] if args.log.exists() else []
    done = [d for d in done if d["heads"] == heads]
    for rep in range(args.repeats):
        for part in args.parts.split(","):
            order = ["old", "new"] if rep % 2 == 0 else ["new", "old"]
            for which in order:
                if any(d["rep"] == rep and d["part"] == part and d["tree"] == which
                       for d in done):
                    continue
                values = (measure_step(trees[which], args.steps) if part == "step"
                          else measure_decode(trees[which]))
                rec = {"heads": heads, "rep": rep, "part": part, "tree": which,
                       "load": os.getloadavg()[0], "values": values}
                done.append(rec)
                with args.log.open("a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(json.dumps(rec), flush=True)
    loads = ", ".join(f"{d['load']:.1f}" for d in done)
    lines = [
        "# Old vs new commit, interleaved in one run", "",
        f"Date {datetime.date.today()}, {platform.machine()} {platform.processor()}, "
        f"old {heads['old']}, new {heads['new']}; "
        f"command `benchmarks/compare_commits.py --old <worktree> --repeats {args.repeats}`; "
        f"1-min load average at each measurement: "
        f"{loads}.", "",
        "| part | measure | old (median) | new (median) | new / old |",
        "| --- | --- | --- | --- | --- |",
    ]
    for part in args.parts.split(","):
        keys = sorted({k for d in done if d["part"] == part for k in d["values"]})
        for k in keys:
            med = {w: statistics.median(d["values"][k] for d in done
                                        if d["part"] == part and d["tree"] == w)
                   for w in ("old", "new")}
            ratio = f"{med['new'] / med['old']:.3f}" if med["old"] else "-"
            lines.append(f"| {part} | {k} | {med['old']:.3f} | {med['new']:.3f} | {ratio} |")
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
