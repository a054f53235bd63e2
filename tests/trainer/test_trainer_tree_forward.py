"""The tree-shared training forward equals the plain padded forward, values and gradients."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama import modeling_llama

from appo.models import load_model
from appo.trainer.batch import pad_right
from appo.trainer.forward import computed_tokens, final_hidden_states
from appo.trainer.tree_forward import CALL_TOKENS, tree_layout


@pytest.fixture
def f64_norm(monkeypatch):
    # transformers' RMSNorm computes in float32 whatever the model dtype; in float64 the two
    # forwards would then differ by float32 rounding and hide real errors.
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)


@pytest.fixture(scope="module")
def model64():
    return load_model("tiny-test", dtype="float64").model.double().train()


def _rand(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(5, 250, (n,), generator=g).tolist()


def _tree_rows(seed: int = 0) -> list[list[int]]:
    """Two prompt groups; in the first, branches at different depths (one a branch of a
    branch), a row identical to another, a row that is a prefix of another, a short root."""
    g = torch.Generator().manual_seed(seed)
    p = _rand(40, g)
    a = p + _rand(60, g)  # 100 tokens
    b = a[:50] + _rand(25, g)  # branch of a after 10 response tokens: 75
    c = a[:75] + _rand(12, g)  # branch of a after 35 response tokens: 87
    d = b[:65] + _rand(20, g)  # branch of b (depth 2): 85
    e = p + _rand(5, g)  # another root of the group, short: 45
    q = _rand(30, g)
    x, y = q + _rand(9, g), q + _rand(33, g)  # second group: 39, 63
    # Shuffled, so children come before their parents too.
    return [d, x, a, e, c, list(a), y, b, a[:70]]


def _t(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids `[B, T]` (padding 0) and lengths `[B]`."""
    return pad_right(rows, 0, torch.long), torch.tensor([len(r) for r in rows])


def _hidden_and_grads(model, rows, **mode):
    model.zero_grad(set_to_none=True)
    ids, lengths = _t(rows)
    h = final_hidden_states(model, ids, lengths, **mode)
    # Row weights differ so a wrong sum over rows of a shared token's gradient shows.
    loss = sum((h[i, : len(r)] ** 2).sum() * (i + 1) for i, r in enumerate(rows))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return [h[i, : len(r)].detach() for i, r in enumerate(rows)], grads


def _assert_same(model, rows):
    h_plain, g_plain = _hidden_and_grads(model, rows, share_prefix=False)
    h_tree, g_tree = _hidden_and_grads(model, rows, tree=True)
    for a, b in zip(h_plain, h_tree, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)
    assert g_plain.keys() == g_tree.keys() and len(g_plain) > 0
    for name in g_plain:
        scale = g_plain[name].abs().max().item()
        assert (g_plain[name] - g_tree[name]).abs().max().item() <= 1e-10 * max(scale, 1.0), name


def test_tree_forward_equals_plain_forward(f64_norm, model64):
    rows = _tree_rows()
    assert len(tree_layout(*_t(rows), 16).levels) >= 3  # several calls: a real tree
    _assert_same(model64, rows)


@pytest.mark.parametrize("case", ["no_sharing", "one_row", "identical", "prompt_only"])
def test_tree_forward_degenerate_cases(f64_norm, model64, case):
    g = torch.Generator().manual_seed(3)
    p = _rand(20, g)
    rows = {
        "no_sharing": [_rand(30, g), _rand(17, g), _rand(44, g)],
        "one_row": [_rand(30, g)],
        "identical": [p + _rand(10, g)] * 3,
        "prompt_only": [p + _rand(k, g) for k in (3, 9, 1)],
    }[case]
    _assert_same(model64, rows)


def test_layout_hand_counts():
    rows = _tree_rows()
    layout = tree_layout(*_t(rows), 16)
    # Row order d, x, a, e, c, a', y, b, a[:70]:
    # d: root, own 85 tokens (call 0). x: other group, root, 39 (call 0).
    # a: shares b's and d's first 50 (a[:50] == b[:50] == d[:50]) with d -> own 50 (call 1).
    # e: shares the 40-token prompt with d -> own 5 (call 1).
    # c: shares 75 with a -> own 12 (call 2, a lives in call 1).
    # a': identical to a -> nothing own. y: shares q (30) with x -> own 33 (call 1).
    # b: shares 65 with d (b[:65] == d[:65]) -> own 10 (call 1). a[:70]: prefix of a.
    assert layout.starts.tolist() == [0, 0, 50, 40, 75, 100, 30, 65, 70]
    # Level 1's own lengths 50, 33, 10, 5: one call 4 * 50 = 200 tokens; split after the
    # two longest 2 * 50 + 2 * 10 = 120 (+ CALL_TOKENS 64 = 184 < 200), so two calls.
    # Level 0 (85, 39): one call 170 < 85 + 39 + 64.
    assert CALL_TOKENS == 64
    assert [lv.rows for lv in layout.levels] == [[0, 1], [2, 6], [7, 3], [4]]
    assert [lv.width for lv in layout.levels] == [85, 50, 10, 12]
    assert layout.computed_tokens == 2 * 85 + 2 * 50 + 2 * 10 + 12
    assert computed_tokens(*_t(rows), tree=True) == layout.computed_tokens
    # Every row position maps to a token whose prefix is the row's prefix: same token id
    # at the same depth (checked on the token ids gathered back).
    flat = torch.zeros(layout.computed_tokens, dtype=torch.long)
    depth = torch.full((layout.computed_tokens,), -1)
    for i, r in enumerate(rows):
        idx = layout.token_index[i, : len(r)]
        assert (depth[idx][depth[idx] >= 0] == torch.arange(len(r))[depth[idx] >= 0]).all()
        flat[idx], depth[idx] = torch.tensor(r), torch.arange(len(r))
    for i, r in enumerate(rows):
        assert flat[layout.token_index[i, : len(r)]].tolist() == r


