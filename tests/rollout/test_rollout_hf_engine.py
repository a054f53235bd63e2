"""The hf engine on tiny-test: KV-cache reuse/forks are exact, counters, stops, sampling.

The reference for every cache test is one full forward pass over the row's final token ids
with no cache at all: the log-prob the engine recorded for each sampled token must equal
the full-forward log-prob of that token (float32, max abs diff < 1e-4).
"""

from __future__ import annotations

import pytest
import torch
from rollout_fakes import Recorder, full_logits

from appo.models import load_model
from appo.rollout.hf_engine import HFEngine
from appo.rollout.sampling import SamplingParams

TOL = 1e-4


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-test", device="cpu")


@pytest.mark.parametrize("lean", [True, False], ids=["lean-forward", "model-forward"])
def test_cache_reuse_forks_and_tool_rounds_match_full_forward(lm, lean):
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=3, lean_forward=lean)
    assert (eng._lean is not None) == lean
    rec = Recorder(eng)
    params = SamplingParams()
    # Prompts of very different lengths: heavy left padding in the shared batch.
    roots = [eng.add_row(tok.encode(t)) for t in ("A much longer prompt, with punctuation!",
                                                  "Hi", "Medium prompt")]
    rows = rec.fork(roots[0], 3) + rec.fork(roots[1], 2) + rec.fork(roots[2], 1)
    # Different budgets: rows stop at different steps, so compaction runs mid-loop.
    rec.decode(rows, [3, 17, 9, 25, 1, 12], params)
    # Tool round: forced results of different lengths on some rows, then branches.
    eng.append(rows[0], tok.encode(" <result>\n42\n</result>"))
    eng.append(rows[3], tok.encode(" <result>\na much longer tool result text\n</result>"))
    kids = rec.fork(rows[0], 2) + rec.fork(rows[3], 1)
    rec.decode(rows + kids, [10, 4, 7, 12, 6, 9, 11, 8, 5], params)
    # An appo-style fork from the middle of a finished row.
    mid = len(eng.row_ids(rows[1])) - 6
    [late] = rec.fork(rows[1], 1, at=mid)
    rec.decode([late, rows[2]], [15, 6], params)
    for r in rows + kids + [late]:
        assert rec.max_error(lm.model, r) < TOL, r


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=20),
        SamplingParams(temperature=0.9, top_p=0.8, top_k=50, repetition_penalty=1.3),
    ],
)
def test_recorded_logp_is_under_the_sampling_distribution(lm, params):
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=5)
    rec = Recorder(eng)
    root = eng.add_row(tok.encode("Sampling with processors"))
    rows = rec.fork(root, 3)
    rec.decode(rows, [20, 14, 8], params)
    eng.append(rows[0], tok.encode(" <result>\n7\n</result>"))
    rec.decode(rows, [6, 6, 6], params)
    for r in rows:
        assert rec.max_error(lm.model, r, params) < TOL


def test_sampled_tokens_lie_in_the_top_k_set(lm):
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=0)
    params = SamplingParams(temperature=1.0, top_k=3)
    rows = eng.fork(eng.add_row(tok.encode("top k")), 4)
    eng.decode(rows, [12] * 4, params)
    for r in rows:
        ids = eng.row_ids(r)
        logits = full_logits(lm.model, ids)
        for pos in range(len(ids) - 12, len(ids)):
            assert ids[pos] in torch.topk(logits[pos - 1], 3).indices.tolist()


def test_shared_prefill_and_counters(lm):
    tok = lm.tokenizer
    prompt = tok.encode("one shared prompt prefilled once")
    eng = HFEngine(lm.model, tok, seed=0)
    rows = eng.fork(eng.add_row(prompt), 5)
    eng.decode(rows, [4] * 5, SamplingParams())
    # The prompt is computed once for the group; the other 4 rows reuse it.
    assert eng.counters.prefilled == len(prompt)
    assert eng.counters.reused == 4 * len(prompt)
    # Each row: 4 sampled tokens, the first from the prefill's logits, 3 decode steps.
    assert eng.counters.decoded == 5 * 3
    # A tool result shared by a row and its branch is prefilled once for both.
    result = tok.encode(" <result>\nok\n</result>")
    eng.append(rows[0], result)
    kids = eng.fork(rows[0], 2)
    before = eng.counters.prefilled
    eng.decode([rows[0], *kids], [2] * 3, SamplingParams())
    # pending = last sampled token + result; one computation for the three rows
    assert eng.counters.prefilled - before == 1 + len(result)


