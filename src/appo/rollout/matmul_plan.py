"""Which matmuls a CPU decode step runs, chosen by measuring them on the machine itself.

A decode step multiplies a few rows (one per sequence) by every weight matrix of the model.
The fastest way to do that depends on the CPU and on the row count, and no fixed rule held
across this project's machines. Per SmolLM2-135M decode step (all projections + LM head,
ms, float32, 1 thread; `benchmarks/decode_kernel.py`, `benchmarks/RESULTS.md`):

| CPU | way | 1 row | 2 rows | 8 rows | 16 rows | 48 rows |
| --- | --- | --- | --- | --- | --- | --- |
| AMD Zen 3 (AVX2) | torch (MKL) | 57.3 | 93.7 | 105.2 | 139.7 | - |
| | numba kernel | 45.9 | 55.1 | 67.5 | 139.0 | - |
| AMD Zen 5 (AVX-512) | torch (MKL) | 30.9 | 43.0 | 52.0 | 69.1 | 139.8 |
| | numba kernels | 14.7 | 20.0 | 29.7 | 39.4 | 80.7 |
| Intel Xeon (AVX-512) | torch (MKL) | 35.3 | 35.7 | 78.9 | 88.5 | 137.6 |
| | numba kernels | 38.0 | 51.8 | 59.9 | 97.5 | 206.1 |

So the plan measures instead of guessing. The first time a decode step of a given size
bucket (`BUCKETS`) runs, every candidate in `IMPLEMENTATIONS` runs that step's matmuls on
the model's own weights (interleaved, best of `REPEATS`), and the fastest is kept for the
bucket: in memory, and in `$APPO_CACHE/tuning/decode_matmul.json` under a key naming the
CPU, the torch thread count, the library versions and the weight shapes. Later processes
on the machine read the choice instead of measuring again, so the rollouts of a seed are
reproducible from run to run (the candidates agree up to float32 summation order, not bit
for bit). Steps of more than `BUCKETS[-1]` rows use torch. Delete the file to measure
again; `APPO_DECODE_MATMUL=<name>` forces one candidate for every decode step.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from appo.errors import AppoError
from appo.rollout import cpu_kernels

log = logging.getLogger(__name__)

# A step of r rows uses the choice measured for the largest bucket <= r.
BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
REPEATS = 3
HEAD_BLOCK = 1024
FORCE_ENV = "APPO_DECODE_MATMUL"
STORE_VERSION = 1


def linear_weight_first(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear` computed as `(W @ x^T)^T`: the same product, which MKL ran 17-33% faster
    for 2-5 rows on an AMD Zen 3 (and not faster at 1, 6 or more rows)."""
    rows = x.reshape(-1, x.shape[-1])
    y = torch.mm(weight, rows.t()).t().contiguous()
    y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def head_in_blocks(x: Tensor, weight: Tensor) -> Tensor:
    """`x @ weight.T` (`[B, V]`) in blocks of `HEAD_BLOCK` weight rows: MKL handled a
    49k x 576 LM head at 8 rows ~1.4x slower in one call (AMD Zen 3: 28 vs 22 ms)."""
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    for lo in range(0, weight.shape[0], HEAD_BLOCK):
        block = weight[lo : lo + HEAD_BLOCK]
        torch.mm(x, block.t(), out=out[:, lo : lo + block.shape[0]])
    return out


def _numba_linear(wide: bool):
    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return cpu_kernels.linear(x, weight, bias, wide=wide)

    return linear


@dataclass(frozen=True)
class Implementation:
    """One way to run a decode step's matmuls: `linear` for the projections
    (`F.linear` semantics) and `head` for the LM head (`x @ W^T`, no bias)."""

    name: str
    linear: Callable[..., Tensor]
    head: Callable[[Tensor, Tensor], Tensor]
    kernel: bool = False  # needs numba (cpu_kernels)
    wide: bool = False  # the 16-accumulator kernel: only worth measuring with AVX-512


_NUMBA = _numba_linear(False)
_NUMBA_WIDE = _numba_linear(True)
IMPLEMENTATIONS: dict[str, Implementation] = {
    "torch": Implementation("torch", F.linear, head_in_blocks),
    "torch_weight_first": Implementation("torch_weight_first", linear_weight_first,
                                         head_in_blocks),
    "numba": Implementation("numba", _NUMBA, _NUMBA, kernel=True),
    "numba_wide": Implementation("numba_wide", _NUMBA_WIDE, _NUMBA_WIDE, kernel=True,
                                 wide=True),
}
DEFAULT = IMPLEMENTATIONS["torch"]


