"""The fused CPU decode step's numba kernels and the sampling kernel, each against the torch
ops it replaces, timed in the same process: a check that numba compiled them well.

numba's code for the same source can differ by release and by what else is in a function:
with numba 0.68 (appo's main venv) the sampling kernel ran a row ~15x slower than its loops
alone (one `use_seen` test per element kept the whole scan scalar), and SiLU x up ~4x
(numba's Python error model checks every divisor for zero, so the division's loop did not
vectorise), while numba 0.65 (`.venv-vllm`) compiled the first well
(`benchmarks/HISTORY.md`, "numba's code"). A kernel slower than the torch ops it replaces
is the sign. Per `--rows`, SmolLM2-135M shapes, one thread (torch's too), best of
`--repeats` timed batches:

- `silu_mul`: SiLU(gate) x up on `[R, 2 x 1536]` vs `F.silu(g) * u`;
- `rope_write`: rotary on 9 query and 3 key heads + the write of keys and values into a
  batch buffer (`[30, 2, R, 3, 256, 64]`, a new column each call, every layer in turn) vs
  the torch path's cat/neg/mul/add and two `copy_`;
- `add_rms_norm`: residual add + RMSNorm on `[R, 576]` vs `h += d; F.rms_norm(h)`;
- `sample`: one decode step's sampling of `[R, 49152]` logits (temperature 1, and
  temperature 0.7 with a repetition penalty) vs `appo.rollout.sampling.sample` (torch).

`--base TREE` also times TREE's `src` (a git worktree of another commit) in a child process
and prints both, with new / base speed-ups.

    .venv/bin/python benchmarks/cpu_kernels.py --rows 8,32
    .venv/bin/python benchmarks/cpu_kernels.py --rows 8,32 --base ../appo-base
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB, LAYERS = 9, 3, 64, 576, 1536, 49152, 30


def best_us(fn, repeats: int, inner: int) -> float:
    """Best of `repeats` batches of `inner` calls, microseconds per call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - t) / inner)
    return best * 1e6


