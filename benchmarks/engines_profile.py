"""What one CPU decode step runs in appo's `hf` engine and in vLLM: evidence for "why vLLM
decodes faster" (benchmarks/HISTORY.md) that does not depend on the machine being quiet.

One engine per run, in this process (`benchmarks/engines.py`'s engine set-up and prompts):
`--rows` rows, a 1-token call and an `--new-tokens` call on the same prompts, each under
`torch.profiler`; the second minus the first, divided by the extra steps, is one decode step.
Printed per decode step:
- every torch op (and each call of appo's numba kernels, recorded as `appo::numba_*`: the
  matmuls, the fused decode step's kernels and the sampling kernel) with its call count and its share of the step's self CPU time (shares shift under load; counts do
  not);
- how the process's CPU time split over its threads during the N-token call
  (`/proc/self/task/*/stat`): whether the step's work runs on one core or on all.

`--timers` (hf only): no profiler; wall time per decode step of an `--new-tokens` call,
split into the forward's matmuls (projections + LM head), the fused step's kernels by
name, the rest of the forward, and the engine outside the forward (sampling, step inputs),
best of `--repeats` calls minus a 1-token call.

`--matmuls` instead runs one decode step's projections and LM head (SmolLM2-135M shapes,
`--rows` rows, float32) `--repeats` times with appo's decode matmul for that row count and,
where vLLM is installed, with vLLM's CPU GEMM (`onednn_mm` on a prepacked weight, what its
linear layers and LM head call on x86 without zentorch), and prints how each one's CPU
time split over the threads.

    .venv-vllm/bin/python benchmarks/engines_profile.py --engine hf --rows 8 --new-tokens 9
    .venv-vllm/bin/python benchmarks/engines_profile.py --engine vllm-pc-on --rows 8
    .venv-vllm/bin/python benchmarks/engines_profile.py --matmuls --rows 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The fused decode step's kernels (`appo.rollout.cpu.attention`), each call recorded as one op.
# (The rotary + cache write runs inside the attention's split job, `rope_attend_units`,
# so it is timed with the attention: the team's call.)
FUSED_KERNELS = ("attend_units", "rms_norm", "add_rms_norm", "silu_mul")
sys.path.insert(0, str(HERE))


def thread_cpu_ticks() -> dict[int, tuple[str, int]]:
    """{thread id: (name, user + system clock ticks)} of this process's threads."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(task.name)] = (name, int(fields[11]) + int(fields[12]))
    return out


def profiled_call(eng, prompts, new_tokens: int):
    """(op -> (count, self CPU us), per-thread ticks) of one `decode` call on fresh rows."""
    from engines import _decode
    from torch.profiler import ProfilerActivity, profile

    before = thread_cpu_ticks()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        result = _decode(eng, prompts, 1, new_tokens, seed=0)
    after = thread_cpu_ticks()
    ops: dict[str, tuple[int, float]] = {}
    for e in prof.key_averages():
        ops[e.key] = (e.count, e.self_cpu_time_total)
    ticks = {tid: (name, t - before.get(tid, (name, 0))[1]) for tid, (name, t) in after.items()}
    return ops, ticks, result


def thread_split(fn, repeats: int) -> str:
    """'a% / b% / ...' of the CPU ticks each thread spent while `fn` ran `repeats` times."""
    before = thread_cpu_ticks()
    for _ in range(repeats):
        fn()
    after = thread_cpu_ticks()
    ticks = sorted((t - before.get(tid, (n, 0))[1] for tid, (n, t) in after.items()),
                   reverse=True)
    total = sum(ticks) or 1
    return " / ".join(f"{100 * t / total:.0f}%" for t in ticks if t > 0.02 * total)