@pytest.mark.parametrize("lean", [True, False], ids=["lean-forward", "model-forward"])
def test_different_prompts_share_their_common_prefix(lm, lean):
    tok = lm.tokenizer
    system = tok.encode("A system prompt that every question of the batch starts with. ")
    questions = [tok.encode(q) for q in ("What is 2+2?", "Name a colour, please.", "Hi")]
    eng = HFEngine(lm.model, tok, seed=1, lean_forward=lean)
    rec = Recorder(eng)
    roots = [eng.add_row(system + q) for q in questions]
    eng.prefill(roots)
    # The system prompt is computed once; each prompt adds only its question but the last
    # token (prefill leaves one pending token per row).
    assert eng.counters.prefilled == len(system) + sum(len(q) - 1 for q in questions)
    assert eng.counters.prefilled + eng.counters.reused == sum(
        len(system) + len(q) - 1 for q in questions)
    rows = [r for root in roots for r in rec.fork(root, 2)]
    rec.decode(rows, [6, 9, 3, 12, 7, 5], SamplingParams())
    for r in rows:
        assert rec.max_error(lm.model, r) < TOL, r
    # Rows without a prefill (decode directly) share the prefix the same way.
    eng2 = HFEngine(lm.model, tok, seed=1, lean_forward=lean)
    rec2 = Recorder(eng2)
    direct = [eng2.add_row(system + q) for q in questions]
    rec2.decode(direct, [5, 5, 5], SamplingParams())
    assert eng2.counters.prefilled == len(system) + sum(len(q) for q in questions)
    for r in direct:
        assert rec2.max_error(lm.model, r) < TOL, r


def test_no_reuse_mode_recomputes_every_context(lm):
    tok = lm.tokenizer
    prompt = tok.encode("baseline")
    eng = HFEngine(lm.model, tok, seed=0, reuse_cache=False)
    rec = Recorder(eng)
    rows = rec.fork(eng.add_row(prompt), 3)
    rec.decode(rows, [5] * 3, SamplingParams())
    assert eng.counters.prefilled == 3 * len(prompt)
    eng.append(rows[0], tok.encode(" <result>\nx\n</result>"))
    total = sum(len(eng.row_ids(r)) for r in rows)
    before = eng.counters.prefilled
    rec.decode(rows, [5] * 3, SamplingParams())
    assert eng.counters.prefilled - before == total
    for r in rows:
        assert rec.max_error(lm.model, r) < TOL


