"""The matmuls of one SmolLM2-135M decode step, by row count, every way the rollout engine
knows (`appo.rollout.matmul_plan`): torch (MKL; LM head in row blocks), torch as
`W @ x^T`, and the numba kernels of `appo.rollout.cpu_kernels`.

Per row count: the 120 decoder projections (packed QKV, O, packed gate/up, down) and the LM
head, each way timed as the best of `--repeats` passes over all the weights (cold in
cache: 540 MB), interleaved, in the same process, with the plan's own timer (wall time).
Prints a table and, last, what the engine's plan has chosen on this machine (measured or
read from `$APPO_CACHE/tuning/decode_matmul.json`); the figures in `RESULTS.md` come
from it.

    .venv/bin/python benchmarks/decode_kernel.py                   # 1 thread
    .venv/bin/python benchmarks/decode_kernel.py --threads 2 --rows 8,16,32
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (MKL)")
    parser.add_argument("--rows", default="1,2,3,4,6,8,12,16,24,32,48,64")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from appo.models import load_model
    from appo.rollout.lean import LeanDecoder

    lm = load_model("smollm2-135m", device="cpu")
    plan = LeanDecoder(lm.model).plan
    names = [impl.name for impl in plan.candidates]
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"threads {args.threads}, wall time, ms per decode step (projections + LM head)")
    print("| rows | " + " | ".join(names) + " | fastest | vs torch |")
    print("| --- " * (len(names) + 3) + "|")
    with torch.inference_mode():
        for rows in rows_list:
            best = {name: float("inf") for name in names}
            for _ in range(args.repeats):
                for impl in plan.candidates:
                    best[impl.name] = min(best[impl.name], plan.time_step(impl, rows))
            fastest = min(best, key=best.get)
            cells = " | ".join(f"{best[n] * 1e3:.1f}" for n in names)
            print(f"| {rows} | {cells} | {fastest} | {best['torch'] / best[fastest]:.2f}x |",
                  flush=True)
    choices = plan.tune(rows_list)
    print("plan (bucket: implementation):",
          ", ".join(f"{b}: {name}" for b, name in sorted(choices.items())))


if __name__ == "__main__":
    main()
