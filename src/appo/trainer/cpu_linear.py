"""The training forward's and backward's linear layers through oneDNN on CPUs where MKL is
slow: `actor.cpu_matmul`.

torch's CPU GEMM for float32 is MKL's, and on AMD CPUs MKL runs its AVX2 kernels even where
the CPU has AVX-512: on a Zen 5 the update's GEMMs reached ~180-190 GFLOP/s on 2 cores,
where oneDNN, the other GEMM library inside torch (`torch.ops.mkldnn`), picks its kernels by
instruction set and ran the same shapes 2.2-2.3x faster (`benchmarks/RESULTS.md`). Inside
`onednn_linears(model)` every plain `nn.Linear` of the model computes its forward and both
backward products through oneDNN (`_OneDNNLinear`): `y = x W^T + b`, `dx = dy W`,
`dW = dy^T x`, `db = sum dy`; the same products, another summation order. Gradient
checkpointing's recomputation runs inside the block too, so it recomputes the same values.

`actor.cpu_matmul`: `auto` (the default) uses it where the decode rule does (an AMD CPU with
AVX-512, float32, CPU: `uses_onednn`), `torch` never, `onednn` wherever oneDNN is
available. Inside the block `matmul_nt` runs through oneDNN as well: the lean SwiGLU's
down projection computes its products there, outside its `nn.Linear`. Not under FSDP (its
sharded parameters' hooks wrap the modules' forwards). It covers the RL update and its
no-grad log-prob passes, SFT (`appo sft`, the demo's cold start) and the critic's values
and update (`appo.trainer.critic`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor


def _mm(a: Tensor, b: Tensor) -> Tensor:
    """`a @ b^T` (`[M, K] x [N, K] -> [M, N]`) through oneDNN, both operands contiguous."""
    return torch.ops.mkldnn._linear_pointwise(a.contiguous(), b.contiguous(), None, "none",
                                              [None], "")


# How many `onednn_linears` blocks are open: inside one, `matmul_nt` (the products that
# custom autograd functions compute outside any `nn.Linear`) runs through oneDNN too.
_open = 0


def matmul_nt(a: Tensor, b: Tensor) -> Tensor:
    """`a @ b^T` (`[M, K] x [N, K] -> [M, N]`): through oneDNN inside an `onednn_linears`
    block for float32 CPU operands, else torch's `a @ b.t()`. For the products of custom
    autograd functions that bypass the linear modules (the lean SwiGLU's down projection,
    `appo.trainer.memory._SwiGLUDown`)."""
    if _open and a.dtype == b.dtype == torch.float32 and a.device.type == b.device.type == "cpu":
        return _mm(a, b)
    return a @ b.t()


class _OneDNNLinear(torch.autograd.Function):
    """`F.linear` for float32 CPU tensors, its three products through oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = _mm(rows, weight)
        if bias is not None:
            y += bias
        ctx.save_for_backward(rows, weight)
        ctx.has_bias, ctx.in_shape = bias is not None, x.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        rows, weight = ctx.saved_tensors
        dy = grad.reshape(-1, grad.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _mm(dy, weight.t()).reshape(ctx.in_shape)  # dy [M, N] @ W [N, K]
        if ctx.needs_input_grad[1]:
            dw = _mm(dy.t(), rows.t())  # dy^T [N, M] @ x [M, K]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db


def available() -> bool:
    from appo.rollout.cpu import onednn

    return onednn.available()


def _amd_avx512() -> bool:
    """An AMD CPU with AVX-512, as numba targets it (`cpuinfo.target_flags`: numba-free,
    unlike the decode rule's check, so deciding before a vLLM engine starts imports no
    numba; under `avx2_environment` an AVX-512 machine counts as an AVX2 one here too)."""
    from appo.rollout.cpu.cpuinfo import cpu_info, target_flags

    return cpu_info()["vendor"] == "AuthenticAMD" and "avx512f" in target_flags()


def uses_onednn(choice: str, device: torch.device, dtype: torch.dtype, fsdp: bool) -> bool:
    """Whether `actor.cpu_matmul=choice` routes this run's training linears through oneDNN:
    `auto` on an AMD CPU with AVX-512 and at most 2 torch threads (where the decode rule
    uses oneDNN; more threads take MKL there too)."""
    if choice == "torch" or fsdp or device.type != "cpu" or dtype != torch.float32:
        return False
    if not available():
        return False
    if choice == "onednn":
        return True
    return _amd_avx512() and torch.get_num_threads() <= 2


def run_uses_onednn(cfg, model: torch.nn.Module, fsdp: bool = False) -> bool:
    """`uses_onednn` for a run of `model` under `cfg`: float32 master weights without
    autocast (`appo.trainer.precision`)."""
    from appo.trainer.precision import train_compute_dtype

    param = next(model.parameters())
    return train_compute_dtype(cfg) is None and uses_onednn(
        cfg.actor.cpu_matmul, param.device, param.dtype, fsdp)


@contextlib.contextmanager
def onednn_linears(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Inside: the model's plain `nn.Linear` layers run `_OneDNNLinear` on float32 CPU
    inputs (anything else: `F.linear`); outside: untouched."""
    if not enabled:
        yield
        return
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]

    def make(layer: torch.nn.Linear):
        def forward(x: Tensor) -> Tensor:
            w, b = layer.weight, layer.bias
            if x.dtype == w.dtype == torch.float32 and x.device.type == "cpu":
                return _OneDNNLinear.apply(x, w, b)
            return F.linear(x, w, b)
        return forward

    global _open
    for layer in layers:
        layer.forward = make(layer)
    _open += 1
    try:
        yield
    finally:
        _open -= 1
        for layer in layers:
            layer.__dict__.pop("forward", None)