def matmul_split(args) -> None:
    """Per-thread CPU split of one decode step's matmuls: appo's rule vs vLLM's oneDNN."""
    import torch

    from appo.rollout.cpu import kernels
    from appo.rollout.cpu.matmuls import decode_rule

    hidden, inter, qkv, vocab, layers = 576, 1536, 960, 49152, 30
    shapes = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)] * layers
    shapes.append((vocab, hidden))
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    xs = {k: torch.randn(args.rows, k, generator=gen) for k in {k for _, k in shapes}}
    rule = decode_rule(torch.float32, torch.device("cpu"), kernels.available())
    impl = rule.implementation(args.rows)

    def appo_step():
        for w in weights[:-1]:
            impl.linear(xs[w.shape[1]], w)
        impl.head(xs[hidden], weights[-1])

    appo_step()  # compile / warm
    print(f"{args.rows} rows, torch threads {torch.get_num_threads()}, load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"appo `{impl.name}` (rule {rule}): CPU time by thread "
          f"{thread_split(appo_step, args.repeats)}")
    try:
        from vllm import _custom_ops as ops
    except Exception as e:  # noqa: BLE001 - not installed or broken
        print(f"vLLM oneDNN: not available ({type(e).__name__})")
        return
    handlers = [ops.create_onednn_mm(w.t(), 32) for w in weights]

    def vllm_step():
        for w, h in zip(weights, handlers, strict=True):
            ops.onednn_mm(h, xs[w.shape[1]], None)

    vllm_step()
    print(f"vLLM onednn_mm (prepacked): CPU time by thread "
          f"{thread_split(vllm_step, args.repeats)}")
    # Wall time per step, the two interleaved (the weights cold in cache for both: 540 MB).
    walls: dict[str, list[float]] = {"appo": [], "vllm": []}
    for _ in range(args.repeats):
        for name, fn in (("appo", appo_step), ("vllm", vllm_step)):
            t0 = time.perf_counter()
            fn()
            walls[name].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in walls.items()}
    print(f"wall ms per step (median of {args.repeats}, interleaved): appo {med['appo']:.1f}, "
          f"vLLM {med['vllm']:.1f}; appo / vLLM {med['appo'] / med['vllm']:.2f}")


