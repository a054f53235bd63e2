"""What handing a decode step's split kernels to helper threads costs: `split`'s queue
against `team`'s spinning helpers (`appo.rollout.cpu`), and the bound with no hand-off.

1. Round trip of an empty job, best of a few thousand: a `queue.SimpleQueue` put and a
   `threading.Event` (what `split` does per matmul) against a publish / acknowledge through
   atomics in numba with a spinning helper (what `team` does).
2. One decode step's matmuls at SmolLM2-135M's shapes (random float32 weights: 30 layers
   of packed QKV, O, packed gate/up, down, then the LM head; 540 MB, cold in cache), per
   row count, best of `--repeats` interleaved passes (wall time), with `--threads`:
   - `1 thread`: the kernel over all columns on the calling thread;
   - `no hand-off`: each thread runs its half of every matmul with no synchronisation
     between matmuls (a bound: a real step must wait for each matmul before the next);
   - `split (queue)`: `split.run`;
   - `team (spin)`: `team.run`.
   The kernel is the one the matmul rule of this machine picks at that row count.

    .venv/bin/python benchmarks/decode_handoff.py --rows 8,32 --repeats 5
"""

from __future__ import annotations

import argparse
import os
import queue
import threading
import time

import numpy as np
import torch


def ping_pong(rounds: int) -> tuple[float, float]:
    """Microseconds per round trip: (queue + event, numba spin)."""
    import numba

    from appo.rollout.cpu import atomics

    jobs: queue.SimpleQueue = queue.SimpleQueue()

    def serve():
        while (done := jobs.get()) is not None:
            done.set()

    helper = threading.Thread(target=serve, daemon=True)
    helper.start()
    best_queue = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(rounds // 5):
            done = threading.Event()
            jobs.put(done)
            done.wait()
        best_queue = min(best_queue, (time.perf_counter() - t0) / (rounds // 5))
    jobs.put(None)

    @numba.njit(nogil=True)
    def answer(ctl, count):  # the helper: acknowledge `count` publications
        seen = atomics.load(ctl, 0)
        for _ in range(count):
            while atomics.load(ctl, 0) == seen:
                atomics.pause()
            seen = atomics.load(ctl, 0)
            atomics.fetch_add(ctl, 8, 1)

    @numba.njit(nogil=True)
    def ask(ctl, count):  # the caller: publish, wait for the acknowledgement
        for _ in range(count):
            target = atomics.load(ctl, 8) + 1
            atomics.fetch_add(ctl, 0, 1)
            while atomics.load(ctl, 8) < target:
                atomics.pause()

    ctl = np.zeros(16, np.int64)
    answer(np.ones(16, np.int64), 0), ask(np.zeros(16, np.int64), 0)  # compile
    count = rounds * 20
    spinner = threading.Thread(target=answer, args=(ctl, count), daemon=True)
    spinner.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    ask(ctl, count)
    spin = (time.perf_counter() - t0) / count
    spinner.join()
    return best_queue * 1e6, spin * 1e6


def step_matmuls(rows: int, threads: int, repeats: int) -> dict[str, float]:
    """Milliseconds per decode step's matmuls, best of `repeats`, each way of the docstring."""
    from appo.rollout.cpu import kernels, split, team
    from appo.rollout.cpu.matmuls import KERNEL_KINDS, default_rule

    name = default_rule(True).name_for(rows)
    kernel = kernels.kernel_for(KERNEL_KINDS.get(name, "row"))
    rng = np.random.default_rng(rows)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    weights = [rng.standard_normal(s, dtype=np.float32) * 0.02 for s in shapes]
    xs = {k: rng.standard_normal((rows, k), dtype=np.float32) for k in (576, 1536)}
    outs = [np.empty((rows, w.shape[0]), np.float32) for w in weights]

    def part(which: int, parts: int) -> None:
        for w, out in zip(weights, outs, strict=True):
            n = w.shape[0]
            cut = [n * i // parts // split.ALIGN * split.ALIGN for i in range(parts)] + [n]
            kernel(xs[w.shape[1]], w, out, cut[which], cut[which + 1])

    def no_handoff() -> None:
        others = [threading.Thread(target=part, args=(i, threads)) for i in range(1, threads)]
        for t in others:
            t.start()
        part(0, threads)
        for t in others:
            t.join()

    def through(run):
        def call() -> None:
            for w, out in zip(weights, outs, strict=True):
                run(kernel, xs[w.shape[1]], w, out, threads)
        return call

    ways = {"1 thread": lambda: part(0, 1), "no hand-off": no_handoff,
            "split (queue)": through(split.run), "team (spin)": through(team.run)}
    for way in ways.values():  # compile, start the helpers
        way()
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(repeats):
        for label, way in ways.items():
            t0 = time.perf_counter()
            way()
            best[label] = min(best[label], time.perf_counter() - t0)
    return {label: 1e3 * t for label, t in best.items()} | {"kernel": name}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="8,32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2000)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, threads {args.threads}, "
          f"load average {os.getloadavg()[0]:.2f}")
    queued, spun = ping_pong(args.rounds)
    print(f"empty job round trip: queue + event {queued:.2f} us, numba spin {spun:.3f} us")
    print("| rows | kernel | 1 thread | no hand-off | split (queue) | team (spin) | "
          "split / team |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for rows in (int(r) for r in args.rows.split(",")):
        got = step_matmuls(rows, args.threads, args.repeats)
        print(f"| {rows} | {got['kernel']} | {got['1 thread']:.1f} | {got['no hand-off']:.1f} "
              f"| {got['split (queue)']:.1f} | {got['team (spin)']:.1f} | "
              f"{got['split (queue)'] / got['team (spin)']:.2f}x |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
