"""The shared-prefix training forward equals the plain padded forward, values and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama import modeling_llama

from appo.models import load_model
from appo.trainer.batch import pad_right
from appo.trainer.forward import (
    computed_tokens,
    final_hidden_states,
    plan_shared_microbatches,
    shared_prefix_length,
)


@pytest.fixture
def f64_norm(monkeypatch):
    # transformers' RMSNorm computes in float32 whatever the model dtype; in float64 the two
    # forwards would then differ by float32 rounding (~1e-6 relative) and hide real errors.
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


def _rows(prompt_len: int, suffixes: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(5, 250, (prompt_len,), generator=g).tolist()
    return [prompt + torch.randint(5, 250, (k,), generator=g).tolist() for k in suffixes]


def _t(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids `[B, T]` (padding -1: never a real token) and lengths `[B]`."""
    return pad_right(rows, -1, torch.long), torch.tensor([len(r) for r in rows])


def _hidden_and_grads(model, rows, share):
    model.zero_grad(set_to_none=True)
    ids, lengths = _t(rows)
    h = final_hidden_states(model, ids.clamp(min=0), lengths, share_prefix=share)
    # Row weights differ so a wrong sum over rows of the shared prefix's gradient shows.
    loss = sum((h[i, : len(r)] ** 2).sum() * (i + 1) for i, r in enumerate(rows))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [h[i, : len(r)].detach() for i, r in enumerate(rows)], grads


@pytest.mark.parametrize("suffixes", [(3, 9, 1, 14), (5, 5), (1, 30, 2)])
def test_shared_prefix_forward_equals_plain_forward(f64_norm, suffixes):
    lm = load_model("tiny-test", dtype="float64")
    model = lm.model.double().train()
    rows = _rows(40, suffixes)
    h_plain, g_plain = _hidden_and_grads(model, rows, share=False)
    h_shared, g_shared = _hidden_and_grads(model, rows, share=True)
    for a, b in zip(h_plain, h_shared, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)
    assert g_plain.keys() == g_shared.keys() and len(g_plain) > 0
    for name in g_plain:
        scale = g_plain[name].abs().max().item()
        assert (g_plain[name] - g_shared[name]).abs().max().item() <= 1e-10 * max(scale, 1.0), name


def test_identical_rows_still_have_a_suffix_token():
    # Identical rows: the shared part stops one token short so each row keeps a suffix.
    rows = [list(range(30))] * 3
    assert shared_prefix_length(*_t(rows)) == 29
    assert computed_tokens(*_t(rows)) == 29 + 3 * 1


def test_computed_tokens_hand_counts():
    rows = _rows(40, (3, 9, 1))  # lengths 43, 49, 41; shared prefix 40
    assert computed_tokens(*_t(rows)) == 40 + 3 * 9
    assert computed_tokens(*_t(rows), share_prefix=False) == 3 * 49
    # Prefix below the minimum worth sharing: plain cost.
    short = _rows(4, (3, 9))
    assert computed_tokens(*_t(short)) == 2 * 13


def test_plan_groups_rows_and_respects_the_budget():
    a = _rows(40, (3, 9, 1, 14), seed=1)
    b = _rows(50, (2, 2), seed=2)
    rows = [a[0], b[0], a[1], a[2], b[1], a[3]]
    groups = ["a", "b", "a", "a", "b", "a"]
    plan = plan_shared_microbatches(*_t(rows), 100, groups)
    # Group a first (first appearance), by length: 41, 43, 49, 54 -> cost 40 + 4*14 = 96.
    assert plan.batches == [[3, 0, 2, 5], [1, 4]]
    assert plan.padded_tokens == (40 + 4 * 14) + (50 + 2 * 2)
    assert plan.real_tokens == (40 + 1 + 3 + 9 + 14) + (50 + 2 + 2)
    assert plan.rows_tokens == sum(len(r) for r in rows)
    tight = plan_shared_microbatches(*_t(rows), 60, groups)
    for batch in tight.batches:
        sub = [rows[i] for i in batch]
        assert len(batch) == 1 or computed_tokens(*_t(sub)) <= 60
    assert sorted(i for bt in tight.batches for i in bt) == list(range(6))


def test_training_logprobs_are_at_the_rollout_temperature():
    """verl divides the training logits by the rollout temperature: logp of token a at T is
    log_softmax(z / T)[a] (docs/algorithms.md §4.7); T = 1 is the plain forward."""
    from test_trainer_rl import _fixed_rows

    from appo.trainer.update import batched_logprobs

    lm = load_model("tiny-test")
    rows = _fixed_rows(lm.tokenizer, n=3)
    with torch.no_grad():
        logits = lm.model(input_ids=rows.input_ids).logits.double()
    for temperature in (1.0, 0.6, 2.0):
        got = batched_logprobs(lm.model, rows, 4096, 128, temperature=temperature)
        for i in range(len(rows)):
            p, n = int(rows.prompt_lens[i]), int(rows.response_lens[i])
            targets = rows.input_ids[i, p : p + n]
            want = torch.log_softmax(logits[i, p - 1 : p + n - 1] / temperature, -1)
            want = want.gather(1, targets[:, None])[:, 0].float()
            torch.testing.assert_close(got[i, :n], want, atol=2e-5, rtol=1e-5)
