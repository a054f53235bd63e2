"""oneDNN's GEMM, the one inside torch (`torch.ops.mkldnn`), on weights packed once: a decode
step's matmuls as a library GEMM where it beats appo's numba kernels.

A decode step multiplies a few rows by every weight matrix; at these shapes the time is
reading the weights. oneDNN reads a weight reordered into its own blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's CPU weight-prepacking pass
uses) faster than MKL's plain `sgemm` and, on AVX-512 CPUs, faster than the numba kernels
(`benchmarks/RESULTS.md`, "CPU decode matmuls"). vLLM's CPU backend does the same with its
own oneDNN build.

The packed copy is made on a weight's first use and whenever its storage or version counter
changes (an optimizer step, a weight sync), kept while the weight lives (`cache.per_tensor`)
and freed by `drop`. Its layout is chosen for `PACK_ROWS` rows and used at every row count,
so a given row count always runs the same kernel: results depend on the machine, the
thread count and the row count, never on what ran before (one layout per weight). float32
only; anything else goes to `F.linear`.

Packed copies that keep serving decode steps are moved onto 2 MB transparent huge pages
(`appo.rollout.cpu.hugepages`: registered by `pack`, moved by its `decode_step`).

`linear_bf16` is the low-precision option (`rollout.cpu_weights=bfloat16`): the weight
packed as bfloat16 (half the bytes a decode step reads), the input rounded to bfloat16,
oneDNN's bf16 kernels (`vdpbf16ps`: float32 accumulation), the output rounded to bfloat16
by oneDNN and handed back as float32. Only where the CPU has bf16 dot-product instructions
(`bf16_available`: `avx512_bf16` or AMX); elsewhere oneDNN would emulate them, slower than
float32. Its log-probs differ from a float32 forward's (`benchmarks/RESULTS.md`).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from appo.rollout.cpu import hugepages
from appo.rollout.cpu.cache import per_tensor
from appo.rollout.cpu.cpuinfo import cpu_info

# The row count the packed layout is chosen for. oneDNN picks its blocking from it: packed
# for 1 row, 8-32 rows ran 1.5-1.8x slower than packed for 32 (Zen 5); packed for 8, 32 or
# 128, 1-256 rows ran within a few percent of each other.
PACK_ROWS = 32

_packed: dict[int, tuple] = {}
_packed_bf16: dict[int, tuple] = {}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def available() -> bool:
    """Whether this torch build has oneDNN and the packed linear ops."""
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._linear_pointwise is not None
                    and torch.ops.mkldnn._reorder_linear_weight is not None)
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def bf16_available() -> bool:
    """Whether `linear_bf16` runs natively here: oneDNN with bf16 support in this torch
    and a CPU with bf16 dot-product instructions."""
    try:
        supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
    return available() and supported and any(f in cpu_info()["flags"] for f in BF16_FLAGS)


def _bytes_of(packed: Tensor) -> tuple[int, int] | None:
    """(address, size) of a oneDNN tensor's memory; None for another tensor or a torch
    without the ops that tell."""
    if packed.layout != torch._mkldnn:
        return None
    try:
        return torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed)
    except (AttributeError, RuntimeError):
        return None


def huge_pages(packed: Tensor) -> bool:
    """Back a packed weight's memory with 2 MB pages, now (`hugepages.advise`); True where
    the kernel did, False for a tensor that is not oneDNN's."""
    where = _bytes_of(packed)
    return where is not None and hugepages.advise(*where)


def pack(weight: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """A packed copy of `weight` `[N, K]` (as `dtype`) that `linear` (float32) or
    `linear_bf16` (bfloat16) takes as its weight (a oneDNN tensor, `layout=torch._mkldnn`):
    `packed`'s cached copies, or a caller's that keeps the packed copy instead of the dense
    one (the lean decoder's concatenated QKV and gate/up under an all-oneDNN rule)."""
    with torch.no_grad():
        dense = weight.detach().to(dtype).contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(dense, PACK_ROWS)
    where = _bytes_of(packed)
    if where is not None:  # else a torch that cannot tell: the copy stays on 4 KB pages
        hugepages.track(packed, *where)
    return packed


def _cached(store: dict, weight: Tensor, dtype: torch.dtype) -> Tensor:
    """`weight` `[N, K]` packed as `dtype`, made on first use and remade when the tensor's
    storage or version counter has changed (a weight already packed: itself)."""
    if weight.layout == torch._mkldnn:
        return weight
    # Inference-mode tensors keep no version counter; they are remade, not updated.
    version = -1 if weight.is_inference() else weight._version
    return per_tensor(store, weight, (weight.data_ptr(), version), lambda w: pack(w, dtype))


def packed(weight: Tensor) -> Tensor:
    """`weight` in oneDNN's float32 layout (see `_cached`)."""
    return _cached(_packed, weight, torch.float32)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` `[..., K] -> [..., N]` through oneDNN on the packed
    weight (float32 on CPU; otherwise `F.linear` itself)."""
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or not available()):
        if weight.layout == torch._mkldnn:  # packed by `pack`: back to a dense tensor
            weight = weight.to_dense()
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    y = torch.ops.mkldnn._linear_pointwise(rows, packed(weight),
                                           None if bias is None else bias.detach(),
                                           "none", [None], "")
    return y.reshape(*x.shape[:-1], weight.shape[0])


def numpy_linear(x: np.ndarray, weight: Tensor, bias: Tensor | None = None) -> np.ndarray:
    """`linear` on a `[M, K]` numpy array, returning a numpy array (the fused decode step
    keeps its activations in numpy). The decode step's case (float32 rows, a float32 CPU
    weight) calls the op directly: `linear`'s checks and reshapes, ~120 calls a step,
    were a few percent of an 8-row step."""
    if (x.dtype == np.float32 and x.ndim == 2 and x.flags.c_contiguous
            and weight.dtype == torch.float32 and weight.device.type == "cpu" and available()):
        return torch.ops.mkldnn._linear_pointwise(
            torch.from_numpy(x), packed(weight), None if bias is None else bias.detach(),
            "none", [None], "").numpy()
    return linear(torch.from_numpy(np.ascontiguousarray(x)), weight, bias).numpy()


def linear_op():
    """The op `numpy_linear` calls, `(x, packed, bias, "none", [None], "") -> y`, its
    overload resolved once (for callers that call it ~100 times a step on arrays they made
    themselves); None without oneDNN."""
    return torch.ops.mkldnn._linear_pointwise.default if available() else None


def linear_bf16(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """`F.linear(x, weight, bias)` `[..., K] -> [..., N]` for a float32 `x` on CPU, through
    oneDNN's bf16 kernels on `weight` packed as bfloat16 (see module docstring): float32
    in and out, bfloat16 inside. Other dtypes or devices: `F.linear` itself."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        if weight.layout == torch._mkldnn:
            weight = weight.to_dense().to(x.dtype)
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    w = _cached(_packed_bf16, weight, torch.bfloat16)
    y = torch.ops.mkldnn._linear_pointwise(rows, w, None, "none", [None], "").float()
    if bias is not None:
        y += bias.detach()
    return y.reshape(*x.shape[:-1], weight.shape[0])


def numpy_linear_bf16(x: np.ndarray, weight: Tensor, bias: Tensor | None = None) -> np.ndarray:
    """`linear_bf16` on a `[M, K]` float32 numpy array, returning float32 numpy."""
    return linear_bf16(torch.from_numpy(np.ascontiguousarray(x)), weight, bias).numpy()


def drop() -> None:
    """Free every packed copy (an engine dropping its weight copies before an update)."""
    _packed.clear()
    _packed_bf16.clear()