def test_eos_and_budget_finish(lm):
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=0)
    rows = eng.fork(eng.add_row(tok.encode("x")), 2)
    outs = eng.decode(rows, [0, 7], SamplingParams())
    assert outs[0].token_ids == [] and outs[0].finish == "length"
    assert len(outs[1].token_ids) <= 7
    if outs[1].finish == "length":
        assert len(outs[1].token_ids) == 7
    # EOS: bias the model so EOS is certain after the first token.
    eos = tok.eos_token_id

    class EosHead(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.weight = inner.weight

        def forward(self, h):
            out = self.inner(h).clone()
            out[..., eos] += 100.0
            return out

    head = lm.model.lm_head
    lm.model.lm_head = EosHead(head)
    try:
        eng2 = HFEngine(lm.model, tok, seed=0)
        [r] = eng2.fork(eng2.add_row(tok.encode("y")), 1)
        [out] = eng2.decode([r], [10], SamplingParams())
    finally:
        lm.model.lm_head = head
    assert out.token_ids == [eos] and out.finish == "eos"


def _two_token_stop(tok, ids: list[int]) -> tuple[int, str] | None:
    """An index i and the text of ids[i-1:i+1] usable as a 2-token stop string."""
    for i in range(3, len(ids)):
        text = tok.decode(ids[i - 1 : i + 1])
        if (len(text) == 2 and text.isascii() and text.isprintable() and not text.isspace()
                and text not in tok.decode(ids[:i])):
            return i, text
    return None


def test_engine_stops_on_a_multi_token_stop_string(lm):
    tok = lm.tokenizer
    prompt = tok.encode("Stop strings span several tokens.")
    params = SamplingParams(temperature=1.0)
    eng = HFEngine(lm.model, tok, seed=11)
    [r] = eng.fork(eng.add_row(prompt), 1)
    [out] = eng.decode([r], [200], params)
    found = _two_token_stop(tok, out.token_ids)
    assert found is not None, "sampled output of tiny-test has no printable 2-char pair"
    i, stop = found
    # Same seed, same single row: the same tokens, now cut at the stop string.
    eng2 = HFEngine(lm.model, tok, stop_strings=[stop], seed=11)
    [r2] = eng2.fork(eng2.add_row(prompt), 1)
    [o] = eng2.decode([r2], [200], params)
    assert o.finish == "stop" and o.stop_string == stop
    assert o.token_ids == out.token_ids[: i + 1]  # the completing token is kept


def test_stop_is_detected_only_in_the_current_segment(lm):
    """A closing tag inside the prompt or a tool result must not stop the next segment."""
    from appo.rollout.stops import StopChecker

    tok = lm.tokenizer
    checker = StopChecker(tok, ["</calc>"], frozenset({tok.eos_token_id}))
    ids = tok.encode("x = 1 </calc> tail")
    assert len(tok.encode("</calc>")) == 7  # byte-level: a 7-token stop string
    hits = [checker.check(ids[: k + 1]) for k in range(len(ids))]
    end = len(tok.encode("x = 1 </calc>")) - 1
    assert hits[end] == "</calc>"
    assert all(h is None for k, h in enumerate(hits) if k != end)
    assert checker.check(tok.encode(" after")) is None


def test_unwritten_cache_columns_are_never_read(lm, monkeypatch):
    """Fill every new cache buffer with NaN: a padding or unwritten column that reached the
    attention (even masked: 0 * NaN = NaN) would make the recorded log-probs NaN."""
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=9, capacity_chunk=8)  # small chunks: buffers grow
    original = eng._alloc

    def nan_alloc(rows, capacity):
        return original(rows, capacity).fill_(float("nan"))

    monkeypatch.setattr(eng, "_alloc", nan_alloc)
    rec = Recorder(eng)
    roots = [eng.add_row(tok.encode(t)) for t in ("a longer first prompt", "b")]
    eng.prefill(roots)
    rows = rec.fork(roots[0], 2) + rec.fork(roots[1], 2)
    rec.decode(rows, [3, 20, 11, 6], SamplingParams())
    eng.append(rows[1], tok.encode(" <result>\nnan check\n</result>"))
    kids = rec.fork(rows[1], 2)
    rec.decode(rows + kids, [9, 4, 13, 2, 7, 16], SamplingParams())
    for r in rows + kids:
        err = rec.max_error(lm.model, r)
        assert err == err and err < TOL  # not NaN, and exact


def test_engine_leaves_the_trainer_model_untouched_and_follows_weight_updates(lm):
    tok = lm.tokenizer
    model = lm.model
    eng = HFEngine(model, tok, seed=2, transpose_weights=True)
    rec = Recorder(eng)
    rows = rec.fork(eng.add_row(tok.encode("weights")), 2)
    rec.decode(rows, [5, 5], SamplingParams())
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears and all("forward" not in m.__dict__ for m in linears)
    # Gradients still reach the weights through the untouched modules.
    out = model(torch.tensor([eng.row_ids(rows[0])])).logits.sum()
    out.backward()
    assert linears[0].weight.grad is not None
    model.zero_grad()
    # An in-place update (as an optimizer step does) is seen by the next decode.
    target = model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        saved = target.weight.clone()
        target.weight.mul_(3.0)
    try:
        fresh = rec.fork(eng.add_row(tok.encode("after the update")), 1)
        rec.decode(fresh, [8], SamplingParams())
        assert rec.max_error(model, fresh[0]) < TOL  # matches the updated model
        with torch.no_grad():
            target.weight.copy_(saved)
        assert rec.max_error(model, fresh[0]) > 1e-3  # ...and not the old one
    finally:
        with torch.no_grad():
            target.weight.copy_(saved)


