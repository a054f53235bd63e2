"""Token log-probs and full-vocabulary entropies, computed in chunks of positions.

For a vocabulary of 49k tokens, `[B, T, V]` float32 logits of one mini-batch are 768 MB at
B=8, T=512; the direct `log_softmax` + entropy needs 3-6 such tensors at once (measured in
benchmarks/algos.py). Here each chunk of `chunk_size` positions goes logits -> log-softmax
-> gathered log-prob and entropy, and only `[N]` vectors are kept. Backward recomputes the
chunk's logits and writes its gradient straight into the input's gradient (a custom autograd
function, i.e. activation checkpointing of the head), so:

- `token_logprobs_and_entropy(hidden, weight, targets)` -- from the final hidden states and
  the lm_head weight -- never materialises `[B, T, V]` at all, forward or backward;
- `logprobs_and_entropy_from_logits(logits, targets)` -- for models that return logits --
  adds nothing of size `[B, T, V]` beyond the logits and, in backward, their gradient.

Log-probs and entropies are float32 for float32/bf16/fp16 inputs (float64 for float64).
`temperature` divides the logits: use the rollout's sampling temperature so that log-probs
are comparable with `logp_rollout`.
Entropy is `H = -sum_v p_v log p_v`; `entropy_grad=True` makes it differentiable (AEPO /
entropy bonus), otherwise it is returned detached and backward skips its term.

Alignment is the caller's: `targets[..., t]` must be the token predicted from
`hidden[..., t, :]` (i.e. `hidden[:, :-1]` with `input_ids[:, 1:]`), and every target must
be a valid token id (put 0 at padding and mask the result).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from appo.errors import AppoError

__all__ = [
    "logprobs_and_entropy_direct",
    "logprobs_and_entropy_from_logits",
    "token_logprobs_and_entropy",
]


def _as_rows(x: Tensor) -> Tensor:
    """`[*, K]` -> `[R, S, K]` without copying: one row of all positions if `x` flattens to a
    view, else its own leading rows (e.g. a `logits[:, :-1]` slice)."""
    if x.dim() < 2:
        raise AppoError(f"expected a tensor [..., K], got shape {tuple(x.shape)}")
    try:
        return x.view(1, -1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-2], x.shape[-1]) if x.dim() > 2 else x.unsqueeze(0)


def _chunks(rows: int, length: int, size: int):
    for r in range(rows):
        for start in range(0, length, size):
            yield r, slice(start, min(start + size, length))


def _forward_chunk(z: Tensor, target: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """z `[n, V]` float32 logits (consumed in place) -> logp, lse, entropy `[n]`."""
    lse = torch.logsumexp(z, dim=-1)
    logp_all = z.sub_(lse[:, None])
    logp = logp_all.gather(-1, target[:, None]).squeeze(-1)
    if not with_entropy:
        return logp, lse, logp.new_zeros(0)
    entropy = -torch.linalg.vecdot(logp_all.exp(), logp_all)
    return logp, lse, entropy


def _grad_chunk(
    z: Tensor, target: Tensor, lse: Tensor, entropy: Tensor,
    grad_logp: Tensor | None, grad_entropy: Tensor | None,
) -> Tensor:
    """Gradient w.r.t. the chunk's (temperature-scaled) logits z `[n, V]` (consumed in place).

    d logp_y / dz = onehot(y) - p;   dH / dz = -p * (log p + H).
    """
    logp_all = z.sub_(lse[:, None])
    grad = logp_all.exp()
    if grad_entropy is not None:
        coef = logp_all.add_(entropy[:, None]).mul_(-grad_entropy[:, None])
        if grad_logp is not None:
            coef.sub_(grad_logp[:, None])
        grad.mul_(coef)
    else:
        grad.mul_(-grad_logp[:, None])  # type: ignore[index]
    if grad_logp is not None:
        grad.scatter_add_(-1, target[:, None], grad_logp[:, None])
    return grad


class _HeadLogProbs(torch.autograd.Function):
    """(hidden `[R, S, D]`, weight `[V, D]`, bias `[V]`|None, targets `[R, S]`) ->
    logp `[R, S]`, entropy `[R, S]` (or empty), recomputing logits per chunk in backward."""

    @staticmethod
    def forward(ctx: FunctionCtx, hidden: Tensor, weight: Tensor, bias: Tensor | None,
                targets: Tensor, chunk: int, inv_temp: float, with_entropy: bool,
                weight_grad_in_place: bool = False):
        rows, length, _ = hidden.shape
        # The weight itself (a leaf: a parameter, not a cast of one) when its gradient may
        # be added into its `.grad` directly (`_weight_grad_buffer`).
        ctx.grad_owner = weight if weight_grad_in_place and weight.is_leaf else None
        logp = hidden.new_empty(rows, length, dtype=_compute_dtype(hidden.dtype))
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_zeros(0)
        for r, s in _chunks(rows, length, chunk):
            z = _head_logits(hidden[r, s], weight, bias, inv_temp)
            lp, ls, ent = _forward_chunk(z, targets[r, s], with_entropy)
            logp[r, s], lse[r, s] = lp, ls
            if with_entropy:
                entropy[r, s] = ent
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.chunk, ctx.inv_temp = chunk, inv_temp
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None, None, None
        grad_h = torch.zeros_like(hidden) if need_h else None
        acc = _compute_dtype(weight.dtype)
        into = _weight_grad_buffer(ctx.grad_owner, acc) if need_w else None
        grad_w = into if into is not None else (
            torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None)
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        rows, length, _ = hidden.shape
        for r, s in _chunks(rows, length, ctx.chunk):
            z = _head_logits(hidden[r, s], weight, bias, ctx.inv_temp)
            grad_z = _grad_chunk(
                z, targets[r, s], lse[r, s], entropy[r, s] if entropy.numel() else entropy,
                None if grad_logp is None else grad_logp[r, s],
                None if grad_entropy is None else grad_entropy[r, s],
            ).mul_(ctx.inv_temp)
            if grad_h is not None:
                grad_h[r, s] = grad_z.to(weight.dtype) @ weight
            if grad_w is not None:
                grad_w.addmm_(grad_z.T, hidden[r, s].to(acc))
            if grad_b is not None:
                grad_b += grad_z.sum(0)
        # Added into the weight's .grad already: nothing for autograd.
        grad_w = grad_w.to(weight.dtype) if grad_w is not None and into is None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def _weight_grad_buffer(weight: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """`weight.grad` when the head's weight gradient can be accumulated into it in place: an
    allocated dense gradient of the accumulation dtype that is not itself part of a graph.
    Else None (the gradient is returned to autograd as usual)."""
    grad = None if weight is None else weight.grad
    if (grad is None or grad.layout != torch.strided or grad.dtype != dtype
            or grad.requires_grad or grad.shape != weight.shape):
        return None
    return grad


def _head_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, inv_temp: float) -> Tensor:
    z = hidden @ weight.T
    if bias is not None:
        z = z + bias
    dtype = _compute_dtype(z.dtype)
    return z.to(dtype).mul_(inv_temp) if z.dtype != dtype else z.mul_(inv_temp)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _LogitsLogProbs(torch.autograd.Function):
    """(logits `[R, S, V]`, targets `[R, S]`) -> logp, entropy `[R, S]`, chunked both ways."""

    @staticmethod
    def forward(ctx: FunctionCtx, logits: Tensor, targets: Tensor, chunk: int, inv_temp: float,
                with_entropy: bool):
        rows, length, _ = logits.shape
        logp = logits.new_empty(rows, length, dtype=_compute_dtype(logits.dtype))
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_zeros(0)
        for r, s in _chunks(rows, length, chunk):
            # A fresh copy: the in-place softmax below must not touch the input.
            z = logits[r, s].to(logp.dtype) * inv_temp
            lp, ls, ent = _forward_chunk(z, targets[r, s], with_entropy)
            logp[r, s], lse[r, s] = lp, ls
            if with_entropy:
                entropy[r, s] = ent
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.chunk, ctx.inv_temp = chunk, inv_temp
        ctx.set_materialize_grads(False)
        if not with_entropy:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_logp: Tensor | None, grad_entropy: Tensor | None):
        logits, targets, lse, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None
        grad_logits = torch.empty_like(logits)
        rows, length, _ = logits.shape
        for r, s in _chunks(rows, length, ctx.chunk):
            z = logits[r, s].to(lse.dtype) * ctx.inv_temp
            grad_z = _grad_chunk(
                z, targets[r, s], lse[r, s], entropy[r, s] if entropy.numel() else entropy,
                None if grad_logp is None else grad_logp[r, s],
                None if grad_entropy is None else grad_entropy[r, s],
            )
            grad_logits[r, s] = grad_z.mul_(ctx.inv_temp)
        return grad_logits, None, None, None, None


def _check_common(targets: Tensor, lead_shape: torch.Size, vocab: int, chunk_size: int,
                  temperature: float) -> None:
    if targets.shape != lead_shape:
        raise AppoError(f"targets shape {tuple(targets.shape)} does not match the leading "
                        f"dims {tuple(lead_shape)} of hidden states / logits")
    if targets.dtype.is_floating_point:
        raise AppoError(f"targets must be integer token ids, got {targets.dtype}")
    if chunk_size < 1:
        raise AppoError(f"actor.logprob_chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise AppoError(f"temperature must be > 0, got {temperature}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab):
        raise AppoError(f"target token ids must be in [0, {vocab}); got range "
                        f"[{int(targets.min())}, {int(targets.max())}] (use 0 at padding)")


def _finish(logp: Tensor, entropy: Tensor, lead_shape: torch.Size, with_entropy: bool,
            entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
    logp = logp.reshape(lead_shape)
    if not with_entropy:
        return logp, None
    entropy = entropy.reshape(lead_shape)
    return logp, entropy if entropy_grad else entropy.detach()


def token_logprobs_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 128,
    with_entropy: bool = True,
    entropy_grad: bool = False,
    weight_grad_in_place: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each target and the entropy at each position, from hidden states.

    hidden `[*, D]` (e.g. `[B, T, D]`), weight `[V, D]` (lm_head), bias `[V]` or None,
    targets `[*]` long -> logp `[*]` float32, entropy `[*]` float32 (None if
    `with_entropy=False`). `chunk_size` positions per chunk (`actor.logprob_chunk_size`).
    Gradients flow to hidden, weight and bias; `[*, V]` logits exist one chunk at a time.

    `weight_grad_in_place`: when `weight` is a parameter whose `.grad` is allocated (dense,
    float32 or wider), the backward adds the weight's gradient into that `.grad` chunk by
    chunk and hands autograd none, so no `[V, D]` gradient tensor exists. With an LM head
    tied to the input embeddings autograd would otherwise hold that tensor through the whole
    backward, until the embedding's gradient arrives to be summed with it. The caller must
    not rely on hooks seeing this part of the gradient (appo's update reads `.grad` after
    the backward). Otherwise the usual path.
    """
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise AppoError(f"hidden [..., D] and weight [V, D] do not match: "
                        f"{tuple(hidden.shape)} vs {tuple(weight.shape)}")
    lead_shape = hidden.shape[:-1]
    _check_common(targets, lead_shape, weight.shape[0], chunk_size, temperature)
    rows = _as_rows(hidden)
    row_targets = targets.reshape(rows.shape[:2])
    logp, entropy = _HeadLogProbs.apply(rows, weight, bias, row_targets, chunk_size,
                                        1.0 / temperature, with_entropy, weight_grad_in_place)
    return _finish(logp, entropy, lead_shape, with_entropy, entropy_grad)


def logprobs_and_entropy_from_logits(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 128,
    with_entropy: bool = True,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Chunked log-probs and entropies from logits `[*, V]`, targets `[*]` -> `[*]`, `[*]`.

    A slice such as `logits[:, :-1]` is processed in place, not copied.
    """
    lead_shape = logits.shape[:-1]
    _check_common(targets, lead_shape, logits.shape[-1], chunk_size, temperature)
    rows = _as_rows(logits)
    row_targets = targets.reshape(rows.shape[:2])
    logp, entropy = _LogitsLogProbs.apply(rows, row_targets, chunk_size, 1.0 / temperature,
                                          with_entropy)
    return _finish(logp, entropy, lead_shape, with_entropy, entropy_grad)


def logprobs_and_entropy_direct(
    logits: Tensor, targets: Tensor, *, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Reference implementation (materialises `[*, V]` log-softmax and probabilities): the
    baseline the chunked paths are tested and benchmarked against. Entropy differentiable."""
    logp_all = torch.log_softmax(logits.to(_compute_dtype(logits.dtype)) / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
