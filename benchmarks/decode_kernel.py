"""The matmuls of one SmolLM2-135M decode step, by row count, every way the rollout engine
knows (`appo.rollout.cpu.matmuls`): torch (MKL; LM head in row blocks), torch as
`W @ x^T`, and the numba kernels of `appo.rollout.cpu.kernels`.

Default mode, per row count: the 120 decoder projections (packed QKV, O, packed gate/up,
down) and the LM head, each way timed as the best of `--repeats` passes over all the weights
(cold in cache: 540 MB), interleaved, in the same process (wall time). Prints a table, the
rule the fastest-per-row-count choices make (an `APPO_DECODE_MATMUL` value) and the rule
the engine follows on this machine; the tables in `RESULTS.md` come from it.

With `--threads` above 1 the numba kernels split their output columns over the threads
(`appo.rollout.cpu.split`); the table then also times each kernel on one thread (`numba@1`,
`numba_wide@1`: the kernels as they ran before the split, the same code and bit-identical
results) in the same passes and prints the threaded kernel's speed-up over it.

`--engine`: the hf engine decoding `--engine-rows` rows x `--new-tokens` tokens (EOS off,
`code_search` prompts, 4 rows per prompt) with its rule for this machine, the kernels on
all `--threads` threads against the same rule with the kernels on one thread, sides
interleaved (order alternating), same seed per repeat; the token ids of both sides must be
equal (checked). decode tok/s = rows x (N - 1) / (wall of the N-token call - wall of a
1-token call on the same prompts), so the prefill cancels.

`--rollout`: the engine's fixed rule against a per-bucket choice measured in this process
the way the former decode matmul plan did (every implementation timed on the model's
weights at each row-count bucket up to the batch size, best of 3, interleaved), both
decoding the same rollout-like batch (4 prompts x 8 rows with the `code_search` prompt,
EOS and tool stops on, at most 192 new tokens, so steps run at every row count from 32
down to 1). Same seed for both sides in each repeat, sides interleaved (order alternating);
throughput = sampled tokens / CPU seconds of the decode call.

    .venv/bin/python benchmarks/decode_kernel.py                   # 1 thread
    .venv/bin/python benchmarks/decode_kernel.py --threads 2 --rows 8,16,32
    .venv/bin/python benchmarks/decode_kernel.py --threads 2 --engine --engine-rows 8,32
    .venv/bin/python benchmarks/decode_kernel.py --rollout --repeats 5
    .venv/bin/python benchmarks/decode_kernel.py --attention --rows 8,32   # attention alone
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import time

import torch

# The buckets the former plan measured: a step of r rows used the largest bucket <= r.
BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)


@torch.inference_mode()
def time_step(impl, matrices: list[torch.Tensor], head: bool, rows: int) -> float:
    """Seconds of one decode step's matmuls through `impl` at `rows` rows (wall time);
    `matrices` are the decoder's (`LeanDecoder.matrices`), the last one the LM head if
    `head`."""
    gen = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=gen) for k in {int(w.shape[1]) for w in matrices}}
    impl.linear(xs[int(matrices[0].shape[1])], matrices[0])  # compile / warm up
    linears = matrices[:-1] if head else matrices
    t0 = time.perf_counter()
    for w in linears:
        impl.linear(xs[int(w.shape[1])], w)
    if head:
        impl.head(xs[int(matrices[-1].shape[1])], matrices[-1])
    return time.perf_counter() - t0


def best_times(decoder, impls, rows: int, repeats: int) -> dict[str, float]:
    """Best of `repeats` interleaved passes of every implementation at `rows` rows."""
    matrices = decoder.matrices()
    head = type(decoder.model.lm_head) is torch.nn.Linear
    best = {impl.name: float("inf") for impl in impls}
    for _ in range(repeats):  # interleaved, so drift on a shared machine hits every side
        for impl in impls:
            best[impl.name] = min(best[impl.name], time_step(impl, matrices, head, rows))
    return best


def fastest_rule(fastest: dict[int, str]):
    """A `MatmulRule` running, from each measured row count up, the fastest there (torch
    past the last one, as the former plan did past its last bucket)."""
    from appo.rollout.cpu.matmuls import MatmulRule

    steps: list[tuple[int, str]] = []
    last = max(fastest)
    for rows, name in [*sorted(fastest.items()), (last + 1, "torch")]:
        if not steps or steps[-1][1] != name:
            # A rule starts at 1 row: the first measured row count's choice reaches down.
            steps.append((rows if steps else 1, name))
    return MatmulRule(tuple(steps))


def one_thread(impl):
    """`impl` (a numba kernel) with its output columns on the calling thread only."""
    from appo.rollout.cpu import kernels
    from appo.rollout.cpu.matmuls import KERNEL_KINDS, Implementation

    linear = functools.partial(kernels.linear, kind=KERNEL_KINDS[impl.name], threads=1)
    return Implementation(f"{impl.name}@1", linear, linear, kernel=True)


def candidates(use_kernels: bool, single: bool = False):
    """Every implementation this machine can run; `single` adds the kernels on one thread."""
    from appo.rollout.cpu import onednn
    from appo.rollout.cpu.matmuls import IMPLEMENTATIONS

    # bf16 weights only where the CPU has the instructions (oneDNN emulates them elsewhere)
    impls = [impl for impl in IMPLEMENTATIONS.values() if (use_kernels or not impl.kernel)
             and (onednn.bf16_available() or not impl.low_precision)]
    return impls + ([one_thread(i) for i in impls if i.kernel] if single else [])


@contextlib.contextmanager
def kernels_on_one_thread():
    """The engine's kernel implementations pinned to one thread while inside."""
    from appo.rollout.cpu import matmuls

    saved = dict(matmuls.IMPLEMENTATIONS)
    for name, impl in saved.items():
        if impl.kernel:
            single = one_thread(impl)
            matmuls.IMPLEMENTATIONS[name] = matmuls.Implementation(
                name, single.linear, single.head, kernel=True)
    try:
        yield
    finally:
        matmuls.IMPLEMENTATIONS.update(saved)


