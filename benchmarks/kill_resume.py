"""kill -9 at random moments of tiny training runs, then resume: nothing committed is lost.

    python benchmarks/kill_resume.py [--runs 20] [--steps 6] [--seed 0] [--work DIR]

A reference run (tiny-test model, a checkpoint after every step) is trained without
interruption. Then each of `--runs` runs is started with `appo train` in a subprocess and
sent SIGKILL at a random moment between the reference's first metrics row (minus half of
its start-up) and its end, so kills land in start-up, rollouts, updates, metrics writes and
checkpoint saves alike. While it runs, this script polls the run directory's `latest`
file every 20 ms: the newest step named there before the kill was committed (its
checkpoint had been renamed into place). Each run is then resumed to the end
(`trainer.resume=true`) and checked:

- the resume exits 0 ("cannot resume" otherwise);
- it resumed from a step >= the last committed one ("lost committed steps" otherwise);
- `metrics.jsonl` holds steps 1..N exactly once;
- every step's reward and loss equal the reference's bit for bit (per-step randomness
  derives from the seed and the step, so a resumed run repeats an uninterrupted one).

Progress goes to stdout line by line; the summary is the last lines.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str or ""
    return sum(c.islower() and c.isascii() for c in text) / max(len(text), 1)
'''
KEYS = ("reward/mean", "actor/pg_loss", "actor/grad_norm")


def setup(work: Path) -> list[str]:
    data = work / "toy.jsonl"
    with data.open("w") as f:
        for i in range(16):
            row = {"prompt": [{"role": "user", "content": f"q{i}?"}], "answer": "7",
                   "data_source": "toy", "ability": "math"}
            f.write(json.dumps(row) + "\n")
    (work / "reward.py").write_text(REWARD)
    return ["model.path=tiny-test", f"data.train_files=[{data}]", "data.val_files=[]",
            "data.train_batch_size=2", "data.max_prompt_length=1024",
            "data.max_response_length=16",
            f"custom_reward_function.path={work / 'reward.py'}", "rollout.strategy=arpo",
            "rollout.n=4", "rollout.initial_rollouts=2", "actor.ppo_mini_batch_size=2",
            "actor.optim.lr=1e-2", "trainer.logger=[jsonl]", "trainer.save_freq=1"]


def appo(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "appo.cli", "train", *args],
                                stdout=out, stderr=subprocess.STDOUT)


def metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def latest_step(run: Path) -> int:
    try:
        return int((run / "latest").read_text().strip().rsplit("_", 1)[1])
    except (OSError, IndexError, ValueError):
        return 0


def reference(base: list[str], work: Path, steps: int) -> tuple[list[dict], float, float]:
    """The uninterrupted run: its metrics, the seconds to its first row and to its end."""
    run = work / "reference"
    t0 = time.perf_counter()
    proc = appo([*base, f"trainer.default_local_dir={run}", f"trainer.total_steps={steps}"],
                work / "reference.log")
    first = None
    while proc.poll() is None:
        if first is None and metrics(run):
            first = time.perf_counter() - t0
        time.sleep(0.02)
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"reference run failed, see {work / 'reference.log'}")
    return metrics(run), first or total / 2, total


def one_run(i: int, base: list[str], work: Path, steps: int, delay: float,
            ref: list[dict]) -> dict:
    run = work / f"run_{i:02d}"
    args = [*base, f"trainer.default_local_dir={run}", f"trainer.total_steps={steps}"]
    proc = appo(args, work / f"run_{i:02d}.log")
    t0, committed = time.perf_counter(), 0
    while proc.poll() is None and time.perf_counter() - t0 < delay:
        committed = max(committed, latest_step(run))
        time.sleep(0.02)
    finished_first = proc.poll() is not None
    if not finished_first:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    leftovers = sorted(p.name for p in run.glob(".*_global_step_*")) if run.exists() else []
    rows_at_kill = len(metrics(run))
    resume_log = work / f"run_{i:02d}.resume.log"
    r = appo([*args, "trainer.resume=true"], resume_log)
    r.wait()
    text = resume_log.read_text()
    m = re.search(r"resumed from \S+ at step (\d+)", text)
    resumed_at = int(m.group(1)) if m else 0
    rows = metrics(run)
    exact = len(rows) == len(ref) and all(
        a.get(k) == b.get(k) for a, b in zip(rows, ref, strict=False) for k in KEYS)
    return {
        "run": i, "kill_s": round(delay, 2), "killed": not finished_first,
        "rows_at_kill": rows_at_kill, "committed": committed, "resumed_at": resumed_at,
        "mid_save": bool(leftovers), "resume_rc": r.returncode,
        "lost_steps": max(0, committed - resumed_at),
        "steps_once": [row["step"] for row in rows] == list(range(1, steps + 1)),
        "bit_exact": exact,
        "skipped": len(re.findall(r"skipped checkpoint", text)),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None)
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="appo-kill-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    base = setup(work)
    ref, first, total = reference(base, work, a.steps)
    print(f"reference: {a.steps} steps in {total:.1f} s (first metrics row at {first:.1f} s); "
          f"work dir {work}", flush=True)
    rng = random.Random(a.seed)
    results = []
    for i in range(1, a.runs + 1):
        delay = rng.uniform(first / 2, total)
        res = one_run(i, base, work, a.steps, delay, ref)
        results.append(res)
        print(json.dumps(res), flush=True)
    killed = [r for r in results if r["killed"]]
    print("\nsummary:", flush=True)
    print(f"  runs {len(results)}, killed before the end {len(killed)}, killed mid-save "
          f"{sum(r['mid_save'] for r in killed)}, killed before the first checkpoint "
          f"{sum(r['committed'] == 0 for r in killed)}")
    print(f"  runs that could not resume: {sum(r['resume_rc'] != 0 for r in results)}")
    print(f"  committed steps lost: {sum(r['lost_steps'] for r in results)}")
    print(f"  runs whose metrics.jsonl is not steps 1..{a.steps} once: "
          f"{sum(not r['steps_once'] for r in results)}")
    print(f"  runs not bit-exact with the reference: {sum(not r['bit_exact'] for r in results)}")
    print(f"  steps redone after a kill (uncommitted work): "
          f"{sum(r['rows_at_kill'] - r['resumed_at'] for r in killed if r['rows_at_kill'] > r['resumed_at'])}")
    print(f"  checkpoints skipped at resume as unverifiable: {sum(r['skipped'] for r in results)}")
    bad = [r for r in results if r["resume_rc"] or r["lost_steps"] or not r["steps_once"]
           or not r["bit_exact"]]
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
