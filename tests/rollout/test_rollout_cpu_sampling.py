"""The numba sampling kernel (`appo.rollout.cpu.sampling`) against the torch `sample`.

Same generator seed -> same token ids: the uniforms come from the same `torch.rand` call. An
id may differ only where the uniform lands within float32 rounding of a step of the torch
path's CDF (its float32 probabilities carry ~1e-6 relative rounding noise, which the kernel's
cannot reproduce bit for bit): `assert_ids` allows that, and only rarely, checking each such
draw against the torch path's own CDF. Log-probs and entropies equal up to float32
summation-order rounding.
The kernel sums in float64, so it is also held to a float64 reference of the same
distribution at a much tighter tolerance than the torch path's float32 results allow.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from appo.rollout.cpu import kernels
from appo.rollout.sampling import (
    TOPK_ENTROPY_K,
    SamplingParams,
    apply_repetition_penalty,
    sample,
    sampling_log_probs,
)

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
# Against the torch path: its float32 log-softmax over 49,152 logits of scale ~20 is itself
# up to ~1.4e-5 off the float64 value (measured), its entropies ~4e-5.
LOGP_ATOL = 5e-5
ENT_RTOL, ENT_ATOL = 2e-5, 5e-5
# Against float64: float32 rounding of the result only.
TIGHT_RTOL, TIGHT_ATOL = 1e-6, 1e-6

PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.7),
    SamplingParams(temperature=0.8, top_k=20),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.2, top_p=0.9),
    SamplingParams(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1),
    SamplingParams(temperature=1.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
]


@pytest.fixture(scope="module")
def cs():
    from appo.rollout.cpu import sampling

    return sampling


def both(cs, logits, params, seen, seed, threads=None):
    g_torch, g_numba = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    ref = sample(logits, params, g_torch, seen)
    got = [torch.from_numpy(a) for a in cs.sample_numpy(logits, params, g_numba, seen, threads)]
    # The generator advanced by the same draw (none when greedy): later draws stay the same.
    assert torch.equal(torch.rand(3, generator=g_torch), torch.rand(3, generator=g_numba))
    assert_ids(ref[0], got[0], logits, params, seen, seed)
    # The torch path's log-prob of the kernel's token (the same token but at a near-tie).
    chosen = sampling_log_probs(logits, params, seen).gather(1, got[0][:, None]).squeeze(1)
    return (ref[0], chosen, *ref[2:]), got


# Measured: the two CDFs differ by ~1e-9 at a 49k vocabulary; a tail token's step is ~1e-9.
NEAR_TIE = 1e-7


def assert_ids(ref_ids, got_ids, logits, params, seen, seed, uniforms=None):
    """Ids equal, except rarely where the torch path's CDF puts its uniform within
    `NEAR_TIE` of the kernel's token's step (an edge of its interval)."""
    differ = (ref_ids != got_ids).nonzero().flatten().tolist()
    if not differ:
        return
    assert not params.greedy
    assert len(differ) <= max(1, len(ref_ids) // 100), differ
    cdf = sampling_log_probs(logits, params, seen).exp().double().cumsum(dim=-1)
    if uniforms is None:
        uniforms = torch.rand((len(ref_ids), 1), generator=torch.Generator().manual_seed(seed),
                              dtype=torch.float64)
    for r in differ:
        u, a = float(uniforms[r, 0] * cdf[r, -1]), int(got_ids[r])
        below = float(cdf[r, a - 1]) if a else 0.0
        assert below - NEAR_TIE <= u <= float(cdf[r, a]) + NEAR_TIE, (r, a, int(ref_ids[r]))


def assert_same(ref, got):
    ids, lp, ent, ent_top = ref
    torch.testing.assert_close(got[1], lp, rtol=0, atol=LOGP_ATOL)
    torch.testing.assert_close(got[2], ent, rtol=ENT_RTOL, atol=ENT_ATOL)
    torch.testing.assert_close(got[3], ent_top, rtol=ENT_RTOL, atol=ENT_ATOL)


def reference64(logits, params, seen, ids):
    """(log-prob of `ids`, entropy, top-k entropy) `[B]` in float64 of the distribution the
    torch path samples from: its mask, then float64 log-softmax."""
    keep = torch.isfinite(sampling_log_probs(logits, params, seen))
    z = logits.float()
    if seen is not None:
        z = apply_repetition_penalty(z, seen, params.repetition_penalty)
    z = (z / params.temperature).double().masked_fill(~keep, float("-inf"))
    lp = torch.log_softmax(z, dim=-1)
    p = lp.exp()
    terms = p * torch.where(p > 0, lp, torch.zeros_like(lp))
    top = torch.topk(lp, min(TOPK_ENTROPY_K, lp.shape[-1]), dim=-1).values
    pt = top.exp()
    h_top = -(pt * torch.where(pt > 0, top, torch.zeros_like(top))).sum(-1)
    return lp[torch.arange(len(ids)), ids], -terms.sum(-1), h_top


def assert_tight(logits, params, seen, got):
    if params.greedy:
        assert got[1].eq(0).all() and got[2].eq(0).all() and got[3].eq(0).all()
        return
    for mine, ref in zip(got[1:], reference64(logits, params, seen, got[0]), strict=True):
        torch.testing.assert_close(mine.double(), ref, rtol=TIGHT_RTOL, atol=TIGHT_ATOL)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 4.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # A peaked, long-tailed row like a language model's: a few large logits, a wide tail.
    x = torch.randn(rows, vocab, generator=gen) * scale
    x[:, torch.randint(0, vocab, (5,), generator=gen)] += 3 * scale
    return x


@pytest.mark.parametrize("params", PARAMS, ids=repr)
@pytest.mark.parametrize("rows, vocab", [(1, 49152), (8, 49152), (3, 97), (5, 12)])
def test_kernel_matches_torch_sampling(cs, params, rows, vocab):
    for seed in range(3):
        logits = random_logits(rows, vocab, 100 * seed + rows + vocab)
        gen = torch.Generator().manual_seed(seed)
        seen = torch.rand(rows, vocab, generator=gen) < 0.3
        ref, got = both(cs, logits, params, seen, seed)
        assert_same(ref, got)
        assert_tight(logits, params, seen, got)


def test_many_draws_match(cs):
    # Many rows, several steps from one generator: the stream and every id stay in step.
    logits = random_logits(64, 4096, 7, scale=2.0)
    params = SamplingParams(temperature=0.9)
    g_torch, g_numba = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(20):
        state = g_torch.get_state()
        ids = sample(logits, params, g_torch)[0]
        got = torch.from_numpy(cs.sample_numpy(logits, params, g_numba)[0])
        uniforms = torch.rand((64, 1), generator=torch.Generator().set_state(state),
                              dtype=torch.float64)
        assert_ids(ids, got, logits, params, None, 0, uniforms)


def test_the_kernel_samples_the_torch_distribution(cs):
    # The recorded log-prob of every draw is that of the torch path's distribution.
    logits = random_logits(16, 3000, 3)
    params = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.2)
    seen = torch.rand(16, 3000, generator=torch.Generator().manual_seed(0)) < 0.2
    logp = sampling_log_probs(logits, params, seen)
    ids, lp, ent, _ = cs.sample_numpy(logits, params, torch.Generator().manual_seed(0), seen)
    torch.testing.assert_close(torch.from_numpy(lp), logp[torch.arange(16), ids],
                               rtol=0, atol=LOGP_ATOL)
    assert bool(torch.isfinite(torch.from_numpy(lp)).all())
    p = logp.exp()
    h = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).double().sum(-1)
    torch.testing.assert_close(torch.from_numpy(ent).double(), h, rtol=ENT_RTOL, atol=ENT_ATOL)


@pytest.mark.parametrize("params", PARAMS, ids=repr)
def test_minus_inf_logits(cs, params):
    # Banned tokens (-inf), a row with a single finite logit, fewer finite logits than
    # top-k and than the top-k entropy's 10.
    logits = random_logits(4, 300, 5)
    logits[0, ::2] = float("-inf")
    logits[1, :] = float("-inf")
    logits[1, 17] = 2.0
    logits[2, 5:] = float("-inf")
    logits[3, :290] = float("-inf")
    seen = torch.zeros(4, 300, dtype=torch.bool)
    seen[:, :40] = True
    ref, got = both(cs, logits, params, seen, 2)
    assert_same(ref, got)
    assert_tight(logits, params, seen, got)
    assert got[0][1] == 17


def test_ties_at_top_k_are_kept_as_torch_does(cs):
    # Top-k keeps every logit equal to the k-th largest (`logits < kth` is what is masked).
    logits = torch.zeros(2, 64)
    logits[:, :3] = 5.0
    logits[:, 3:9] = 2.0  # tied at the 4th..9th largest
    params = SamplingParams(top_k=5)
    ref, got = both(cs, logits, params, None, 4)
    assert_same(ref, got)
    assert got[0].tolist() == ref[0].tolist()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rows_split_over_threads_are_bit_identical(cs, threads):
    logits = random_logits(7, 5000, 9)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    one = cs.sample_numpy(logits, params, torch.Generator().manual_seed(3), None, 1)
    many = cs.sample_numpy(logits, params, torch.Generator().manual_seed(3), None, threads)
    for a, b in zip(one, many, strict=True):
        assert a.tobytes() == b.tobytes()


def test_tensor_wrapper_and_non_contiguous_logits(cs):
    logits = random_logits(6, 400, 1).t().contiguous().t()[:, :300]  # a strided view
    assert not logits.is_contiguous()
    ref, got = both(cs, logits, SamplingParams(temperature=0.9), None, 8)
    assert_same(ref, got)
    out = cs.sample(logits, SamplingParams(), torch.Generator().manual_seed(0))
    assert [t.shape for t in out] == [(6,)] * 4 and out[0].dtype == torch.int64


# ---------------------------------------------------------------- the hf engine


def decode_tokens(lm, cpu_sampling, params, monkeypatch, env=None):
    from appo.rollout.cpu import sampling
    from appo.rollout.hf_engine import HFEngine

    calls = []
    plain = sampling.sample_numpy
    monkeypatch.setattr(sampling, "sample_numpy",
                        lambda *a, **kw: calls.append(1) or plain(*a, **kw))
    if env is not None:
        monkeypatch.setenv("APPO_CPU_SAMPLING", env)
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=5, eos_ids=frozenset(), cpu_sampling=cpu_sampling)
    rows = eng.fork(eng.add_row(tok.encode("Tell me a story")), 3)
    rows.append(eng.add_row(tok.encode("Hi")))
    outs = eng.decode(rows, [12, 5, 9, 12], params)
    kids = eng.fork(rows[0], 2)
    outs += eng.decode(kids, 6, params)
    monkeypatch.undo()
    return outs, len(calls)


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
], ids=["default", "eval", "greedy"])
def test_engine_rollout_is_the_same_with_the_kernel(monkeypatch, params):
    from appo.models import load_model

    lm = load_model("tiny-test", device="cpu")
    fast, n_fast = decode_tokens(lm, None, params, monkeypatch)
    slow, n_slow = decode_tokens(lm, False, params, monkeypatch)
    off, n_off = decode_tokens(lm, None, params, monkeypatch, env="0")
    assert n_fast == 12 + 6 and n_slow == 0 and n_off == 0  # one kernel call per step
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow] == [
        o.token_ids for o in off]
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(torch.tensor(a.logps), torch.tensor(b.logps),
                                   rtol=0, atol=LOGP_ATOL)
        for x, y in ((a.entropies, b.entropies), (a.topk_entropies, b.topk_entropies)):
            torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=ENT_RTOL,
                                       atol=ENT_ATOL)


@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("order", ["random", "rising", "ties"])
def test_first_pass_keeps_the_largest_values_as_an_element_loop(cs, vocab, order):
    # Blocks of the first pass skip the heap where no value beats its least; the heap and
    # the max must be what pushing element by element gives, rising values (a push at
    # every element) and ties included.
    rng = np.random.default_rng(vocab)
    x = {"random": rng.standard_normal(vocab), "rising": np.arange(vocab) * 0.5,
         "ties": rng.integers(0, 4, vocab)}[order].astype(np.float32)
    z, heap = np.empty(vocab, np.float32), np.empty(min(20, vocab), np.float32)
    m = cs._scan_row(x, cs._NO_SEEN[0], False, np.float32(1), np.float32(0.7), z, heap)
    want = x / np.float32(0.7)
    assert z.tobytes() == want.tobytes()
    assert m == want.max()
    assert sorted(heap.tolist()) == sorted(want.tolist())[-heap.shape[0]:]


def test_the_draw_finds_its_block_then_its_token(cs):
    # z: a row's float32 probabilities (unnormalised); sums: its blocks' sums.
    width = 4
    z = np.array([0.5, 0, 1, 0, 0, 0, 0, 0, 2, 0.25, 0, 0], np.float32)
    sums = np.array([1.5, 0.0, 2.25])
    assert [cs._draw_row(z, u, sums, width) for u in (0.0, 0.49, 0.5, 1.49, 1.5, 3.4, 3.5,
                                                       3.74)] == [0, 0, 2, 2, 8, 8, 9, 9]
    # A block's sum a rounding above its walk: the walk ends short of u, and the draw is
    # the block's last kept token, never a zero-probability one.
    assert cs._draw_row(z, 1.5, np.array([1.5 + 1e-9, 0.0, 2.25]), width) == 2
    # u at the total (a uniform within rounding of 1): the row's last kept token.
    assert cs._draw_row(z, 3.75, sums, width) == 9