def step_timers(eng, prompts, args) -> None:
    """`--timers`: where a decode step's wall time goes (see the module docstring)."""
    import dataclasses
    import time
    import types

    from engines import _decode

    lean = eng._lean
    fused = lean._fused
    spent: Counter = Counter()

    def timed(fn, name):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0
        return call

    plain_matmuls = lean._matmuls

    def matmuls(input_ids):
        impl = plain_matmuls(input_ids)
        return dataclasses.replace(
            impl, linear=timed(impl.linear, "matmuls"), head=timed(impl.head, "matmuls"),
            numpy_linear=None if impl.numpy_linear is None
            else timed(impl.numpy_linear, "matmuls"))

    lean._matmuls = matmuls
    if fused is not None:
        # Attention runs in chunks on several threads: its wall time is the team's call.
        wrapped = types.SimpleNamespace(**vars(fused.k))
        for name in (n for n in FUSED_KERNELS if hasattr(fused.k, n)):
            if not name.startswith("attend"):
                setattr(wrapped, name, timed(getattr(fused.k, name), name))
        fused.k = wrapped
        fused.team = types.SimpleNamespace(**vars(fused.team))
        fused.team.attend = timed(fused.team.attend, "attention with rotary + cache write")
    eng._forward = timed(eng._forward, "forward")

    def run(tokens: int) -> tuple[float, Counter, Counter]:
        spent.clear()
        before = thread_cpu_ticks()
        t0 = time.perf_counter()
        _decode(eng, prompts, 1, tokens, seed=0)
        wall = time.perf_counter() - t0
        after = thread_cpu_ticks()
        ticks = Counter({tid: t - before.get(tid, (n, 0))[1] for tid, (n, t) in after.items()})
        return wall, Counter(spent), ticks

    run(2)
    diffs = []
    for _ in range(args.repeats):
        one, many = run(1), run(args.new_tokens)
        diffs.append((many[0] - one[0], many[1] - one[1], many[2] - one[2]))
    # The median repeat by wall time (a busy machine makes single repeats swing).
    wall, parts, ticks = sorted(diffs, key=lambda d: d[0])[len(diffs) // 2]
    steps = args.new_tokens - 1
    kernel_names = [n for n in parts if n not in ("forward", "matmuls")]
    parts["forward, rest"] = parts["forward"] - parts["matmuls"] - sum(
        parts[n] for n in kernel_names)
    parts["engine outside the forward"] = wall - parts["forward"]
    del parts["forward"]
    print(f"{args.rows} rows, {steps} decode steps, best of {args.repeats}, threads "
          f"{args.threads}, rule {lean.rule}; load average {os.getloadavg()[0]:.1f}")
    print(f"wall per decode step: {1e3 * wall / steps:.2f} ms "
          f"({args.rows * steps / wall:.1f} tok/s)")
    print("| part | ms per step | share |")
    print("| --- | ---: | ---: |")
    for name, t in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {1e3 * t / steps:.2f} | {100 * t / wall:.1f}% |")
    # The decode steps' own thread split (the N-token call minus the 1-token call, which
    # holds the prefill), by role as in the profiled mode.
    import threading

    roles = {t.native_id: t.name for t in threading.enumerate()}
    roles[threading.get_native_id()] = "caller"
    total = sum(t for t in ticks.values() if t > 0) or 1
    print("decode steps' CPU time by thread: " + ", ".join(
        f"{roles.get(tid, 'other (torch OpenMP)')} {100 * t / total:.0f}%"
        for tid, t in ticks.most_common() if t > 0.02 * total))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("hf", "vllm-pc-on", "vllm-pc-off"), default="hf")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="synth:arith?split=train&levels=2,3")
    p.add_argument("--template", default="code_search")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--cpu-weights", choices=("float32", "bfloat16"), default="float32",
                   help="the hf engine's rollout.cpu_weights")
    p.add_argument("--vllm-logprobs", type=int, default=20)
    p.add_argument("--matmuls", action="store_true")
    p.add_argument("--timers", action="store_true")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    args.worker = args.engine
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    if args.matmuls:
        torch.set_num_threads(args.threads)
        matmul_split(args)
        return

    from engines import _make_engine, prompt_pool

    torch.set_num_threads(args.threads)
    eng, info, _, _ = _make_engine(args)
    if args.timers:
        step_timers(eng, prompt_pool(args, 64)[: args.rows], args)
        return
    if args.engine == "hf":  # numba kernels are no torch op: record each call as one
        from torch.profiler import record_function

        from appo.rollout.cpu import kernels

        def recorded(plain, name):
            def call(*a, **kw):
                with record_function(name):
                    return plain(*a, **kw)
            return call

        # `kernels.linear` (tensors) runs through `linear_numpy` too: one record per matmul.
        kernels.linear_numpy = recorded(kernels.linear_numpy, "appo::numba_linear")
        fused = getattr(getattr(eng, "_lean", None), "_fused", None)
        if fused is not None:  # the fused decode step's kernels (appo.rollout.cpu.fused)
            # Wrapped in a namespace the step reads them from, not in the module: a kernel
            # that calls another (add_rms_norm -> rms_norm) resolves it as a module global
            # when numba compiles it, and a Python wrapper there cannot be compiled.
            import types

            wrapped = types.SimpleNamespace(**vars(fused.k))
            for name in (n for n in FUSED_KERNELS if hasattr(fused.k, n)):
                setattr(wrapped, name, recorded(getattr(fused.k, name), f"appo::numba_{name}"))
            fused.k = wrapped
        if getattr(eng, "_sample_numpy", None) is not None:  # the sampling kernel's call
            eng._sample_numpy = recorded(eng._sample_numpy, "appo::numba_sample")
    prompts = prompt_pool(args, 64)[: args.rows]
    _decode_warm = profiled_call(eng, prompts, 2)  # noqa: F841 - first calls compile/allocate
    one, _, r1 = profiled_call(eng, prompts, 1)
    many, ticks, rn = profiled_call(eng, prompts, args.new_tokens)
    steps = args.new_tokens - 1
    per_step = {}
    for op, (count, us) in many.items():
        c1, u1 = one.get(op, (0, 0.0))
        if count - c1 > 0:
            per_step[op] = ((count - c1) / steps, max(us - u1, 0.0) / steps)
    total = sum(us for _, us in per_step.values()) or 1.0
    print(f"engine {args.engine}, {args.rows} rows, {steps} decode steps; {info}; "
          f"tokens {r1['tokens']} / {rn['tokens']}; load average {os.getloadavg()[0]:.1f}")
    appo_calls = sum(c for op, (c, _) in per_step.items() if op.startswith("appo::"))
    print(f"op calls per decode step: {sum(c for c, _ in per_step.values()):.0f} calls, "
          f"{len(per_step)} kinds ({appo_calls:.0f} of them appo's numba kernels, "
          f"`appo::*`)")
    print("| op | calls per step | share of self CPU time |")
    print("| --- | --- | --- |")
    for op, (count, us) in sorted(per_step.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"| `{op}` | {count:.1f} | {100 * us / total:.1f}% |")
    names = Counter()
    busy = {tid: t for tid, t in ticks.items() if t[1] > 0}
    all_ticks = sum(t for _, t in busy.values()) or 1
    print(f"CPU time of the {args.new_tokens}-token call by thread ({len(ticks)} threads, "
          f"{all_ticks} ticks):")
    # Python names its threads only for itself: the caller, the split kernels' helpers
    # (`appo.rollout.cpu.split`) and the rest (torch's OpenMP workers among them).
    import threading

    roles = {t.native_id: t.name for t in threading.enumerate()}
    roles[threading.get_native_id()] = "caller"
    for tid, (name, t) in sorted(busy.items(), key=lambda kv: -kv[1][1]):
        names[name] += 1
        print(f"  {tid} {name} ({roles.get(tid, 'not a Python thread')}): "
              f"{100 * t / all_ticks:.0f}%")


if __name__ == "__main__":
    main()
