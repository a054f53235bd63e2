"""SFT on tiny-test: learns, masks what it should, accumulation-invariant."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from appo.config import SFTConfig
from appo.models import load_model
from appo.trainer.sft import (
    evaluate_loss,
    masked_token_loss_sum,
    token_micro_batches,
    train_sft,
)


@dataclass
class Ex:
    input_ids: list[int]
    loss_mask: list[int]


def _examples(tok, n=8):
    out = []
    for i in range(n):
        prompt = tok.encode(f"<|im_start|>user\nq{i}<|im_end|>\n<|im_start|>assistant\n",
                            add_special_tokens=False)
        answer = tok.encode("<answer>42</answer><|im_end|>", add_special_tokens=False)
        out.append(Ex(prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    return out


def test_loss_counts_only_masked_targets():
    lm = load_model("tiny-test")
    ex = _examples(lm.tokenizer, 1)[0]
    pad = lm.tokenizer.pad_token_id
    base, n = masked_token_loss_sum(lm.model, [ex], pad)
    assert n == sum(ex.loss_mask[1:])
    # The same sum from full logits: -log softmax at each masked target.
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor([ex.input_ids])).logits[0, :-1].float()
    nll = -torch.log_softmax(logits, -1).gather(1, torch.tensor(ex.input_ids[1:])[:, None])[:, 0]
    expected = (nll * torch.tensor(ex.loss_mask[1:], dtype=torch.float32)).sum()
    assert abs(float(base.detach()) - float(expected)) < 1e-4 * float(expected)
    # With every target masked the loss is exactly zero; with the answer unmasked it is not.
    zero, n0 = masked_token_loss_sum(lm.model, [Ex(ex.input_ids, [0] * len(ex.loss_mask))], pad)
    assert float(zero.detach()) == 0.0 and n0 == 0 and float(base.detach()) > 0


def test_sft_learns_and_checkpoints(tmp_path):
    lm = load_model("tiny-test")
    train = _examples(lm.tokenizer)
    before = evaluate_loss(lm.model, train, lm.tokenizer.pad_token_id)
    params = SFTConfig(epochs=30, batch_size=4, lr=3e-3, warmup_ratio=0.0,
                       output_dir=str(tmp_path))
    res = train_sft(lm.model, lm.tokenizer, train, params, seed=0, val=train, progress=False)
    assert res.steps == 60
    assert res.eval_loss < 0.3 * before
    # The last step's gradients are freed (they would sit through the next stage).
    assert all(p.grad is None for p in lm.model.parameters())
    assert (res.checkpoint / "config.json").is_file()
    reloaded = load_model(str(res.checkpoint))
    assert abs(evaluate_loss(reloaded.model, train, lm.tokenizer.pad_token_id) - res.eval_loss) < 1e-5


def test_gradient_accumulation_equals_one_big_batch(tmp_path):
    lm = load_model("tiny-test")
    train = _examples(lm.tokenizer, 4)
    # Unequal lengths so per-micro-batch token counts differ: a naive mean-of-means would not match.
    train[0] = Ex(train[0].input_ids + train[0].input_ids[-6:], train[0].loss_mask + [1] * 6)
    a, b = copy.deepcopy(lm.model), copy.deepcopy(lm.model)
    common = dict(epochs=1, lr=1e-2, warmup_ratio=0.0, grad_clip=1e9)
    ra = train_sft(a, lm.tokenizer, train,
                   SFTConfig(batch_size=4, output_dir=str(tmp_path / "a"), **common), seed=0,
                   progress=False)
    rb = train_sft(b, lm.tokenizer, train,
                   SFTConfig(batch_size=1, gradient_accumulation_steps=4,
                             output_dir=str(tmp_path / "b"), **common),
                   seed=0, progress=False)
    # The gradient norm is scale-sensitive (Adam's first step is not): a per-micro-batch
    # mean would give a different norm here because the rows have different token counts.
    assert ra.grad_norms[0] == pytest.approx(rb.grad_norms[0], rel=1e-5)
    assert ra.train_loss[0] == pytest.approx(rb.train_loss[0], rel=1e-5)
    # (Parameters are not compared: Adam's first step is ~lr*sign(g), so float noise on
    # near-zero gradients flips signs and hides nothing the norm check does not catch.)


def test_token_micro_batches_keep_order_and_the_budget():
    rows = [Ex([0] * n, [1] * n) for n in (5, 4, 3, 9, 2, 2)]
    lengths = [[len(r.input_ids) for r in mb] for mb in token_micro_batches(rows, 9)]
    # 5+4 = 9 fits; 3 (+9 would be 12) alone; 9 alone; 2+2
    assert lengths == [[5, 4], [3], [9], [2, 2]]
    assert [[len(r.input_ids) for r in mb] for mb in token_micro_batches(rows, 4)] == \
        [[5], [4], [3], [9], [2, 2]]  # a row over the budget goes alone
    assert token_micro_batches(rows, None) == [rows]


def test_token_budget_micro_batches_equal_the_whole_batch(tmp_path):
    """`sft.max_tokens_per_micro_batch`: the batch in token-bounded pieces gives the whole
    batch's loss and gradient norm (the loss is normalised by the step's tokens either way)."""
    lm = load_model("tiny-test")
    train = _examples(lm.tokenizer, 4)
    train[0] = Ex(train[0].input_ids + train[0].input_ids[-6:], train[0].loss_mask + [1] * 6)
    a, b = copy.deepcopy(lm.model), copy.deepcopy(lm.model)
    common = dict(epochs=1, lr=1e-2, warmup_ratio=0.0, grad_clip=1e9, batch_size=4)
    budget = len(train[0].input_ids) + len(train[1].input_ids)
    assert len(token_micro_batches(train, budget)) == 2  # the rows are split
    ra = train_sft(a, lm.tokenizer, train, SFTConfig(output_dir=str(tmp_path / "a"), **common),
                   seed=0, progress=False)
    rb = train_sft(b, lm.tokenizer, train,
                   SFTConfig(output_dir=str(tmp_path / "b"), max_tokens_per_micro_batch=budget,
                             **common), seed=0, progress=False)
    assert ra.grad_norms[0] == pytest.approx(rb.grad_norms[0], rel=1e-5)
    assert ra.train_loss[0] == pytest.approx(rb.train_loss[0], rel=1e-5)


def test_bfloat16_loss_over_float32_masters_matches_the_bfloat16_model():
    """SFT under `model.dtype=bfloat16` (float32 masters, bfloat16 forwards): the loss is the
    bfloat16 model's up to bfloat16 rounding, and the gradient reaches the float32 weights."""
    lm = load_model("tiny-test")
    exs = _examples(lm.tokenizer, 3)
    pad = lm.tokenizer.pad_token_id
    mixed, n = masked_token_loss_sum(lm.model, exs, pad, compute_dtype=torch.bfloat16)
    bf16, _ = masked_token_loss_sum(copy.deepcopy(lm.model).to(torch.bfloat16), exs, pad)
    fp32, _ = masked_token_loss_sum(lm.model, exs, pad)
    assert abs(float(mixed.detach()) - float(bf16.detach())) < 0.02 * n
    assert float(mixed.detach()) != float(fp32.detach())  # computed in bfloat16
    mixed.backward()
    grads = [p.grad for p in lm.model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)


