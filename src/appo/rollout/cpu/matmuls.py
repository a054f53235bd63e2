"""Which matmuls a CPU decode step runs: a fixed rule by row count and CPU, overridable.

A decode step multiplies a few rows (one per sequence) by every weight matrix of the model.
Seven implementations compute it (`IMPLEMENTATIONS`, all `F.linear` up to summation order):
torch (MKL; the LM head in row blocks), torch as `(W @ x^T)^T`, oneDNN on packed weights
(`appo.rollout.cpu.onednn`), and the four numba kernels of `appo.rollout.cpu.kernels`.
Which is fastest depends on the CPU and on the row count, so the default is a `MatmulRule` (row count -> implementation) picked by `default_rule` from the
CPU's vendor, its AVX-512 support and whether the kernels are installed; each rule was read
off `benchmarks/decode_kernel.py` on a machine of that kind (tables in
`benchmarks/RESULTS.md`). Nothing is measured at run time and nothing is stored: a seed's
rollouts depend only on the machine and the environment.

`APPO_DECODE_MATMUL` overrides the rule: one implementation name for every step
(`APPO_DECODE_MATMUL=torch`), or a rule such as `1:numba,8:numba_wide,96:torch` (each
implementation from its row count up), e.g. the last line `benchmarks/decode_kernel.py`
prints on a machine none of the rules describes. `APPO_CPU_KERNELS=0` leaves the numba
kernels out.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from appo.errors import AppoError
from appo.rollout.cpu import kernels, onednn
from appo.rollout.cpu.cpuinfo import cpu_info

HEAD_BLOCK = 1024
FORCE_ENV = "APPO_DECODE_MATMUL"


def linear_weight_first(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear` computed as `(W @ x^T)^T`: the same product, which MKL runs faster than
    `F.linear` at 2-5 rows on AMD CPUs (slower on Intel)."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.mm(weight, rows.t()).t().contiguous()
    y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def head_in_blocks(x: Tensor, weight: Tensor) -> Tensor:
    """`x @ weight.T` (`[B, V]`) in blocks of `HEAD_BLOCK` weight rows: MKL runs a tall LM
    head (49k x 576) slower in one call than in blocks."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    for lo in range(0, weight.shape[0], HEAD_BLOCK):
        block = weight[lo : lo + HEAD_BLOCK]
        torch.mm(x, block.t(), out=out[:, lo : lo + block.shape[0]])
    return out


@functools.cache
def _splitter():
    """How the kernels' chunks reach the threads: `appo.rollout.cpu.team.run` (spinning
    helpers; it hands to `split`'s queue itself where it does not apply, e.g. with
    `APPO_CPU_TEAM=0`). Imported on the first kernel matmul (it imports numba)."""
    from appo.rollout.cpu import team

    return team.run


def _numba_linear(kind: str):
    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return kernels.linear(x, weight, bias, kind, run=_splitter())

    return linear


def _torch_numpy_linear(weight_first: bool):
    """`F.linear` (or `linear_weight_first`) on a `[M, K]` numpy array into a new numpy
    array: the same MKL call, without the tensor <-> numpy conversions around it."""
    def linear(x, weight: Tensor, bias: Tensor | None = None):
        out = np.empty((x.shape[0], weight.shape[0]), dtype=x.dtype)
        rows, out_t = torch.from_numpy(x), torch.from_numpy(out)
        if weight_first:
            out_t.copy_(torch.mm(weight, rows.t()).t())
            if bias is not None:
                out_t += bias
        elif bias is None:
            torch.mm(rows, weight.t(), out=out_t)
        else:  # what F.linear runs with a bias (the sum inside the GEMM)
            torch.addmm(bias, rows, weight.t(), out=out_t)
        return out

    return linear


def _numba_numpy_linear(kind: str):
    def linear(x, weight: Tensor, bias: Tensor | None = None):
        return kernels.linear_numpy(x, weight, bias, kind, run=_splitter())

    return linear


@dataclass(frozen=True)
class Implementation:
    """One way to run a decode step's matmuls: `linear` for the projections
    (`F.linear` semantics) and `head` for the LM head (`x @ W^T`, no bias)."""

    name: str
    linear: Callable[..., Tensor]
    head: Callable[[Tensor, Tensor], Tensor]
    kernel: bool = False  # needs numba (appo.rollout.cpu.kernels)
    # Rounds its float32 operands to bfloat16 (`rollout.cpu_weights` only): not `F.linear`
    # up to summation order, and never a rule's or `APPO_DECODE_MATMUL`'s choice.
    low_precision: bool = False
    # `linear` on a `[M, K]` numpy array returning numpy (no tensors made), where the
    # implementation has one; the fused decode step (`appo.rollout.cpu.fused`) uses it.
    numpy_linear: Callable | None = None


