"""Rollout engine benchmarks on SmolLM2-135M (float32, CPU), written to results/rollout.md.

(a) decode throughput of the `hf` engine (its defaults: lean forward, cascade attention,
    decode matmuls by the fixed rule for this CPU) vs `model.generate` on the same
    batch and settings:
    8 prompts with the `code_search` system prompt (~270 tokens), temperature 1, a fixed
    number of new tokens (EOS does not stop either side: `min_new_tokens` for generate,
    `eos_ids=()` for the engine), so both do exactly the same work.
    (a2) the same batch with EOS and the tool stop strings on, as in a rollout; `generate`
    follows the engine's sampled tokens, so both produce identical outputs.
    (a3) a 32-row batch with stops: the engine's decode matmul rule vs each single
    implementation forced for every step.
(b) arpo with n=16 (8 initial) on 2 prompts: prefill tokens computed with cache reuse and
    forks vs recomputing every row's whole context at every round (the engine with
    `reuse_cache=False`, which is what independent rollouts through a stateless generate
    call do), plus the time of arpo with reuse, arpo without, and 16 independent rollouts
    (grpo n=16, no reuse). Tools are a stub executor with a fixed ~30-token result, so the
    tool calls cost the same everywhere; the prompts end with an assistant prefix
    `<python>\\nprint(` so that SmolLM2 (never trained on the tags) calls the tool often.
(c) a multi-round tool rollout (4 rows, 6 rounds of 32 sampled + 48 forced tokens, EOS off):
    cache reuse vs re-prefilling the whole context each round.

The machine is shared and noisy: each comparison interleaves the two sides, repeats, and
reports per-pair ratios (median) and the best time of each side. Times are CPU seconds of
this process (`time.process_time`), which other jobs on the box do not inflate the way they
inflate wall time; torch runs on 1 thread (on this 2-core box, 2 intra-op threads collapse
under contention), so CPU time and wall time agree on a quiet machine.

    .venv/bin/python benchmarks/rollout.py            # full run (~20 min), writes results
    .venv/bin/python benchmarks/rollout.py --quick    # smoke test, small sizes, no write
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from time import process_time as clock

import torch

from appo.rollout.cpu.matmuls import cpu_info

RESULTS = Path(__file__).resolve().parent / "results" / "rollout.md"


def decode_rule(lm) -> str:
    """The decode matmul rule the engine follows here (`appo.rollout.cpu.matmuls`)."""
    from appo.rollout.cpu.lean import LeanDecoder

    return str(LeanDecoder(lm.model).rule)


def load_average() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


MACHINE = f"{cpu_info()['model']}, 2 cores, 24 GiB, torch {torch.__version__}"
QUESTIONS = [
    "What is 17*23?", "Name three colors.", "Explain gravity briefly.",
    "Write a haiku about rain.", "What is the capital of France?", "Count from 1 to 10.",
    "Describe a cat.", "Why is the sky blue?",
]


@dataclass
class StubResult:
    text: str
    ok: bool = True
    error_kind: str | None = None
    latency_s: float = 0.0
    cached: bool = False


class StubTools:
    """A tool executor with a fixed result: the same tool cost for every run."""

    tags = ["python"]
    text = "56300\n(the python interpreter printed the value above; exit status 0)"

    def execute_many(self, calls):
        return [StubResult(self.text) for _ in calls]


def chat_ids(tok, question: str, template: str = "code_search", tools=None) -> list[int]:
    from appo.data.templates import build_messages

    return list(tok.apply_chat_template(build_messages(question, template, tools),
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


# ---------------------------------------------------------------- (a)
def bench_decode(lm, new_tokens: int, repeats: int) -> dict:
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams

    tok = lm.tokenizer
    prompts = [chat_ids(tok, q) for q in QUESTIONS]

    def ours(n: int) -> float:
        eng = HFEngine(lm.model, tok, seed=0, eos_ids=frozenset())
        rows = [eng.fork(eng.add_row(p), 1)[0] for p in prompts]
        t0 = clock()
        outs = eng.decode(rows, [n] * len(rows), SamplingParams())
        elapsed = clock() - t0
        assert all(len(o.token_ids) == n for o in outs)
        return elapsed

    def generate(n: int) -> float:
        tok.padding_side = "left"
        enc = tok([tok.decode(p) for p in prompts], return_tensors="pt", padding=True,
                  add_special_tokens=False)
        torch.manual_seed(0)
        t0 = clock()
        with torch.inference_mode():
            out = lm.model.generate(**enc, max_new_tokens=n, min_new_tokens=n,
                                    do_sample=True, temperature=1.0, top_p=1.0, top_k=None,
                                    pad_token_id=tok.pad_token_id)
        elapsed = clock() - t0
        assert out.shape[1] - enc["input_ids"].shape[1] == n
        return elapsed

    # Decode time = time(N new tokens) - time(1 new token): the prompt prefill (the same
    # work on both sides, ~2k tokens) is taken out, so the figure is decode throughput.
    pairs, totals = [], []
    for _ in range(repeats):
        a_full, a_one = ours(new_tokens), ours(1)
        b_full, b_one = generate(new_tokens), generate(1)
        a, b = a_full - a_one, b_full - b_one
        pairs.append((a, b))
        totals.append((a_full, b_full))
        print(f"  (a) N={new_tokens}: decode engine {a:.1f}s generate {b:.1f}s ratio {b / a:.2f}"
              f"  (with prefill: {a_full:.1f}s vs {b_full:.1f}s)", flush=True)
    tokens = (new_tokens - 1) * len(prompts)
    return {
        "total_ratio_median": statistics.median(b / a for a, b in totals),
        "new_tokens": new_tokens,
        "rows": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "engine_best_s": min(a for a, _ in pairs),
        "generate_best_s": min(b for _, b in pairs),
        "engine_tok_s": tokens / min(a for a, _ in pairs),
        "generate_tok_s": tokens / min(b for _, b in pairs),
        "ratio_median": statistics.median(b / a for a, b in pairs),
        "ratio_best": min(b for _, b in pairs) / min(a for a, _ in pairs),
        "ratios": [b / a for a, b in pairs],
    }


def bench_decode_stops(lm, new_tokens: int, seeds: int) -> dict:
    """(a2) The same batch and settings as a rollout runs them: EOS and the tool stop
    strings end a row, at most `new_tokens` per row.

    Both sides produce the very same tokens: the engine samples, then `generate` is made to
    follow the engine's tokens (a logits processor leaves one token possible per row), so
    the work differs only in how each side runs it: `generate` keeps stepping the whole
    batch (finished rows padded) until every row has stopped; the engine drops stopped
    rows. Throughput = tokens up to each row's stop / decode time.
    """
    from transformers import LogitsProcessor, LogitsProcessorList

    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams
    from appo.rollout.stops import tool_stop_strings

    tok = lm.tokenizer
    tags = ["python", "search"]
    stops = tool_stop_strings(tags)
    prompts = [chat_ids(tok, q, "code_search", tags) for q in QUESTIONS]
    eos = sorted(HFEngine(lm.model, tok).eos_ids)
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    class Follow(LogitsProcessor):
        """Only the engine's token is possible (EOS once a row's tokens are used up)."""

        def __init__(self, rows: list[list[int]]):
            self.rows = rows

        def __call__(self, ids, scores):
            step = ids.shape[1] - width
            forced = torch.tensor([r[step] if step < len(r) else eos[0] for r in self.rows])
            keep = scores.gather(1, forced[:, None])
            return scores.fill_(float("-inf")).scatter_(1, forced[:, None], keep)

    def ours(n: int, seed: int) -> tuple[float, list[list[int]]]:
        eng = HFEngine(lm.model, tok, seed=seed, stop_strings=stops)
        rows = [eng.fork(eng.add_row(p), 1)[0] for p in prompts]
        t0 = clock()
        outs = eng.decode(rows, [n] * len(rows), SamplingParams())
        return clock() - t0, [o.token_ids for o in outs]

    def generate(n: int, rows: list[list[int]]) -> tuple[float, list[list[int]]]:
        t0 = clock()
        with torch.inference_mode():
            out = lm.model.generate(
                input_ids=input_ids, attention_mask=attention, max_new_tokens=n,
                do_sample=True, temperature=1.0, top_p=1.0, top_k=None,
                pad_token_id=tok.pad_token_id, eos_token_id=eos, stop_strings=stops,
                tokenizer=tok, logits_processor=LogitsProcessorList([Follow(rows)]))
        return clock() - t0, [r[width:].tolist() for r in out]

    runs = []
    for seed in range(seeds):
        (a_full, sampled), (a_one, first) = ours(new_tokens, seed), ours(1, seed)
        (b_full, followed), (b_one, _) = generate(new_tokens, sampled), generate(1, first)
        for mine, theirs in zip(sampled, followed, strict=True):
            if theirs[: len(mine)] != mine:
                raise RuntimeError("generate did not reproduce the engine's tokens")
        tokens = sum(len(r) for r in sampled)
        a, b = a_full - a_one, b_full - b_one
        runs.append((a, b, tokens, max(len(r) for r in sampled)))
        print(f"  (a2) seed {seed}: {tokens} tokens (longest row {runs[-1][3]}): engine "
              f"{a:.1f}s generate {b:.1f}s ratio {b / a:.2f}", flush=True)
    tokens = sum(r[2] for r in runs)
    return {
        "new_tokens": new_tokens, "rows": len(prompts), "seeds": seeds,
        "tokens": [r[2] for r in runs], "longest": [r[3] for r in runs],
        "engine_tok_s": tokens / sum(r[0] for r in runs),
        "generate_tok_s": tokens / sum(r[1] for r in runs),
        "ratio_median": statistics.median(r[1] / r[0] for r in runs),
        "ratios": [r[1] / r[0] for r in runs],
    }


def bench_decode_rule(lm, prompts_n: int, per_prompt: int, new_tokens: int,
                      repeats: int) -> dict:
    """(a3) The decode matmul rule vs each single implementation forced for every step.

    A rollout-sized batch (`prompts_n` prompts x `per_prompt` rows, `code_search` prompt,
    EOS and tool stops on, at most `new_tokens` per row), so steps run at every row count
    from the full batch down to one row as rows stop. Same seed for every policy; policies
    are interleaved within each repeat. Throughput = sampled tokens / decode CPU time
    (prefill included: it is the same torch forward for every policy).
    """
    from appo.rollout.cpu import kernels
    from appo.rollout.cpu.matmuls import FORCE_ENV
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams
    from appo.rollout.stops import tool_stop_strings

    tok = lm.tokenizer
    tags = ["python", "search"]
    prompt_ids = [chat_ids(tok, q, "code_search", tags) for q in QUESTIONS[:prompts_n]]
    policies = ["rule", "torch", "torch_weight_first"]
    if kernels.available():
        policies += ["numba", "numba_wide"]

    def run(policy: str, seed: int) -> tuple[float, int]:
        if policy == "rule":
            os.environ.pop(FORCE_ENV, None)
        else:
            os.environ[FORCE_ENV] = policy
        try:
            eng = HFEngine(lm.model, tok, seed=seed, stop_strings=tool_stop_strings(tags))
            rows = [r for p in prompt_ids for r in eng.fork(eng.add_row(p), per_prompt)]
            t0 = clock()
            outs = eng.decode(rows, [new_tokens] * len(rows), SamplingParams())
            return clock() - t0, sum(len(o.token_ids) for o in outs)
        finally:
            os.environ.pop(FORCE_ENV, None)

    runs: dict[str, list[tuple[float, int]]] = {p: [] for p in policies}
    for rep in range(repeats):
        for policy in policies:
            seconds, tokens = run(policy, rep)
            runs[policy].append((seconds, tokens))
            print(f"  (a3) rep {rep} {policy}: {tokens} tokens in {seconds:.1f}s "
                  f"({tokens / seconds:.1f} tok/s)", flush=True)
    tok_s = {p: sum(t for _, t in r) / sum(s for s, _ in r) for p, r in runs.items()}
    return {
        "rows": prompts_n * per_prompt, "new_tokens": new_tokens, "repeats": repeats,
        "tok_s": tok_s,
        "tokens": {p: [t for _, t in r] for p, r in runs.items()},
        # tok/s of the rule over tok/s of the policy, per repeat (the same seed on both
        # sides, but float differences let the rows sample different lengths)
        "rule_speedup": {p: [(pt / ps) / (t / s) for (s, t), (ps, pt) in zip(r, runs["rule"],
                                                                            strict=True)]
                         for p, r in runs.items()},
    }


# ---------------------------------------------------------------- (b)
def bench_arpo(lm, n: int, initial: int, max_response: int, repeats: int) -> dict:
    from appo.rollout import RolloutPrompt, RolloutSettings, rollout
    from appo.rollout.hf_engine import HFEngine

    tok = lm.tokenizer
    prefix = tok.encode("<think> I will compute this with python. </think>\n<python>\nprint(",
                        add_special_tokens=False)
    questions = ["What is 123 * 457 + 89?", "What is 2**20 - 1000?"]
    prompts = [RolloutPrompt(f"q{i}", chat_ids(tok, q, "math", ["python"]) + prefix)
               for i, q in enumerate(questions)]
    settings = RolloutSettings(n=n, initial_rollouts=initial, max_response_length=max_response,
                               call_limit=3)
    runs: dict[str, list] = {"arpo_reuse": [], "arpo_no_reuse": [], "grpo_no_reuse": []}
    for rep in range(repeats):
        for name in runs:
            strategy, reuse = name.split("_", 1)
            eng = HFEngine(lm.model, tok, seed=rep, reuse_cache=(reuse == "reuse"))
            t0 = clock()
            batch = rollout(prompts, eng, StubTools(), settings, strategy=strategy,
                            rng=random.Random(rep))
            s = batch.stats
            s.cpu_seconds = clock() - t0  # CPU seconds, see the module docstring
            runs[name].append(s)
            print(f"  (b) {name}: {s.cpu_seconds:.1f}s CPU {s.wall_seconds:.1f}s wall "
                  f"prefilled {s.tokens_prefilled} "
                  f"(recompute {s.recompute_tokens}) sampled {s.tokens_sampled} "
                  f"calls {s.tool_calls} branches {s.branches} rounds {s.rounds}", flush=True)
    out = {}
    for name, stats in runs.items():
        out[name] = {
            "cpu_s": [s.cpu_seconds for s in stats],
            "wall_s": [s.wall_seconds for s in stats],
            "prefilled": [s.tokens_prefilled for s in stats],
            "recompute": [s.recompute_tokens for s in stats],
            "sampled": [s.tokens_sampled for s in stats],
            "forced": [s.tokens_forced for s in stats],
            "tool_calls": [s.tool_calls for s in stats],
            "branches": [s.branches for s in stats],
            "rounds": [s.rounds for s in stats],
        }
    reuse = runs["arpo_reuse"]
    out["prefill_fraction"] = [s.tokens_prefilled / s.recompute_tokens for s in reuse]
    return out


# ---------------------------------------------------------------- (c)
def bench_multiround(lm, rows: int, rounds: int, sampled: int, forced: int,
                     repeats: int) -> dict:
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams

    tok = lm.tokenizer
    prompt = chat_ids(tok, "What is 123 * 457 + 89? Use python.", "math", ["python"])
    result = tok.encode(" <result>\n" + "7 " * (forced - 6) + "\n</result>",
                        add_special_tokens=False)[:forced]

    def run(reuse: bool) -> tuple[float, int, list[float]]:
        eng = HFEngine(lm.model, tok, seed=0, reuse_cache=reuse, eos_ids=frozenset())
        root = eng.add_row(prompt)
        eng.prefill([root])
        ids = eng.fork(root, rows)
        per_round = []
        t0 = clock()
        for _ in range(rounds):
            r0 = clock()
            eng.decode(ids, [sampled] * rows, SamplingParams())
            for r in ids:
                eng.append(r, result)
            per_round.append(clock() - r0)
        r0 = clock()
        eng.decode(ids, [sampled] * rows, SamplingParams())
        per_round.append(clock() - r0)
        return clock() - t0, eng.counters.prefilled, per_round

    pairs = []
    for _ in range(repeats):
        a = run(True)
        b = run(False)
        pairs.append((a, b))
        print(f"  (c) reuse {a[0]:.1f}s (prefilled {a[1]})  re-prefill {b[0]:.1f}s "
              f"(prefilled {b[1]})  ratio {b[0] / a[0]:.2f}", flush=True)
    best_a = min(pairs, key=lambda p: p[0][0])[0]
    best_b = min(pairs, key=lambda p: p[1][0])[1]
    return {
        "rows": rows, "rounds": rounds, "sampled": sampled, "forced": forced,
        "prompt_tokens": len(prompt),
        "reuse_best_s": best_a[0], "reprefill_best_s": best_b[0],
        "reuse_prefilled": best_a[1], "reprefill_prefilled": best_b[1],
        "reuse_round_s": best_a[2], "reprefill_round_s": best_b[2],
        "ratio_median": statistics.median(b[0] / a[0] for a, b in pairs),
    }


def kv_check(lm) -> float:
    """Max |logp(engine) - logp(full forward)| over a fork + tool-round sequence."""
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams

    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=0)
    rows = eng.fork(eng.add_row(chat_ids(tok, "What is 17*23?")), 3)
    rec: dict[int, dict[int, float]] = {r: {} for r in rows}

    def step(rs, n):
        starts = {r: len(eng.row_ids(r)) for r in rs}
        for r, o in zip(rs, eng.decode(rs, [n] * len(rs), SamplingParams()), strict=True):
            rec[r].update({starts[r] + k: lp for k, lp in enumerate(o.logps)})

    step(rows, 40)
    eng.append(rows[0], tok.encode(" <result>\n391\n</result>", add_special_tokens=False))
    [kid] = eng.fork(rows[0], 1)
    rec[kid] = dict(rec[rows[0]])
    step(rows + [kid], 30)
    worst = 0.0
    for r, positions in rec.items():
        ids = eng.row_ids(r)
        with torch.no_grad():
            logp = torch.log_softmax(lm.model(torch.tensor([ids])).logits[0].float(), -1)
        for pos, lp in positions.items():
            worst = max(worst, abs(float(logp[pos - 1, ids[pos]]) - lp))
    return worst


def write_results(res: dict, args: argparse.Namespace) -> None:
    a_short, a_long = res["a"]
    b, c = res["b"], res["c"]
    frac = b["prefill_fraction"]

    def mean(xs):
        return sum(xs) / len(xs)

    lines = [
        "# Rollout engine benchmarks (appo.rollout, `hf` engine)",
        "",
        f"- command: `.venv/bin/python benchmarks/rollout.py{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`",
        f"- date: {datetime.date.today().isoformat()}",
        f"- machine: {MACHINE} (torch threads: {args.threads}); python "
        f"{platform.python_version()}; load average (1/5/15 min) at start {res['load_start']}, "
        f"at end {load_average()}",
        "- model: SmolLM2-135M-Instruct, float32, CPU. Ratios are measured in the same run, "
        "sides interleaved; times are the best of the repeats.",
        "- engine: lean forward, cascade decode attention, decode matmuls by the fixed rule "
        f"for this CPU (`appo.rollout.cpu.matmuls`; from rows: implementation): {res['rule']}"
        "; `generate` runs the model's own forward (MKL matmuls)",
        f"- KV-cache exactness on SmolLM2 (forks + a tool round): max |logp(engine) - "
        f"logp(full forward)| = {res['kv_err']:.2e}",
        "",
        "## (a) decode throughput: engine vs `model.generate`, same batch and settings",
        "",
        "8 rows (prompts of ~270 tokens: `code_search` system prompt), temperature 1, fixed "
        "number of new tokens (EOS does not stop either side).",
        "",
        "Decode time = time(N new tokens) - time(1 new token), so the shared ~2.1k-token "
        "prompt prefill is taken out; the last column includes it.",
        "",
        "| new tokens | engine decode tok/s | generate decode tok/s | speed-up (best) | "
        "speed-up (median pair) | incl. prefill (median) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for a in (a_short, a_long):
        lines.append(f"| {a['new_tokens']} | {a['engine_tok_s']:.1f} | {a['generate_tok_s']:.1f} "
                     f"| {a['ratio_best']:.2f}x | {a['ratio_median']:.2f}x "
                     f"| {a['total_ratio_median']:.2f}x |")
    a2 = res["a2"]
    lines += [
        "",
        "### (a2) the same, as a rollout runs it: EOS and tool stop strings on",
        "",
        f"8 rows, `code_search` prompt with python and search tools, temperature 1, at most "
        f"{a2['new_tokens']} new tokens; a row ends at EOS or `</python>` / `</search>`. "
        "`generate` is made to follow the engine's sampled tokens (a logits processor), so "
        "both produce the very same tokens; `generate` steps the whole batch until the last "
        "row stops, the engine drops stopped rows. Decode time as above.",
        "",
        "| seed | tokens | longest row | speed-up |",
        "| --- | --- | --- | --- |",
    ]
    for i, (n, longest, r) in enumerate(zip(a2["tokens"], a2["longest"], a2["ratios"],
                                            strict=True)):
        lines.append(f"| {i} | {n} | {longest} | {r:.2f}x |")
    lines += [
        "",
        f"Over all seeds: engine {a2['engine_tok_s']:.1f} tok/s, generate "
        f"{a2['generate_tok_s']:.1f} tok/s; median speed-up {a2['ratio_median']:.2f}x.",
        "",
    ]
    a3 = res["a3"]
    lines += [
        "### (a3) decode matmuls: the engine's rule vs one implementation for every step",
        "",
        f"{a3['rows']} rows (4 prompts x 8, `code_search` prompt), EOS and tool stops on, at "
        f"most {a3['new_tokens']} new tokens, so decode steps run at every row count from "
        f"{a3['rows']} down to 1; same seeds for every policy, policies interleaved, "
        f"{a3['repeats']} repeats. `rule` is the engine's default (`appo.rollout.cpu.matmuls`); "
        "the others force one implementation (`APPO_DECODE_MATMUL`).",
        "",
        "| policy | tok/s (all repeats) | tokens per repeat | rule's tok/s over the policy's (per repeat) |",
        "| --- | --- | --- | --- |",
    ]
    for policy, tok_s in a3["tok_s"].items():
        ratios = ", ".join(f"{r:.2f}x" for r in a3["rule_speedup"][policy])
        tokens = ", ".join(str(t) for t in a3["tokens"][policy])
        lines.append(f"| {policy} | {tok_s:.1f} | {tokens} | {ratios} |")
    lines += [
        "",
        "## (b) arpo n=16 (8 initial) vs recomputing every prefix / 16 independent rollouts",
        "",
        f"2 prompts, max_response_length={args.b_max_response}, stub tool (fixed result). "
        "`prefilled` = tokens pushed through the model in prefill forwards; `recompute` = "
        "what the same rollout costs when every row re-reads its whole context at every "
        "round (prefilled + reused from cache).",
        "",
        "| run | CPU s (mean) | wall s (mean) | prefilled (mean) | recompute-every-prefix "
        "(mean) | sampled | tool calls | branches | rounds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("arpo_reuse", "arpo_no_reuse", "grpo_no_reuse"):
        r = b[name]
        lines.append(
            f"| {name} | {mean(r['cpu_s']):.1f} | {mean(r['wall_s']):.1f} | "
            f"{mean(r['prefilled']):.0f} | "
            f"{mean(r['recompute']):.0f} | {mean(r['sampled']):.0f} | "
            f"{mean(r['tool_calls']):.1f} | {mean(r['branches']):.1f} | {mean(r['rounds']):.1f} |")
    lines += [
        "",
        f"Prefill computed by arpo with reuse, as a fraction of recomputing every prefix: "
        f"{', '.join(f'{f:.1%}' for f in frac)} (target <= 60%).",
        f"CPU time, arpo with reuse vs arpo without reuse: "
        f"{mean(b['arpo_no_reuse']['cpu_s']) / mean(b['arpo_reuse']['cpu_s']):.2f}x faster "
        f"(wall {mean(b['arpo_no_reuse']['wall_s']) / mean(b['arpo_reuse']['wall_s']):.2f}x); "
        f"vs 16 independent rollouts (grpo, no reuse): "
        f"{mean(b['grpo_no_reuse']['cpu_s']) / mean(b['arpo_reuse']['cpu_s']):.2f}x "
        "(different trees: runs sample different lengths and calls, see the columns).",
        "",
        "## (c) multi-round tool rollout: cache reuse vs re-prefilling each round",
        "",
        f"{c['rows']} rows from one prompt ({c['prompt_tokens']} tokens), {c['rounds']} rounds "
        f"of {c['sampled']} sampled + {c['forced']} forced tool-result tokens, then a final "
        f"segment; EOS off (identical work on both sides).",
        "",
        "| | CPU s (best) | prefilled tokens |",
        "| --- | --- | --- |",
        f"| cache reuse | {c['reuse_best_s']:.1f} | {c['reuse_prefilled']} |",
        f"| re-prefill every round | {c['reprefill_best_s']:.1f} | {c['reprefill_prefilled']} |",
        "",
        f"Speed-up {c['reprefill_best_s'] / c['reuse_best_s']:.2f}x (best), "
        f"{c['ratio_median']:.2f}x (median pair). Per-round CPU seconds, reuse: "
        f"{', '.join(f'{x:.1f}' for x in c['reuse_round_s'])}; re-prefill: "
        f"{', '.join(f'{x:.1f}' for x in c['reprefill_round_s'])}.",
        "",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines))
    print(f"wrote {RESULTS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, do not write results")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--b-max-response", type=int, default=192)
    parser.add_argument("--only-a", action="store_true",
                        help="only (a), decode throughput; prints, does not write results")
    parser.add_argument("--only-a3", action="store_true",
                        help="only (a3), the decode matmul rule; prints, does not write results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from appo.models import load_model

    lm = load_model("smollm2-135m", device="cpu")
    res: dict = {"load_start": load_average(), "rule": decode_rule(lm)}
    print("decode matmul rule:", res["rule"], flush=True)
    res["kv_err"] = kv_check(lm)
    print(f"KV check: max abs logp diff {res['kv_err']:.2e}", flush=True)
    if args.only_a:
        res["a"] = [bench_decode(lm, 128, args.repeats), bench_decode(lm, 384, args.repeats)]
        for a in res["a"]:
            print({k: a[k] for k in ("new_tokens", "engine_tok_s", "generate_tok_s",
                                     "ratio_best", "ratio_median", "total_ratio_median")})
        print(bench_decode_stops(lm, 256, args.repeats))
        return
    if args.only_a3:
        print(bench_decode_rule(lm, 4, 8, 192, args.repeats))
        return
    if args.quick:
        res["a"] = [bench_decode(lm, 8, 1), bench_decode(lm, 16, 1)]
        res["a2"] = bench_decode_stops(lm, 16, 1)
        res["a3"] = bench_decode_rule(lm, 2, 2, 16, 1)
        res["b"] = bench_arpo(lm, 4, 2, 48, 1)
        res["c"] = bench_multiround(lm, 2, 2, 8, 16, 1)
        print(res)
        return
    res["a"] = [bench_decode(lm, 128, args.repeats), bench_decode(lm, 384, args.repeats)]
    res["a2"] = bench_decode_stops(lm, 256, args.repeats + 1)
    res["a3"] = bench_decode_rule(lm, 4, 8, 192, args.repeats)
    res["b"] = bench_arpo(lm, 16, 8, args.b_max_response, max(1, args.repeats - 1))
    res["c"] = bench_multiround(lm, 4, 6, 32, 48, args.repeats)
    write_results(res, args)


if __name__ == "__main__":
    main()
