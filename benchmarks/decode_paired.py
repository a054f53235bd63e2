"""Rollout decode (a) of two source trees, paired burst by burst: for a machine that is busy.

`compare_commits.py` runs each tree's whole `rollout.py --only-a` (minutes each) in turn, so
on a machine whose load changes from minute to minute the two trees are measured under
different loads. Here both trees stay loaded in two worker processes (each with its own
`src` first on `PYTHONPATH` and its own `benchmarks/rollout.py` for the prompts), and the
parent asks them for one short decode burst at a time, alternating the order (old, new /
new, old), so each pair of bursts runs seconds apart under nearly the same load. The figure
is the median over pairs of new/old tokens per second.

One burst is what `rollout.py` (a) measures: 8 rows of the `code_search` prompt (~270
tokens), temperature 1, EOS off, the engine's CPU time (`time.process_time`, 1 torch thread)
for N new tokens minus that for 1 (the prefill, the same work on both sides).

    git worktree add ../appo-base <old-commit>
    .venv/bin/python benchmarks/decode_paired.py --old ../appo-base --pairs 12
"""

from __future__ import annotations

import argparse
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


def worker(tree: Path) -> None:
    """Load SmolLM2 and the tree's engine; answer `N` lines with one burst's JSON."""
    from time import process_time as clock

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(tree / "benchmarks"))
    import rollout as rb  # this tree's own benchmark module: prompts, plan tuning
    from appo.models import load_model
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams

    lm = load_model("smollm2-135m", device="cpu")
    if hasattr(rb, "tune_decode"):  # the old tree measured its matmul plan once per machine
        rb.tune_decode(lm, 32)
    prompts = [rb.chat_ids(lm.tokenizer, q) for q in rb.QUESTIONS]

    def run(n: int) -> float:
        eng = HFEngine(lm.model, lm.tokenizer, seed=0, eos_ids=frozenset())
        rows = [eng.fork(eng.add_row(p), 1)[0] for p in prompts]
        t0 = clock()
        outs = eng.decode(rows, [n] * len(rows), SamplingParams())
        elapsed = clock() - t0
        assert all(len(o.token_ids) == n for o in outs)
        return elapsed

    run(8)  # warm-up: first-call costs (numba compilation, allocator) out of the pairs
    print("READY", flush=True)
    for line in sys.stdin:
        n = int(line)
        decode = run(n) - run(1)
        print(json.dumps({"tok_s": (n - 1) * len(prompts) / decode, "s": decode}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, type=Path, help="source tree of the old commit")
    p.add_argument("--new", type=Path, default=REPO)
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--log", type=Path, default=HERE / "results" / "decode_paired.jsonl")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    procs = {}
    for name, tree in trees.items():
        env = dict(os.environ, PYTHONPATH=str(tree / "src"))
        procs[name] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--old", ".", "--worker", str(tree)],
            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    for name, proc in procs.items():
        line = proc.stdout.readline()
        if line.strip() != "READY":
            raise SystemExit(f"the {name} worker did not start (exit {proc.poll()})")
    heads = {k: subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"],
                               capture_output=True, text=True).stdout.strip()
             for k, t in trees.items()}
    args.log.parent.mkdir(parents=True, exist_ok=True)
    ratios = []
    for i in range(args.pairs):
        burst = {}
        for name in (["old", "new"] if i % 2 == 0 else ["new", "old"]):
            procs[name].stdin.write(f"{args.tokens}\n")
            procs[name].stdin.flush()
            burst[name] = json.loads(procs[name].stdout.readline())["tok_s"]
        ratios.append(burst["new"] / burst["old"])
        rec = {"heads": heads, "pair": i, "tokens": args.tokens, "load": os.getloadavg()[0],
               **{f"{k}_tok_s": v for k, v in burst.items()}, "new_over_old": ratios[-1]}
        with args.log.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)
    for proc in procs.values():
        proc.stdin.close()
        proc.wait()
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"{datetime.date.today()} {platform.processor() or platform.machine()}: old "
          f"{heads['old']} new {heads['new']}, {args.pairs} pairs of {args.tokens}-token "
          f"bursts: new/old median {statistics.median(ratios):.3f} "
          f"(quartiles {q[0]:.3f}-{q[2]:.3f}), new faster in "
          f"{sum(r > 1 for r in ratios)}/{len(ratios)} pairs")


if __name__ == "__main__":
    main()