# The numba implementations and their kernels (`kernels.BUILDERS`).
KERNEL_KINDS = {"numba": "row", "numba_wide": "wide", "numba_tile": "tile",
                "numba_panel": "panel"}


def _numba(name: str, kind: str) -> Implementation:
    linear = _numba_linear(kind)
    return Implementation(name, linear, linear, kernel=True,
                          numpy_linear=_numba_numpy_linear(kind))


IMPLEMENTATIONS: dict[str, Implementation] = {
    "torch": Implementation("torch", F.linear, head_in_blocks,
                            numpy_linear=_torch_numpy_linear(False)),
    "torch_weight_first": Implementation("torch_weight_first", linear_weight_first,
                                         head_in_blocks, numpy_linear=_torch_numpy_linear(True)),
    # oneDNN (torch's) on weights packed once (`appo.rollout.cpu.onednn`; no numba needed).
    "torch_onednn": Implementation("torch_onednn", onednn.linear, onednn.linear,
                                   numpy_linear=onednn.numpy_linear),
    # oneDNN's bf16 kernels on bfloat16 packed weights: `rollout.cpu_weights=bfloat16`
    # only (low precision; never a default rule's choice).
    "onednn_bf16": Implementation("onednn_bf16", onednn.linear_bf16, onednn.linear_bf16,
                                  numpy_linear=onednn.numpy_linear_bf16, low_precision=True),
    **{name: _numba(name, kind) for name, kind in KERNEL_KINDS.items()},
}
DEFAULT = IMPLEMENTATIONS["torch"]


@dataclass(frozen=True)
class MatmulRule:
    """Row count -> implementation: `steps` are `(first row count, name)`, ascending from 1;
    each name serves row counts from its own up to the next step's. `prefill`: the
    implementation of the engine's multi-token forwards (prompts, tool results)."""

    steps: tuple[tuple[int, str], ...]
    prefill: str = "torch"

    def __post_init__(self):
        firsts = [rows for rows, _ in self.steps]
        if not firsts or firsts[0] != 1 or firsts != sorted(set(firsts)):
            raise AppoError(f"a decode matmul rule starts at 1 row and rises: {self}")
        unknown = [name for _, name in (*self.steps, (0, self.prefill))
                   if name not in IMPLEMENTATIONS]
        if unknown:
            raise AppoError(f"{', '.join(unknown)}: not a decode matmul implementation "
                            f"(choose from {', '.join(IMPLEMENTATIONS)})")

    @classmethod
    def parse(cls, text: str) -> MatmulRule:
        """`"numba"` (one implementation for every step) or `"1:numba,8:numba_wide"`."""
        text = text.strip()
        if ":" not in text:
            return cls(((1, text),))
        steps = []
        for part in text.split(","):
            rows, sep, name = part.partition(":")
            if not sep or not rows.strip().isdigit():
                raise AppoError(f"decode matmul rule {text!r}: expected rows:name, got {part!r}")
            steps.append((int(rows), name.strip()))
        return cls(tuple(steps))

    def __str__(self) -> str:
        return ",".join(f"{rows}:{name}" for rows, name in self.steps)

    def name_for(self, rows: int) -> str:
        return [name for first, name in self.steps if first <= max(rows, 1)][-1]

    def implementation(self, rows: int) -> Implementation:
        return IMPLEMENTATIONS[self.name_for(rows)]

    def prefill_implementation(self) -> Implementation:
        return IMPLEMENTATIONS[self.prefill]

    @property
    def kernels(self) -> bool:
        return any(IMPLEMENTATIONS[name].kernel for _, name in (*self.steps, (0, self.prefill)))


