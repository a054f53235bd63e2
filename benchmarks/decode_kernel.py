"""The matmuls of one SmolLM2-135M decode step: MKL (`F.linear`, LM head in row blocks, as
the lean decoder runs them without the kernel) vs the numba kernel (`appo.rollout.cpu_kernels`).

Per row count: the 120 decoder projections (packed QKV, O, packed gate/up, down) and the LM
head, each side timed as the best of 3 passes over all the weights (cold in cache: 540 MB),
in the same process. Prints a table; the figures in `RESULTS.md` come from it.

    .venv/bin/python benchmarks/decode_kernel.py                   # 1 thread, CPU time
    .venv/bin/python benchmarks/decode_kernel.py --threads 2 --wall
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (MKL)")
    parser.add_argument("--wall", action="store_true", help="wall time instead of CPU time")
    parser.add_argument("--rows", default="1,2,4,8,12,16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.process_time

    from appo.models import load_model
    from appo.rollout import cpu_kernels
    from appo.rollout.lean import LeanDecoder

    if not cpu_kernels.available():
        raise SystemExit("numba is not installed (or APPO_CPU_KERNELS=0): nothing to compare")
    lm = load_model("smollm2-135m", device="cpu")
    decoder = LeanDecoder(lm.model)
    decoder.refresh()
    weights = [w for layer in decoder._layers for w in (layer.qkv, layer.o, layer.gate_up,
                                                       layer.down)]
    head = lm.model.lm_head.weight.detach()

    def best(linear, x: dict[int, torch.Tensor], mats) -> float:
        times = []
        for _ in range(3):
            t0 = clock()
            for w in mats:
                linear(x[w.shape[1]], w)
            times.append(clock() - t0)
        return min(times) * 1e3

    cpu_kernels.linear(torch.randn(8, head.shape[1]), weights[0])  # compile / load cache
    print(f"threads {args.threads}, {'wall' if args.wall else 'CPU'} time, ms per decode step")
    print("| rows | MKL decoder | kernel decoder | MKL head | kernel head | MKL total | "
          "kernel total | speed-up |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
            xh = xs[head.shape[1]]
            err = (cpu_kernels.linear(xh, head) - xh @ head.T).abs().max().item()
            assert err < 1e-3, err
            mkl = best(F.linear, xs, weights)
            ker = best(cpu_kernels.linear, xs, weights)
            mkl_h = best(LeanDecoder._head, xs, [head])
            ker_h = best(cpu_kernels.linear, xs, [head])
            print(f"| {rows} | {mkl:.1f} | {ker:.1f} | {mkl_h:.1f} | {ker_h:.1f} | "
                  f"{mkl + mkl_h:.1f} | {ker + ker_h:.1f} | {(mkl + mkl_h) / (ker + ker_h):.2f}x |",
                  flush=True)


if __name__ == "__main__":
    main()
