"""Chunked log-probs / entropies equal the direct computation, values and gradients."""

from __future__ import annotations

import pytest
import torch

from appo.algos import (
    logprobs_and_entropy_direct,
    logprobs_and_entropy_from_logits,
    token_logprobs_and_entropy,
)
from appo.errors import AppoError


def head_inputs(seed=0, batch=3, length=9, dim=8, vocab=50, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, dim, generator=gen, dtype=dtype).requires_grad_(True)
    weight = torch.randn(vocab, dim, generator=gen, dtype=dtype).requires_grad_(True)
    bias = torch.randn(vocab, generator=gen, dtype=dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (batch, length), generator=gen)
    # Random upstream gradients for the two outputs, as a loss would give.
    w_logp = torch.randn(batch, length, generator=gen, dtype=dtype)
    w_ent = torch.randn(batch, length, generator=gen, dtype=dtype)
    return hidden, weight, bias, targets, w_logp, w_ent


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_head_equals_direct_values_and_gradients(chunk, temperature):
    hidden, weight, bias, targets, w_logp, w_ent = head_inputs()
    logp, ent = token_logprobs_and_entropy(hidden, weight, targets, bias=bias, chunk_size=chunk,
                                           temperature=temperature, entropy_grad=True)
    grads = torch.autograd.grad((w_logp * logp).sum() + (w_ent * ent).sum(), (hidden, weight, bias))

    ref_logp, ref_ent = logprobs_and_entropy_direct(hidden @ weight.T + bias, targets,
                                                    temperature=temperature)
    ref_grads = torch.autograd.grad((w_logp * ref_logp).sum() + (w_ent * ref_ent).sum(),
                                    (hidden, weight, bias))
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)


def test_chunked_from_logits_slice_equals_direct_and_leaves_input_alone():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 10, 40, generator=gen, dtype=torch.float64).requires_grad_(True)
    targets = torch.randint(0, 40, (3, 9), generator=gen)
    w_logp, w_ent = torch.randn(3, 9, generator=gen, dtype=torch.float64), torch.randn(
        3, 9, generator=gen, dtype=torch.float64)
    before = logits.detach().clone()
    # logits[:, :-1] cannot be flattened to [N, V] without a copy: processed per row.
    logp, ent = logprobs_and_entropy_from_logits(logits[:, :-1], targets, chunk_size=4,
                                                 temperature=0.8, entropy_grad=True)
    (grad,) = torch.autograd.grad((w_logp * logp).sum() + (w_ent * ent).sum(), logits)
    ref_logp, ref_ent = logprobs_and_entropy_direct(logits[:, :-1], targets, temperature=0.8)
    (ref_grad,) = torch.autograd.grad((w_logp * ref_logp).sum() + (w_ent * ref_ent).sum(), logits)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(ent, ref_ent)
    torch.testing.assert_close(grad, ref_grad)
    assert torch.equal(logits.detach(), before)


def test_gradcheck_float64():
    hidden, weight, bias, targets, _, _ = head_inputs(batch=2, length=5, dim=4, vocab=7)

    def head(h, w, b):
        return token_logprobs_and_entropy(h, w, targets, bias=b, chunk_size=3, temperature=0.7,
                                          entropy_grad=True)

    assert torch.autograd.gradcheck(head, (hidden, weight, bias))
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)

    def from_logits(z):
        return logprobs_and_entropy_from_logits(z, targets, chunk_size=2, entropy_grad=True)

    assert torch.autograd.gradcheck(from_logits, (logits,))


def test_detached_entropy_and_logp_only_gradients():
    hidden, weight, _, targets, w_logp, _ = head_inputs(seed=2)
    logp, ent = token_logprobs_and_entropy(hidden, weight, targets, chunk_size=5)
    assert not ent.requires_grad and logp.requires_grad
    grads = torch.autograd.grad((w_logp * logp).sum(), (hidden, weight))
    ref_logp, _ = logprobs_and_entropy_direct(hidden @ weight.T, targets)
    ref_grads = torch.autograd.grad((w_logp * ref_logp).sum(), (hidden, weight))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r)
    logp_only, none = token_logprobs_and_entropy(hidden, weight, targets, with_entropy=False)
    assert none is None
    torch.testing.assert_close(logp_only, logp)
    # Gradient of the entropy alone (AEPO entropy bonus) also flows.
    _, ent = token_logprobs_and_entropy(hidden, weight, targets, chunk_size=5, entropy_grad=True)
    (g_ent,) = torch.autograd.grad(ent.sum(), hidden)
    (ref_g_ent,) = torch.autograd.grad(logprobs_and_entropy_direct(hidden @ weight.T, targets)[1]
                                       .sum(), hidden)
    torch.testing.assert_close(g_ent, ref_g_ent)


def test_head_path_never_saves_a_vocabulary_sized_tensor():
    hidden, weight, _, targets, _, _ = head_inputs(batch=4, length=16, dim=8, vocab=64,
                                                   dtype=torch.float32)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = token_logprobs_and_entropy(hidden, weight, targets, chunk_size=8,
                                               entropy_grad=True)
    n_positions = hidden.shape[0] * hidden.shape[1]
    # Saved for backward: hidden [N, D], weight [V, D], targets / lse / entropy [N].
    assert max(saved) <= max(hidden.numel(), weight.numel())
    assert all(n < n_positions * weight.shape[0] for n in saved)
    (logp.sum() + ent.sum()).backward()


def test_bf16_head_is_close_to_float32():
    hidden, weight, _, targets, _, _ = head_inputs(dtype=torch.float32)
    logp, ent = token_logprobs_and_entropy(hidden.detach().bfloat16(), weight.detach().bfloat16(),
                                           targets)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_logp, ref_ent = logprobs_and_entropy_direct(hidden.detach() @ weight.detach().T, targets)
    torch.testing.assert_close(logp, ref_logp, atol=0.3, rtol=0.05)
    torch.testing.assert_close(ent, ref_ent, atol=0.1, rtol=0.05)


def test_bad_inputs_are_reported():
    hidden, weight, _, targets, _, _ = head_inputs()
    with pytest.raises(AppoError, match="token ids must be in"):
        token_logprobs_and_entropy(hidden, weight, targets.clone().fill_(-100))
    with pytest.raises(AppoError, match="does not match"):
        token_logprobs_and_entropy(hidden, weight, targets[:, :-1])
    with pytest.raises(AppoError, match="do not match"):
        token_logprobs_and_entropy(hidden, weight.T, targets)
    with pytest.raises(AppoError, match="logprob_chunk_size"):
        logprobs_and_entropy_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long),
                                         chunk_size=0)