def bucket_of(rows: int) -> int | None:
    """The bucket whose measurement serves a step of `rows` rows (None: above all buckets)."""
    if rows < 1 or rows > BUCKETS[-1]:
        return None
    return max(b for b in BUCKETS if b <= rows)


# ---------------------------------------------------------------- where choices are kept
@functools.cache
def cpu_model() -> str:
    """The CPU's model name (`/proc/cpuinfo`), or what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_signature() -> dict:
    """What a measured choice depends on besides the weights: CPU, threads, libraries."""
    sig = {"cpu": cpu_model(), "machine": platform.machine(),
           "threads": torch.get_num_threads(), "torch": torch.__version__, "numba": None}
    if cpu_kernels.numba is not None:
        from llvmlite import binding

        sig["numba"] = cpu_kernels.numba.__version__
        sig["llvm_cpu"] = binding.get_host_cpu_name()
    return sig


class PlanStore:
    """Measured choices in one JSON file, shared by processes (file lock, atomic rewrite).

    A file that cannot be read as a plan store is replaced (with a warning); a location that
    cannot be written leaves the choices in memory only (with a warning).
    """

    def __init__(self, path: str | Path | None = None):
        if path is None:
            from appo.paths import cache_dir

            path = cache_dir("tuning") / "decode_matmul.json"
        self.path = Path(path)
        self._warned = False

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {"version": STORE_VERSION, "plans": {}}
        except (OSError, ValueError) as e:
            log.warning("decode matmul plan store %s is unreadable (%s); starting it afresh",
                        self.path, e)
            return {"version": STORE_VERSION, "plans": {}}
        if not isinstance(data, dict) or data.get("version") != STORE_VERSION or not isinstance(
                data.get("plans"), dict):
            log.warning("decode matmul plan store %s has an unknown format; starting it afresh",
                        self.path)
            return {"version": STORE_VERSION, "plans": {}}
        return data

    def load(self, key: str) -> dict[int, str]:
        plan = self._read()["plans"].get(key, {})
        buckets = plan.get("buckets", {}) if isinstance(plan, dict) else {}
        out = {}
        for bucket, record in buckets.items():
            choice = record.get("choice") if isinstance(record, dict) else None
            if choice in IMPLEMENTATIONS and str(bucket).isdigit():
                out[int(bucket)] = choice
        return out

    def save(self, key: str, signature: dict, bucket: int, record: dict) -> None:
        from filelock import FileLock

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(self.path) + ".lock"):
                data = self._read()
                plan = data["plans"].setdefault(key, {"signature": signature, "buckets": {}})
                plan["buckets"][str(bucket)] = record
                tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
                tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
                os.replace(tmp, self.path)
        except OSError as e:
            if not self._warned:
                log.warning("cannot write the decode matmul plan store %s (%s); measured "
                            "choices stay in this process only", self.path, e)
                self._warned = True


# Choices measured or read in this process, by plan key: engines in one process agree.
_MEMORY: dict[str, dict[int, str]] = {}


def forced_implementation(use_kernels: bool) -> Implementation | None:
    """The implementation `APPO_DECODE_MATMUL` names, or None when it is unset."""
    name = os.environ.get(FORCE_ENV, "").strip()
    if not name:
        return None
    if name not in IMPLEMENTATIONS:
        raise AppoError(f"{FORCE_ENV}={name!r} is not a decode matmul implementation "
                        f"(choose from {', '.join(IMPLEMENTATIONS)})")
    impl = IMPLEMENTATIONS[name]
    if impl.kernel and not use_kernels:
        raise AppoError(f"{FORCE_ENV}={name} needs the numba CPU kernels, which are off "
                        "(numba missing, APPO_CPU_KERNELS=0 or cpu_kernel=False)")
    return impl


class DecodeMatmulPlan:
    """Per row-count bucket, the fastest `Implementation` for one model's decode steps.

    `weights` are the matrices a decode step multiplies in order (`[out, in]`, the
    projections of every layer), `head` the LM head (None: the model runs its own head).
    `measure(impl, rows)` returns the seconds of one step's matmuls (default: timed on the
    weights); tests inject it.
    """

    def __init__(
        self,
        weights: Sequence[Tensor],
        head: Tensor | None,
        use_kernels: bool,
        store: PlanStore | None = None,
        measure: Callable[[Implementation, int], float] | None = None,
    ):
        self.weights = list(weights)
        self.head = head
        self.candidates = [
            impl for impl in IMPLEMENTATIONS.values()
            if (not impl.kernel or use_kernels) and (not impl.wide or cpu_kernels.wide_registers())
        ]
        if not self.weights:
            raise AppoError("a decode matmul plan needs the model's weight matrices")
        dtype, device = self.weights[0].dtype, self.weights[0].device
        if device.type != "cpu" or dtype != torch.float32:
            self.candidates = [DEFAULT]  # the kernels are float32 CPU code
        self.forced = forced_implementation(use_kernels)
        if self.forced is not None and self.forced not in self.candidates:
            raise AppoError(f"{FORCE_ENV}={self.forced.name} does not apply to a "
                            f"{dtype} model on {device.type} (candidates: "
                            f"{', '.join(impl.name for impl in self.candidates)})")
        self._measure = measure or self.time_step
        self._store = store
        matrices = self.weights + ([] if head is None else [head])
        self.signature = {
            **machine_signature(),
            "dtype": str(dtype),
            "shapes": [list(s) for s in sorted({tuple(w.shape) for w in matrices})],
            "matrices": len(matrices),
            "head": head is not None,
            "candidates": [impl.name for impl in self.candidates],
        }
        digest = hashlib.sha1(json.dumps(self.signature, sort_keys=True).encode())
        self.key = digest.hexdigest()[:16]

    @property
    def store(self) -> PlanStore:
        if self._store is None:
            self._store = PlanStore()
        return self._store

    def choices(self) -> dict[int, str]:
        """Bucket -> implementation name, as measured so far (here or by other processes)."""
        if self.key not in _MEMORY:
            _MEMORY[self.key] = self.store.load(self.key) if len(self.candidates) > 1 else {}
        return _MEMORY[self.key]

    def implementation(self, rows: int) -> Implementation:
        """The implementation for a decode step of `rows` rows (measuring its bucket once)."""
        if self.forced is not None:
            return self.forced
        bucket = bucket_of(rows)
        if bucket is None or len(self.candidates) == 1:
            return self.candidates[0] if bucket is not None else DEFAULT
        choices = self.choices()
        if bucket not in choices:
            choices[bucket] = self._tune(bucket)
        return IMPLEMENTATIONS[choices[bucket]]

    def tune(self, rows: Iterable[int]) -> dict[int, str]:
        """Measure now every bucket the given row counts fall in (e.g. before a benchmark)."""
        for r in rows:
            self.implementation(r)
        return dict(sorted(self.choices().items()))

    def _tune(self, bucket: int) -> str:
        best: dict[str, float] = {}
        t0 = time.perf_counter()
        for _ in range(REPEATS):  # interleaved, so drift on a shared machine hits every side
            for impl in self.candidates:
                seconds = float(self._measure(impl, bucket))
                best[impl.name] = min(seconds, best.get(impl.name, float("inf")))
        choice = min(self.candidates, key=lambda impl: best[impl.name]).name
        log.info("decode matmuls for %d rows: %s (%s; measured once in %.1f s, kept in %s)",
                 bucket, choice, ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.items()),
                 time.perf_counter() - t0, self.store.path)
        record = {"choice": choice, "ms": {k: float(f"{v * 1e3:.6g}") for k, v in best.items()},
                  "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        self.store.save(self.key, self.signature, bucket, record)
        return choice

    @torch.inference_mode()
    def time_step(self, impl: Implementation, rows: int) -> float:
        """Seconds of one decode step's matmuls through `impl` at `rows` rows (wall time)."""
        gen = torch.Generator().manual_seed(rows)
        matrices = self.weights + ([] if self.head is None else [self.head])
        xs = {k: torch.randn(rows, k, generator=gen, dtype=self.weights[0].dtype)
              for k in {int(w.shape[1]) for w in matrices}}
        impl.linear(xs[int(self.weights[0].shape[1])], self.weights[0])  # compile / warm up
        t0 = time.perf_counter()
        for w in self.weights:
            impl.linear(xs[int(w.shape[1])], w)
        if self.head is not None:
            impl.head(xs[int(self.head.shape[1])], self.head)
        return time.perf_counter() - t0