def _tree_batch(seed: int = 0):
    """`_tree_rows` as a `TrainBatch`: group u0 (prompt 40), u1 (prompt 30); one row with no
    trained token (an APPO branch row), advantages differing by row."""
    from appo.trainer.batch import TrainBatch

    rows = _tree_rows(seed)
    uids = ["u0", "u1", "u0", "u0", "u0", "u0", "u1", "u0", "u0"]
    prompt = [40 if u == "u0" else 30 for u in uids]
    masks = [[1.0] * (len(r) - p) for r, p in zip(rows, prompt, strict=True)]
    masks[4] = [0.0] * len(masks[4])
    masks[2][3:7] = [0.0] * 4  # a tool-result span
    adv = [[(-1.0) ** i * (1 + i / 4)] * len(m) for i, m in enumerate(masks)]
    n = len(rows)
    return TrainBatch(
        uids=uids, traj_ids=[f"t{i}" for i in range(n)], parent_ids=[None] * n,
        splits=[None] * n, input_ids=pad_right(rows, 0, torch.long),
        lengths=torch.tensor([len(r) for r in rows]), prompt_lens=torch.tensor(prompt),
        loss_mask=pad_right(masks, 0, torch.float32), rewards=torch.zeros(n),
        advantages=pad_right(adv, 0, torch.float32))


def test_tree_plan_respects_the_budget_and_saves_tokens():
    from appo.trainer.forward import plan_shared_microbatches

    b = _tree_batch()
    prefix = plan_shared_microbatches(b.input_ids, b.lengths, 100_000, b.uids)
    tree = plan_shared_microbatches(b.input_ids, b.lengths, 100_000, b.uids, tree=True)
    # Same grouping with a large budget; the tree computes fewer tokens than the prompt-only
    # sharing, and its distinct tokens are the trie's (hand count in test_layout_hand_counts
    # for this row set, here in the planner's group/length order).
    assert sorted(map(sorted, tree.batches)) == sorted(map(sorted, prefix.batches))
    assert tree.padded_tokens < prefix.padded_tokens
    trie = (40 + 60 + 25 + 12 + 20 + 5) + (30 + 9 + 33)  # prompts + own response tokens
    assert tree.real_tokens == trie
    for budget in (120, 200, 300):
        tight = plan_shared_microbatches(b.input_ids, b.lengths, budget, b.uids, tree=True)
        assert sorted(i for bt in tight.batches for i in bt) == list(range(len(b)))
        for bt in tight.batches:
            sub = b.select(bt)
            assert len(bt) == 1 or computed_tokens(sub.input_ids, sub.lengths, tree=True) <= budget


def test_tree_update_equals_plain_update_under_any_micro_batch_split(f64_norm):
    """One update step (SGD) with the tree forward, at budgets that split the tree across
    micro-batches or not, equals the plain forward's step: the loss normalisers are global."""
    from appo.config import ActorConfig
    from appo.trainer.update import batched_logprobs, update_policy

    batch = _tree_batch()
    params, logps = [], []
    for tree, budget in ((False, 100_000), (True, 100_000), (True, 200), (True, 90)):
        model = load_model("tiny-test", dtype="float64").model.double()
        actor = ActorConfig(ppo_mini_batch_size=16, ppo_max_token_len_per_device=budget,
                            share_prefix_forward=tree, tree_forward=tree,
                            loss_agg_mode="seq-mean-token-mean")
        logps.append(batched_logprobs(model, batch, budget, 128, tree, tree=tree))
        update_policy(model, torch.optim.SGD(model.parameters(), lr=0.5), batch, actor,
                      max_response_length=128)
        params.append([p.detach().clone() for p in model.parameters()])
    for other in logps[1:]:
        torch.testing.assert_close(other, logps[0], atol=1e-6, rtol=0)  # float32 output
    start = load_model("tiny-test", dtype="float64").model.double().parameters()
    moved = max((a - b).abs().max().item() for a, b in zip(params[0], start, strict=True))
    assert moved > 1e-4  # the step did something
    for other in params[1:]:
        for a, b in zip(params[0], other, strict=True):
            assert (a - b).abs().max().item() <= 1e-10