def test_lean_head_in_blocks_equals_one_product():
    # A vocabulary that is not a multiple of the block size: the last block is partial.
    from appo.rollout.lean import HEAD_BLOCK, LeanDecoder

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(2 * HEAD_BLOCK + 77, 48, generator=gen, dtype=torch.float64)
    for rows in (1, 3):
        x = torch.randn(rows, 48, generator=gen, dtype=torch.float64)
        got = LeanDecoder._head(x, weight)
        assert got.shape == (rows, weight.shape[0])
        torch.testing.assert_close(got, x @ weight.T, rtol=0, atol=1e-12)


def test_cascade_attention_over_a_shared_prefix_matches_full_forward(lm):
    # Rows share a prefix longer than MIN_CASCADE_PREFIX (a group's prompt, and under it a
    # second prompt with the same start), so decode attention reads the prefix once.
    from appo.rollout.hf_engine import MIN_CASCADE_PREFIX

    tok = lm.tokenizer
    system = tok.encode("You are a careful assistant. " * 12)
    assert len(system) > MIN_CASCADE_PREFIX
    prompts = [system + tok.encode(" Question one?"), system + tok.encode(" Two: what now")]
    runs = {}
    for cascade in (True, False):
        eng = HFEngine(lm.model, tok, seed=5, cascade_attention=cascade)
        used = []
        original = eng._forward

        def spy(*args, _orig=original, _used=used):
            _used.append(len(args) > 4 and args[4] is not None)
            return _orig(*args)

        eng._forward = spy
        rec = Recorder(eng)
        rows = rec.fork(eng.add_row(prompts[0]), 3) + rec.fork(eng.add_row(prompts[1]), 2)
        # Different budgets: rows leave the batch mid-loop (compaction keeps the prefix).
        rec.decode(rows, [6, 20, 11, 3, 16], SamplingParams())
        eng.append(rows[1], tok.encode(" <result>\n7\n</result>"))
        rec.decode(rows[1:3], [9, 5], SamplingParams())
        assert any(used) == cascade
        for r in rows:
            assert rec.max_error(lm.model, r) < TOL, r
        runs[cascade] = [eng.row_ids(r) for r in rows]
    assert runs[True] == runs[False]  # same seed, same tokens: only the arithmetic differs


def test_weight_first_linear_equals_f_linear():
    from appo.rollout.lean import _linear_weight_first

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(40, 24, generator=gen, dtype=torch.float64)
    bias = torch.randn(40, generator=gen, dtype=torch.float64)
    x = torch.randn(3, 1, 24, generator=gen, dtype=torch.float64)  # [B, steps, in]
    for b in (None, bias):
        got = _linear_weight_first(x, weight, b)
        assert got.shape == (3, 1, 40) and got.is_contiguous()
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b),
                                   rtol=0, atol=1e-12)


@pytest.mark.parametrize("wide", [False, True], ids=["row-at-a-time", "wide"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 12, 13])
def test_cpu_kernel_linear_equals_f_linear(rows, wide):
    # Row counts cover the row-at-a-time kernel's blocks of 8, of 4 and single rows and the
    # wide kernel's row pairs and odd last row; the weight height (37 = 4 x 8 + 5) leaves
    # a remainder after the wide kernel's blocks of 8 weight rows; K is not a multiple of
    # the SIMD lanes.
    pytest.importorskip("numba")
    from appo.rollout import cpu_kernels

    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(37, 29, generator=gen, dtype=torch.float64)
    bias = torch.randn(37, generator=gen, dtype=torch.float64)
    x = torch.randn(rows, 1, 29, generator=gen, dtype=torch.float64)
    for b in (None, bias):
        got = cpu_kernels.linear(x, weight, b, wide=wide)
        assert got.shape == (rows, 1, 37)
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b),
                                   rtol=0, atol=1e-12)
    # float32, the dtype the engine uses it for: equal up to summation order.
    w32, x32 = weight.float(), x.float()
    torch.testing.assert_close(cpu_kernels.linear(x32, w32, wide=wide), x32 @ w32.T,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("kernel", "wide"), [(True, True), (True, False), (False, False)],
                         ids=["numba-kernels-avx512", "numba-kernel-avx2", "torch-mm"])