def cases(rows: int):
    """(name, kernel call, torch call) for one row count."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from appo.rollout.cpu import attention, sampling
    from appo.rollout.sampling import SamplingParams, sample

    gen = np.random.default_rng(0)
    gate_up = gen.standard_normal((rows, 2 * INTER), np.float32) * 3
    act = np.empty((rows, INTER), np.float32)
    gu_t = torch.from_numpy(gate_up)
    yield ("silu_mul", lambda: attention.silu_mul(gate_up, act),
           lambda: F.silu(gu_t[:, :INTER]) * gu_t[:, INTER:])

    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = gen.standard_normal((rows, width), np.float32)
    angle = gen.random((rows, HEAD_DIM // 2), np.float32) * 6
    cos = np.cos(np.concatenate([angle, angle], 1))
    sin = np.sin(np.concatenate([angle, angle], 1))
    buf = np.zeros((LAYERS, 2, rows, KV_HEADS, 256, HEAD_DIM), np.float32)
    q_out = np.empty((rows, HEADS, HEAD_DIM), np.float32)
    none = np.empty(0, np.float32)
    state = {"layer": 0, "col": 0}

    def next_slot():
        state["layer"] = (state["layer"] + 1) % LAYERS
        if state["layer"] == 0:
            state["col"] = (state["col"] + 1) % 256
        return state["layer"], state["col"]

    def rope_kernel():
        layer, col = next_slot()
        attention.rope_write(qkv, cos, sin, none, none, 1e-5, buf, layer, col, q_out)

    qkv_t, buf_t = torch.from_numpy(qkv), torch.from_numpy(buf)
    cos_t, sin_t = torch.from_numpy(cos)[:, None], torch.from_numpy(sin)[:, None]

    def rotate(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def rope_torch():
        layer, col = next_slot()
        q = qkv_t[:, : HEADS * HEAD_DIM].view(rows, HEADS, HEAD_DIM)
        k = qkv_t[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(
            rows, KV_HEADS, HEAD_DIM)
        v = qkv_t[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(rows, KV_HEADS, HEAD_DIM)
        q = q * cos_t + rotate(q) * sin_t
        buf_t[layer, 0, :, :, col].copy_(k * cos_t + rotate(k) * sin_t)
        buf_t[layer, 1, :, :, col].copy_(v)
        return q

    yield "rope_write", rope_kernel, rope_torch

    h = gen.standard_normal((rows, HIDDEN), np.float32)
    delta = gen.standard_normal((rows, HIDDEN), np.float32) * 1e-3
    weight = gen.random(HIDDEN, np.float32)
    out = np.empty_like(h)
    h_t, d_t, w_t = torch.from_numpy(h.copy()), torch.from_numpy(delta), torch.from_numpy(weight)

    def norm_torch():
        h_t.add_(d_t)
        return F.rms_norm(h_t, (HIDDEN,), w_t, 1e-5)

    yield ("add_rms_norm", lambda: attention.add_rms_norm(h, delta, weight, 1e-5, out),
           norm_torch)

    logits = torch.from_numpy(gen.standard_normal((rows, VOCAB), np.float32) * 3)
    seen = torch.from_numpy(gen.random((rows, VOCAB)) < 0.002)
    for label, params, mask in (
            ("sample", SamplingParams(temperature=1.0), None),
            ("sample, penalty", SamplingParams(temperature=0.7, repetition_penalty=1.1), seen)):
        g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
        yield (label,
               lambda p=params, m=mask, g=g1: sampling.sample_numpy(logits, p, g, m, threads=1),
               lambda p=params, m=mask, g=g2: sample(logits, p, g, m))


def measure(rows_list: list[int], repeats: int) -> dict:
    """{f"{kernel}@{rows}": (kernel us, torch us)} plus the numba / llvmlite versions."""
    import llvmlite
    import numba
    import torch

    torch.set_num_threads(1)
    out: dict = {"numba": numba.__version__, "llvmlite": llvmlite.__version__, "times": {}}
    for rows in rows_list:
        for name, kernel, reference in cases(rows):
            inner = 3 if name.startswith("sample") else 30
            out["times"][f"{name}@{rows}"] = (best_us(kernel, repeats, inner),
                                              best_us(reference, repeats, inner))
    return out


def child(src: str, rows: str, repeats: int) -> dict:
    """`measure` run with `src` first on the path (another tree's code)."""
    cmd = [sys.executable, __file__, "--rows", rows, "--repeats", str(repeats),
           "--json", "--src", src]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,32")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--base", help="a worktree of another commit: its src timed too")
    parser.add_argument("--src", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.src:
        sys.path.insert(0, args.src)
    rows = [int(r) for r in args.rows.split(",")]
    if args.json:
        print(json.dumps(measure(rows, args.repeats)))
        return
    new = child(str(HERE.parent / "src"), args.rows, args.repeats)
    base = child(str(Path(args.base).resolve() / "src"), args.rows, args.repeats) \
        if args.base else None
    print(f"numba {new['numba']}, llvmlite {new['llvmlite']}; 1 thread; best of "
          f"{args.repeats}; microseconds per call")
    head = "| kernel | rows | kernel us | torch us | torch / kernel |"
    if base:
        head += " base kernel us | new vs base |"
    print(head)
    print("| --- " * (head.count("|") - 1) + "|")
    for key, (kernel_us, torch_us) in new["times"].items():
        name, rows_ = key.split("@")
        line = f"| {name} | {rows_} | {kernel_us:.1f} | {torch_us:.1f} | {torch_us / kernel_us:.2f}x |"
        if base:
            base_us = base["times"][key][0]
            line += f" {base_us:.1f} | {base_us / kernel_us:.2f}x |"
        print(line)


if __name__ == "__main__":
    main()