def table(lm, rows_list: list[int], repeats: int, threads: int) -> None:
    from appo.rollout.cpu import kernels
    from appo.rollout.cpu.lean import LeanDecoder
    from appo.rollout.cpu.matmuls import default_rule

    decoder = LeanDecoder(lm.model)
    impls = candidates(kernels.available(), single=threads > 1)
    names = [impl.name for impl in impls]
    split = [n for n in names if f"{n}@1" in names]  # threaded kernels with a 1-thread twin
    print(f"threads {threads}, wall time, ms per decode step (projections + LM head); "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| rows | " + " | ".join(names) + " | fastest | vs torch | "
          + "".join(f"{n} vs {n}@1 | " for n in split))
    print("| --- " * (len(names) + 3 + len(split)) + "|")
    fastest = {}
    for rows in rows_list:
        best = best_times(decoder, impls, rows, repeats)
        # The rule can only name the engine's float32 implementations: not the 1-thread
        # twins, not bf16 weights (`rollout.cpu_weights`, which APPO_DECODE_MATMUL refuses).
        exact = {impl.name for impl in impls if not impl.low_precision}
        fastest[rows] = min((n for n in best if n in exact), key=best.get)
        cells = " | ".join(f"{best[n] * 1e3:.1f}" for n in names)
        gains = "".join(f"{best[f'{n}@1'] / best[n]:.2f}x | " for n in split)
        print(f"| {rows} | {cells} | {fastest[rows]} | "
              f"{best['torch'] / best[fastest[rows]]:.2f}x | {gains}", flush=True)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(f"fastest per row count (APPO_DECODE_MATMUL): {fastest_rule(fastest)}")
    print(f"the engine's rule on this machine: {default_rule(kernels.available())}")