def test_decode_steps_with_and_without_the_cpu_kernel_match_full_forward(lm, kernel, wide,
                                                                         monkeypatch):
    if kernel:
        pytest.importorskip("numba")
    from appo.rollout import cpu_kernels

    calls = []
    original = cpu_kernels.linear

    def spy(x, weight, bias=None):
        calls.append(x.shape[0])
        return original(x, weight, bias)

    monkeypatch.setattr(cpu_kernels, "linear", spy)
    # Either CPU's choice on any machine (the wide kernel is exact on AVX2 too, only
    # slower); a fixed row limit so 14 rows take torch.mm and the shrinking batch reaches
    # both the wide (> WIDE_MIN_ROWS) and the row-at-a-time kernel.
    monkeypatch.setattr(cpu_kernels, "wide_registers", lambda: wide)
    monkeypatch.setattr(cpu_kernels, "max_rows", lambda: 12)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel only runs at <= KERNEL_MAX_THREADS
    try:
        tok = lm.tokenizer
        eng = HFEngine(lm.model, tok, seed=4, cpu_kernel=kernel)
        rec = Recorder(eng)
        # 14 rows (over max_rows(): torch.mm) shrinking to a few (the kernels).
        rows = rec.fork(eng.add_row(tok.encode("kernel check")), 9) + rec.fork(
            eng.add_row(tok.encode("and another prompt")), 5)
        rec.decode(rows, [2, 4, 6, 8, 10, 12, 14, 3, 5, 7, 9, 11, 13, 15], SamplingParams())
        for r in rows:
            assert rec.max_error(lm.model, r) < TOL, r
    finally:
        torch.set_num_threads(threads)
    if kernel:
        assert calls and max(calls) <= 12
        assert max(calls) > cpu_kernels.WIDE_MIN_ROWS and min(calls) <= cpu_kernels.WIDE_MIN_ROWS
    else:
        assert not calls


@pytest.mark.parametrize("avx512", [True, False])
def test_cpu_kernel_choice_follows_rows_and_registers(avx512, monkeypatch):
    pytest.importorskip("numba")
    from appo.rollout import cpu_kernels

    used = []
    for name in ("_kernel", "_wide_kernel"):
        build = cpu_kernels._build_wide if name == "_wide_kernel" else cpu_kernels._build
        real = build()
        monkeypatch.setattr(cpu_kernels, name,
                            lambda *a, real=real, name=name: (used.append(name), real(*a)))
    monkeypatch.setattr(cpu_kernels, "wide_registers", lambda: avx512)
    weight = torch.randn(16, 8)
    for rows in (cpu_kernels.WIDE_MIN_ROWS, cpu_kernels.WIDE_MIN_ROWS + 1):
        cpu_kernels.linear(torch.randn(rows, 8), weight)
    # The wide kernel only with AVX-512 and only past WIDE_MIN_ROWS rows.
    assert used == ["_kernel", "_wide_kernel" if avx512 else "_kernel"]
    assert cpu_kernels.max_rows() == (cpu_kernels.WIDE_MAX_ROWS if avx512 else 12)


def test_cpu_kernel_can_be_switched_off_by_environment(lm, monkeypatch):
    from appo.errors import AppoError
    from appo.rollout import cpu_kernels

    monkeypatch.setenv("APPO_CPU_KERNELS", "0")
    assert not cpu_kernels.available()
    assert not HFEngine(lm.model, lm.tokenizer)._lean.cpu_kernel
    with pytest.raises(AppoError, match="cpu_kernel=True needs numba"):
        HFEngine(lm.model, lm.tokenizer, cpu_kernel=True)