# What each rule is read from: benchmarks/decode_kernel.py, 1 torch thread, on the machine
# named (benchmarks/RESULTS.md, "CPU decode matmuls"). MKL's small-batch GEMM did far
# better on the Intel CPU than on the AMD ones, so the vendor matters as much as the vector
# width.
RULES: dict[str, MatmulRule] = {
    # AMD EPYC Zen 5 (2026-11-28): the panel kernel at AVX-512 width (32-column panels, 8
    # rows, its weight stream prefetched) at every row count and for prefill: 1.07-1.27x
    # oneDNN on packed weights at 1-256 rows, 2 threads (oneDNN was 1.14-1.29x the wide
    # kernel before). One packed copy of every weight, as oneDNN's was (the lean decoder
    # keeps QKV and gate/up as panels only). On a Zen 4, before the panel kernel and
    # oneDNN: the row kernel up to 7 rows, the wide one from 8.
    "amd-avx512": MatmulRule(MatmulRule.parse("numba_panel").steps, prefill="numba_panel"),
    # AMD EPYC Zen 3: the panel kernel at every row count (faster than the row and tile
    # kernels it replaced at 1-32 rows, 1 and 2 threads; MKL's threaded GEMM at 16-32 rows
    # was slower still, and far slower on a busy machine).
    "amd-avx2": MatmulRule.parse("numba_panel"),
    # Intel Xeon (Emerald Rapids): MKL at 1-3 rows and from 16 rows up, the wide kernel
    # in between.
    "intel-avx512": MatmulRule.parse("1:torch,4:numba_wide,16:torch"),
    # AMD without the kernels: MKL runs `W @ x^T` faster at 2-5 rows (Zen 3 and Zen 4).
    "amd-torch": MatmulRule.parse("1:torch,2:torch_weight_first,6:torch"),
    "torch": MatmulRule.parse("torch"),
}
# The rules were measured at 1 and 2 torch threads while the kernels ran on one thread;
# they now split over the run's threads (`appo.rollout.cpu.split`, same results), which
# is not yet timed on a quiet machine, neither where a rule names them nor against MKL
# where it does not. With more threads MKL's threaded GEMM is the safer default.
MAX_RULE_THREADS = 2


def rule_name(use_kernels: bool, vendor: str, avx512: bool, threads: int) -> str:
    """The `RULES` entry for a CPU (see the table's comments)."""
    if threads > MAX_RULE_THREADS:
        return "torch"
    if vendor == "AuthenticAMD":
        return ("amd-avx512" if avx512 else "amd-avx2") if use_kernels else "amd-torch"
    if vendor == "GenuineIntel" and use_kernels and avx512:
        return "intel-avx512"
    return "torch"


def default_rule(use_kernels: bool) -> MatmulRule:
    """The rule for this machine (no override), with or without the numba kernels."""
    avx512 = use_kernels and kernels.wide_registers()
    return RULES[rule_name(use_kernels, cpu_info()["vendor"], avx512, torch.get_num_threads())]


# `rollout.cpu_weights=bfloat16`: every projection and the LM head, prefill and decode.
BF16_RULE = MatmulRule(((1, "onednn_bf16"),), prefill="onednn_bf16")
CPU_WEIGHTS = ("float32", "bfloat16")


def decode_rule(dtype: torch.dtype, device: torch.device, use_kernels: bool,
                weights: str = "float32") -> MatmulRule:
    """The rule a lean decoder's decode steps follow: `APPO_DECODE_MATMUL` if set, else
    `default_rule`. Only float32 on CPU has a choice (the kernels are float32 CPU code).
    `weights="bfloat16"` (`rollout.cpu_weights`): `BF16_RULE`, where it can run."""
    text = os.environ.get(FORCE_ENV, "").strip()
    if weights not in CPU_WEIGHTS:
        raise AppoError(f"rollout.cpu_weights={weights!r}: choose from {', '.join(CPU_WEIGHTS)}")
    if weights == "bfloat16":
        return _bf16_rule(dtype, device, text)
    forced = MatmulRule.parse(text) if text else None
    if forced is not None and any(IMPLEMENTATIONS[name].low_precision
                                  for _, name in (*forced.steps, (0, forced.prefill))):
        raise AppoError(f"{FORCE_ENV}={text}: bfloat16 matmuls are chosen with "
                        "rollout.cpu_weights=bfloat16, not here")
    if device.type != "cpu" or dtype != torch.float32:
        if forced is not None and forced != RULES["torch"]:
            raise AppoError(f"{FORCE_ENV}={text} does not apply to a {dtype} model on "
                            f"{device.type} (only torch does)")
        return RULES["torch"]
    if forced is None:
        return default_rule(use_kernels)
    if forced.kernels and not use_kernels:
        raise AppoError(f"{FORCE_ENV}={text} needs the numba CPU kernels, which are off "
                        "(numba missing: pip install 'appo[cpu-kernels]'; or "
                        "APPO_CPU_KERNELS=0 or cpu_kernel=False)")
    return forced


def _bf16_rule(dtype: torch.dtype, device: torch.device, forced: str) -> MatmulRule:
    """`BF16_RULE`, or one line saying why this run cannot use it."""
    why = None
    if forced:
        why = f"{FORCE_ENV}={forced} also chooses the matmuls; unset one of them"
    elif device.type != "cpu" or dtype != torch.float32:
        why = f"it applies to a float32 model on CPU, not {dtype} on {device.type}"
    elif not onednn.bf16_available():
        why = ("this CPU has no bf16 dot-product instructions (avx512_bf16 or amx_bf16), "
               "or this torch has no oneDNN bf16 support")
    if why is not None:
        raise AppoError(f"rollout.cpu_weights=bfloat16: {why}")
    return BF16_RULE