def rollout_compare(lm, repeats: int) -> None:
    """The fixed rule vs the former plan's in-process measurement (see module docstring)."""
    from appo.rollout.cpu import kernels
    from appo.rollout.cpu.lean import LeanDecoder
    from appo.rollout.cpu.matmuls import FORCE_ENV, default_rule
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams
    from appo.rollout.stops import tool_stop_strings
    from rollout import QUESTIONS, chat_ids, load_average

    prompts_n, per_prompt, new_tokens = 4, 8, 192
    print(f"load average at start: {load_average()}", flush=True)
    t0 = time.perf_counter()
    decoder = LeanDecoder(lm.model)
    impls = candidates(kernels.available())
    measured = {}
    for bucket in (b for b in BUCKETS if b <= prompts_n * per_prompt):
        best = best_times(decoder, impls, bucket, 3)
        measured[bucket] = min(best, key=best.get)
    plan_rule = fastest_rule(measured)
    measure_s = time.perf_counter() - t0
    del decoder
    rule = default_rule(kernels.available())
    print(f"measured plan ({measure_s:.1f} s to measure): {plan_rule}\nfixed rule: {rule}",
          flush=True)
    tok = lm.tokenizer
    tags = ["python", "search"]
    prompt_ids = [chat_ids(tok, q, "code_search", tags) for q in QUESTIONS[:prompts_n]]

    def run(side: str, seed: int) -> tuple[float, int]:
        os.environ.pop(FORCE_ENV, None)
        if side == "plan":
            os.environ[FORCE_ENV] = str(plan_rule)
        try:
            eng = HFEngine(lm.model, tok, seed=seed, stop_strings=tool_stop_strings(tags))
            rows = [r for p in prompt_ids for r in eng.fork(eng.add_row(p), per_prompt)]
            c0 = time.process_time()
            outs = eng.decode(rows, [new_tokens] * len(rows), SamplingParams())
            return time.process_time() - c0, sum(len(o.token_ids) for o in outs)
        finally:
            os.environ.pop(FORCE_ENV, None)

    runs: dict[str, list[tuple[float, int]]] = {"plan": [], "rule": []}
    for rep in range(repeats):
        for side in ("plan", "rule") if rep % 2 == 0 else ("rule", "plan"):
            seconds, tokens = run(side, rep)
            runs[side].append((seconds, tokens))
            print(f"  rep {rep} {side}: {tokens} tokens in {seconds:.1f} s "
                  f"({tokens / seconds:.1f} tok/s)", flush=True)
    tok_s = {side: [t / s for s, t in r] for side, r in runs.items()}
    ratios = [b / a for a, b in zip(tok_s["plan"], tok_s["rule"], strict=True)]
    print("| side | rule | tok/s per repeat | median tok/s | tokens per repeat |")
    print("| --- | --- | --- | --- | --- |")
    for side, rule_text in (("plan", plan_rule), ("rule", rule)):
        print(f"| {side} | `{rule_text}` | {', '.join(f'{x:.1f}' for x in tok_s[side])} | "
              f"{statistics.median(tok_s[side]):.1f} | "
              f"{', '.join(str(t) for _, t in runs[side])} |")
    print(f"rule over plan, tok/s per repeat: {', '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f}x")
    print(f"load average at end: {load_average()}")


