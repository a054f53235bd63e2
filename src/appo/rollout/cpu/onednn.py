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
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from appo.rollout.cpu.cache import per_tensor

# The row count the packed layout is chosen for. oneDNN picks its blocking from it: packed
# for 1 row, 8-32 rows ran 1.5-1.8x slower than packed for 32 (Zen 5); packed for 8, 32 or
# 128, 1-256 rows ran within a few percent of each other.
PACK_ROWS = 32

_packed: dict[int, tuple] = {}


@functools.cache
def available() -> bool:
    """Whether this torch build has oneDNN and the packed linear ops."""
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._linear_pointwise is not None
                    and torch.ops.mkldnn._reorder_linear_weight is not None)
    except (AttributeError, RuntimeError):
        return False


def pack(weight: Tensor) -> Tensor:
    """A packed copy of `weight` `[N, K]` that `linear` takes as its weight (a oneDNN
    tensor, `layout=torch._mkldnn`): `packed`'s cached copies, or a caller's that keeps the
    packed copy instead of the dense one (the lean decoder's concatenated QKV and gate/up
    under an all-oneDNN rule)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def packed(weight: Tensor) -> Tensor:
    """`weight` `[N, K]` in oneDNN's layout, made on first use and remade when the tensor's
    storage or version counter has changed (a weight already packed: itself)."""
    if weight.layout == torch._mkldnn:
        return weight
    # Inference-mode tensors keep no version counter; they are remade, not updated.
    version = -1 if weight.is_inference() else weight._version
    return per_tensor(_packed, weight, (weight.data_ptr(), version), pack)


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
    keeps its activations in numpy)."""
    return linear(torch.from_numpy(np.ascontiguousarray(x)), weight, bias).numpy()


def drop() -> None:
    """Free every packed copy (an engine dropping its weight copies before an update)."""
    _packed.clear()