def test_sft_forward_runs_on_the_heap_under_except_forward(tmp_path, monkeypatch):
    """`trainer.mmap_threshold_scope=except_forward` covers SFT too: each forward runs with
    the heap's threshold, each backward with the small one."""
    from appo.trainer import memory

    class Libc:
        threshold = None

        def mallopt(self, param, value):
            self.threshold = value
            return 1

    libc = Libc()
    monkeypatch.setattr(memory, "_libc", lambda: libc)
    at_backward = []
    real_backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward",
                        lambda *a, **k: at_backward.append(libc.threshold)
                        or real_backward(*a, **k))
    assert memory.set_mmap_threshold(64, "except_forward")
    try:
        lm = load_model("tiny-test")
        at_forward = []
        lm.model.register_forward_pre_hook(
            lambda *_: at_forward.append(libc.threshold) if torch.is_grad_enabled() else None)
        params = SFTConfig(epochs=1, batch_size=2, lr=1e-3, warmup_ratio=0.0,
                           output_dir=str(tmp_path))
        train_sft(lm.model, lm.tokenizer, _examples(lm.tokenizer, 4), params, seed=0,
                  progress=False)
    finally:
        memory.set_mmap_threshold(None)
    assert at_backward == [64 * 1024] * 2 and at_forward == [memory.HEAP_MMAP_THRESHOLD] * 2