def engine_compare(lm, rows_list: list[int], new_tokens: int, repeats: int) -> None:
    """The engine's rule with the kernels on every thread vs on one (module docstring)."""
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams
    from rollout import QUESTIONS, chat_ids

    tok, per_prompt = lm.tokenizer, 4
    eng = HFEngine(lm.model, tok, seed=0, eos_ids=frozenset())
    print(f"threads {torch.get_num_threads()}, rule {eng._lean.rule}, "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)

    def call(prompts, tokens: int, seed: int) -> tuple[float, list[list[int]]]:
        eng.reseed(seed)
        roots = [eng.add_row(p) for p in prompts]
        rows = [r for root in roots for r in eng.fork(root, per_prompt)]
        t0 = time.perf_counter()
        outs = eng.decode(rows, [tokens] * len(rows), SamplingParams(temperature=1.0))
        wall = time.perf_counter() - t0
        eng.release(rows + roots)
        assert all(len(o.token_ids) == tokens for o in outs)  # EOS off: full budgets
        return wall, [list(o.token_ids) for o in outs]

    def measure(side: str, prompts, seed: int):
        with kernels_on_one_thread() if side == "one" else contextlib.nullcontext():
            t1, _ = call(prompts, 1, seed)
            tn, ids = call(prompts, new_tokens, seed)
        rows = len(prompts) * per_prompt
        return rows * (new_tokens - 1) / (tn - t1), ids

    call([chat_ids(tok, QUESTIONS[0], "code_search", ["python", "search"])], 2, 0)  # warm up
    print("| rows | decode tok/s, kernels on 1 thread | on all threads | ratio per repeat "
          "| median ratio | load average |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n_rows in rows_list:
        prompts = [chat_ids(tok, QUESTIONS[i % len(QUESTIONS)], "code_search",
                            ["python", "search"]) for i in range(n_rows // per_prompt)]
        tok_s: dict[str, list[float]] = {"one": [], "all": []}
        loads = []
        for rep in range(repeats):
            ids = {}
            for side in ("one", "all") if rep % 2 == 0 else ("all", "one"):
                rate, ids[side] = measure(side, prompts, rep)
                tok_s[side].append(rate)
            assert ids["one"] == ids["all"], "the split kernels changed the sampled tokens"
            loads.append(os.getloadavg()[0])
        ratios = [b / a for a, b in zip(tok_s["one"], tok_s["all"], strict=True)]
        print(f"| {n_rows} | {statistics.median(tok_s['one']):.1f} | "
              f"{statistics.median(tok_s['all']):.1f} | "
              f"{', '.join(f'{r:.2f}' for r in ratios)} | {statistics.median(ratios):.2f}x | "
              f"{min(loads):.1f}-{max(loads):.1f} |", flush=True)


def attention_table(rows_list: list[int], repeats: int) -> None:
    """`--attention`: one layer's decode attention, SmolLM2's shape (9 query heads, 3 KV
    heads, head dim 64) under a 280-token shared prefix plus each row's own columns, float32:
    the fused step's kernel (`attention.attend`, all units on the calling thread) against
    the torch path's `LeanDecoder._cascade_attention` (batched matmuls + softmax, torch's
    threads), best of `repeats` x 20 calls, interleaved."""
    import numpy as np

    from appo.rollout.cpu import attention
    from appo.rollout.cpu.lean import LeanDecoder, SharedPrefix

    heads, kv_heads, hd, prefix = 9, 3, 64, 280
    lean = object.__new__(LeanDecoder)  # only the attributes its attention reads
    lean.heads, lean.kv_heads, lean.head_dim, lean.scale = heads, kv_heads, hd, hd**-0.5
    print(f"decode attention, microseconds per layer call, best of {repeats} x 20; torch "
          f"threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.2f}")
    print("| rows | own columns | kernel (1 thread) | torch | torch / kernel |")
    print("| --- | --- | --- | --- | --- |")
    for rows in rows_list:
        for own in (20, 130):
            gen = torch.Generator().manual_seed(rows + own)
            length = prefix + own  # each row's copy of the prefix, then its own columns
            buf = torch.randn(1, 2, rows, kv_heads, length + 1, hd, generator=gen)
            shared = torch.randn(1, 2, kv_heads, prefix, hd, generator=gen)
            q = torch.randn(rows, heads, 1, hd, generator=gen)
            starts = torch.full((rows,), prefix)
            mask = torch.zeros(rows, 1, 1, length + 1 - prefix)
            sp = SharedPrefix(shared, prefix, mask)
            q_np, buf_np = q[:, :, 0].numpy().copy(), buf.numpy()
            out = np.empty((rows, heads, hd), np.float32)
            pk, pv = shared[0, 0].numpy(), shared[0, 1].numpy()

            kernel = functools.partial(attention.attend, q_np, buf_np, 0, starts.numpy(),
                                       length, pk, pv, lean.scale, out)
            reference = functools.partial(lean._cascade_attention, q, buf[0, 0], buf[0, 1],
                                          sp, 0)

            best = {"kernel": float("inf"), "torch": float("inf")}
            for fn in (kernel, reference):
                fn()  # compile / warm
            for _ in range(repeats):
                for name, fn in (("kernel", kernel), ("torch", reference)):
                    t0 = time.perf_counter()
                    for _ in range(20):
                        fn()
                    best[name] = min(best[name], (time.perf_counter() - t0) / 20)
            print(f"| {rows} | {own} | {best['kernel'] * 1e6:.0f} | {best['torch'] * 1e6:.0f} "
                  f"| {best['torch'] / best['kernel']:.2f}x |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (MKL)")
    parser.add_argument("--rows", default="1,2,3,4,5,6,8,12,16,24,32,48,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--engine", action="store_true",
                        help="the engine's decode, kernels on all threads vs on one")
    parser.add_argument("--engine-rows", default="8,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rollout", action="store_true",
                        help="fixed rule vs the former measured plan on a rollout batch")
    parser.add_argument("--attention", action="store_true",
                        help="one layer's decode attention: the fused kernel vs torch")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.attention:
        attention_table([int(r) for r in args.rows.split(",")], max(args.repeats, 5))
        return

    from appo.models import load_model

    lm = load_model("smollm2-135m", device="cpu")
    if args.engine:
        engine_compare(lm, [int(r) for r in args.engine_rows.split(",")], args.new_tokens,
                       args.repeats)
    elif args.rollout:
        rollout_compare(lm, args.repeats)
    else:
        table(lm, [int(r) for r in args.rows.split(",")], args.repeats, args.threads)


if __name__ == "__main__":
    main()
