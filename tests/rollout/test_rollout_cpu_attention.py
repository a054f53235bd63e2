"""The fused CPU decode step's numba kernels (`appo.rollout.cpu.attention`) against the lean
decoder's torch code, and the engine's decode steps through them (`appo.rollout.cpu.fused`).

Kernel checks run in float64, so a difference in summation order (the kernels reassociate)
cannot hide an error behind float32 rounding: tolerance 1e-10. The engine checks run the
model in float32 as a rollout does and hold the recorded log-probs to the teacher-forced
forward within the hf engine tests' tolerance.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from appo.rollout.cpu import kernels
from appo.rollout.cpu.lean import LeanDecoder, SharedPrefix, _rotate_half

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
TOL64 = 1e-10
SHAPES = [(9, 3, 64), (4, 4, 32), (8, 2, 16), (6, 1, 8)]  # heads, kv heads, head dim
NEG = torch.finfo(torch.float64).min


@pytest.fixture(scope="module")
def k():
    from appo.rollout.cpu import attention

    return attention


def reference(heads: int, kv_heads: int, head_dim: int) -> LeanDecoder:
    """A LeanDecoder with only the attributes its attention methods read (no model)."""
    lean = object.__new__(LeanDecoder)
    lean.heads, lean.kv_heads, lean.head_dim = heads, kv_heads, head_dim
    lean.scale = head_dim**-0.5
    return lean


def batch_buffer(gen, layers, rows, kv_heads, capacity, hd, start, length):
    """A `[layers, 2, rows, kv_heads, capacity, hd]` buffer: each row's columns
    start..length hold keys/values; padding and unwritten columns hold NaN, which the
    kernel must never read (the torch reference gets zeros there instead)."""
    buf = torch.randn(layers, 2, rows, kv_heads, capacity, hd, generator=gen,
                      dtype=torch.float64)
    clean = buf.clone()
    for b in range(rows):
        buf[:, :, b, :, : int(start[b])] = float("nan")
        clean[:, :, b, :, : int(start[b])] = 0.0
    buf[:, :, :, :, length + 1 :] = float("nan")
    return buf, clean


def additive_mask(lo: torch.Tensor, length: int) -> torch.Tensor:
    """`[rows, 1, 1, length + 1]`: row b sees columns lo[b]..length (the engine's mask)."""
    cols = torch.arange(length + 1)
    visible = (cols[None, :] >= lo[:, None]) | (cols[None, :] == length)
    mask = torch.zeros(visible.shape, dtype=torch.float64)
    mask.masked_fill_(~visible, NEG)
    return mask[:, None, None]


@pytest.mark.parametrize("heads,kv_heads,hd", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 19])  # 19: row blocks of a unit, one partial
def test_attend_equals_decode_attention_with_left_padding(k, heads, kv_heads, hd, rows):
    gen = torch.Generator().manual_seed(heads * 100 + rows)
    length, layers, layer = 70, 2, 1  # 70: two full online-softmax blocks and a partial one
    start = torch.randint(0, length, (rows,), generator=gen)
    start[0] = 0
    buf, clean = batch_buffer(gen, layers, rows, kv_heads, length + 5, hd, start, length)
    q = torch.randn(rows, heads, 1, hd, generator=gen, dtype=torch.float64) * 3
    ref = reference(heads, kv_heads, hd)._decode_attention(
        q, clean[layer, 0, :, :, : length + 1], clean[layer, 1, :, :, : length + 1],
        additive_mask(start, length))
    out = np.empty((rows, heads, hd))
    empty = np.empty((kv_heads, 0, hd))
    k.attend(q[:, :, 0].numpy().copy(), buf.numpy(), layer, start.numpy(), length, empty,
             empty, hd**-0.5, out)
    torch.testing.assert_close(torch.from_numpy(out), ref[:, :, 0], rtol=0, atol=TOL64)


@pytest.mark.parametrize("heads,kv_heads,hd", SHAPES)
@pytest.mark.parametrize("rows,prefix", [(2, 5), (4, 64), (8, 33), (19, 70)])
def test_attend_with_a_shared_prefix_equals_cascade_attention(k, heads, kv_heads, hd, rows,
                                                              prefix):
    gen = torch.Generator().manual_seed(heads + rows + prefix)
    length, layers, layer = prefix + 40, 3, 2
    start = torch.randint(0, 12, (rows,), generator=gen)  # each row's copy of the prefix
    buf, clean = batch_buffer(gen, layers, rows, kv_heads, length + 3, hd, start, length)
    shared = torch.randn(layers, 2, kv_heads, prefix, hd, generator=gen, dtype=torch.float64)
    lo = int(start.min()) + prefix
    own = start + prefix
    mask = additive_mask(own, length)[..., lo:]
    q = torch.randn(rows, heads, 1, hd, generator=gen, dtype=torch.float64) * 3
    ref = reference(heads, kv_heads, hd)._cascade_attention(
        q, clean[layer, 0, :, :, : length + 1], clean[layer, 1, :, :, : length + 1],
        SharedPrefix(shared, lo, mask), layer)
    out = np.empty((rows, heads, hd))
    k.attend(q[:, :, 0].numpy().copy(), buf.numpy(), layer, own.numpy(), length,
             shared[layer, 0].numpy(), shared[layer, 1].numpy(), hd**-0.5, out)
    torch.testing.assert_close(torch.from_numpy(out), ref[:, :, 0], rtol=0, atol=TOL64)


def test_attend_is_the_softmax_of_what_it_reads_and_skips_everything_else(k):
    # Large scores (an unstable naive softmax would overflow) in the row's range, NaN
    # outside it: the result is the float64 softmax-weighted sum over the range only.
    hd, length = 8, 50
    gen = torch.Generator().manual_seed(9)
    buf = torch.full((1, 2, 1, 1, length + 1, hd), float("nan"), dtype=torch.float64)
    buf[0, :, 0, 0, 20:] = torch.randn(2, length + 1 - 20, hd, generator=gen,
                                       dtype=torch.float64) * 40
    q = torch.randn(1, 1, hd, generator=gen, dtype=torch.float64) * 40
    out = np.empty((1, 1, hd))
    empty = np.empty((1, 0, hd))
    k.attend(q.numpy(), buf.numpy(), 0, np.array([20]), length, empty, empty, 0.5, out)
    keys, values = buf[0, 0, 0, 0, 20:], buf[0, 1, 0, 0, 20:]
    probs = torch.softmax(keys @ q[0, 0] * 0.5, dim=0)
    assert math.isfinite(float(out.sum()))
    torch.testing.assert_close(torch.from_numpy(out[0, 0]), probs @ values, rtol=0, atol=1e-9)


def test_the_float32_exp_is_within_a_few_ulp_of_float64(k):
    # float32 attention exponentiates with a vectorisable polynomial (float64 uses numba's
    # exp, which the tests above check): its error against float64's exp, relative.
    x = np.concatenate([-np.linspace(0, 87, 100_003), -np.geomspace(1e-8, 1e-1, 1000),
                        [0.0, -0.5, -1e-30]]).astype(np.float32)
    got = x.copy()
    k._exp_nonpositive(got, len(got))
    want = np.exp(x.astype(np.float64))
    assert float(np.max(np.abs(got / want - 1))) < 4e-7  # ~3 ulp of float32
    tiny = np.array([-88.0, -100.0, -1e4], np.float32)
    k._exp_nonpositive(tiny, 3)
    assert np.all(tiny < 2e-38) and np.all(tiny >= 0)  # beyond float32's normal range: ~0


def assert_float32_attend_is_the_reference(k, gen, start, heads, kv_heads, hd, prefix,
                                           length):
    """float32 `attend` on random (float32-representable) inputs against the float64 torch
    reference: rows own columns `start + prefix`..`length`, after `prefix` shared ones."""
    rows = len(start)
    buf, clean = batch_buffer(gen, 1, rows, kv_heads, length + 2, hd, start + prefix, length)
    shared = torch.randn(1, 2, kv_heads, prefix, hd, generator=gen, dtype=torch.float64)
    q = torch.randn(rows, heads, 1, hd, generator=gen, dtype=torch.float64) * 3
    buf, clean, shared, q = (t.float().double() for t in (buf, clean, shared, q))
    lean = reference(heads, kv_heads, hd)
    own = start + prefix
    keys, values = clean[0, 0, :, :, : length + 1], clean[0, 1, :, :, : length + 1]
    if prefix:
        lo = int(own.min())
        ref = lean._cascade_attention(q, keys, values,
                                      SharedPrefix(shared, lo, additive_mask(own, length)[..., lo:]),
                                      0)
    else:
        ref = lean._decode_attention(q, keys, values, additive_mask(own, length))
    out = np.empty((rows, heads, hd), np.float32)
    k.attend(q[:, :, 0].float().numpy().copy(), buf.float().numpy(), 0, own.numpy(), length,
             shared[0, 0].float().numpy(), shared[0, 1].float().numpy(), hd**-0.5, out)
    torch.testing.assert_close(torch.from_numpy(out).double(), ref[:, :, 0], rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("rows,prefix", [(3, 0), (8, 70)])
def test_float32_attend_is_float64_attention_to_float32_rounding(k, rows, prefix):
    # The engine's dtype: the same kernel in float32 (polynomial exp, float32 sums) against
    # the float64 torch reference on the same (float32-representable) inputs.
    heads, kv_heads, hd, length = 9, 3, 64, prefix + 45
    gen = torch.Generator().manual_seed(rows + prefix)
    start = torch.randint(0, 20, (rows,), generator=gen)
    assert_float32_attend_is_the_reference(k, gen, start, heads, kv_heads, hd, prefix, length)


@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (8, 1, 80), (16, 2, 128),
                                               (4, 4, 24), (12, 3, 32)])
@pytest.mark.parametrize("prefix", [0, 40])
def test_float32_attend_over_many_blocks_and_head_shapes(k, heads, kv_heads, hd, prefix):
    # Rows of up to ~2.5 blocks of own columns (the online softmax rescaling across
    # blocks), query groups of 1-8 heads and head sizes of whole and part vectors: float32
    # through `vec`'s kernels where the head size is whole vectors, else through `_block`.
    rows, length = 5, prefix + 2 * k.BLOCK + 40
    gen = torch.Generator().manual_seed(heads * hd + prefix)
    start = torch.randint(0, 2 * k.BLOCK, (rows,), generator=gen)
    start[0] = 0  # one row with the longest own part
    assert_float32_attend_is_the_reference(k, gen, start, heads, kv_heads, hd, prefix, length)


@pytest.mark.parametrize("heads,kv_heads,hd", SHAPES)
@pytest.mark.parametrize("norms", [False, True], ids=["llama", "qwen3-qk-norm"])
def test_rope_write_equals_rotary_and_cache_update(k, heads, kv_heads, hd, norms):
    gen = torch.Generator().manual_seed(hd + heads)
    rows, layers, layer, col, eps = 5, 3, 1, 7, 1e-6
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * hd, generator=gen, dtype=torch.float64)
    angle = torch.rand(rows, hd // 2, generator=gen, dtype=torch.float64) * 50
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    q_norm = torch.rand(hd, generator=gen, dtype=torch.float64) + 0.5
    k_norm = torch.rand(hd, generator=gen, dtype=torch.float64) + 0.5
    q = qkv[:, : heads * hd].view(rows, heads, hd)
    kk = qkv[:, heads * hd : (heads + kv_heads) * hd].view(rows, kv_heads, hd)
    v = qkv[:, (heads + kv_heads) * hd :].view(rows, kv_heads, hd)
    if norms:  # the lean decoder's order: per-head RMSNorm, then rotary
        q, kk = F.rms_norm(q, (hd,), q_norm, eps), F.rms_norm(kk, (hd,), k_norm, eps)
    c, s = cos[:, None], sin[:, None]
    want_q, want_k = q * c + _rotate_half(q) * s, kk * c + _rotate_half(kk) * s
    buf = torch.randn(layers, 2, rows, kv_heads, col + 3, hd, generator=gen,
                      dtype=torch.float64)
    before = buf.clone()
    q_out = np.empty((rows, heads, hd))
    empty = np.empty(0)
    k.rope_write(qkv.numpy(), cos.numpy(), sin.numpy(),
                 q_norm.numpy() if norms else empty, k_norm.numpy() if norms else empty,
                 eps, buf.numpy(), layer, col, q_out)
    torch.testing.assert_close(torch.from_numpy(q_out), want_q, rtol=0, atol=TOL64)
    torch.testing.assert_close(buf[layer, 0, :, :, col], want_k, rtol=0, atol=TOL64)
    assert torch.equal(buf[layer, 1, :, :, col], v)  # values are copied as they are
    written = torch.zeros(buf.shape, dtype=torch.bool)
    written[layer, :, :, :, col] = True
    assert torch.equal(buf[~written], before[~written])  # nothing else touched


def test_norms_and_silu_equal_torch(k):
    gen = torch.Generator().manual_seed(4)
    rows, width, eps = 6, 40, 1e-5
    h = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    delta = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    weight = torch.rand(width, generator=gen, dtype=torch.float64) + 0.5
    out = np.empty((rows, width))
    k.rms_norm(h.numpy(), weight.numpy(), eps, out)
    want = F.rms_norm(h, (width,), weight, eps)
    torch.testing.assert_close(torch.from_numpy(out), want, rtol=0, atol=TOL64)
    h2 = h.clone()
    k.add_rms_norm(h2.numpy(), delta.numpy(), weight.numpy(), eps, out)
    assert torch.equal(h2, h + delta)  # the residual stream, updated in place
    want = F.rms_norm(h + delta, (width,), weight, eps)
    torch.testing.assert_close(torch.from_numpy(out), want, rtol=0, atol=TOL64)
    gate_up = torch.randn(rows, 2 * width, generator=gen, dtype=torch.float64) * 4
    k.silu_mul(gate_up.numpy(), out)
    want = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(torch.from_numpy(out), want, rtol=0, atol=TOL64)


# ---------------------------------------------------------------- through the engine
def random_model(model_type: str, tokenizer):
    """A random 2-layer model of the family, float32, the tiny tokenizer's vocabulary:
    qwen2 has Q/K/V biases, qwen3 per-head q/k RMSNorms; 3 query heads per KV head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=96, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=1024, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger biases and norm weights than the init's, so they count
        for name, p in model.named_parameters():
            if name.endswith("bias") or "q_norm" in name or "k_norm" in name:
                p.copy_(torch.rand_like(p) + 0.5)
    return model


def decode_both_ways(model, tok, monkeypatch):
    """The same rows decoded through the fused kernels and through the torch path (same
    seed); returns {fused?: (outputs, worst error vs the teacher-forced forward)} and the
    row counts of the fused steps."""
    from rollout_fakes import Recorder

    from appo.rollout.cpu import fused
    from appo.rollout.hf_engine import MIN_CASCADE_PREFIX, HFEngine
    from appo.rollout.sampling import SamplingParams

    steps: list[int] = []
    real = fused.FusedStep.__call__

    def spy(self, input_ids, *args):
        steps.append(input_ids.shape[0])
        return real(self, input_ids, *args)

    monkeypatch.setattr(fused.FusedStep, "__call__", spy)
    system = tok.encode("You are a careful assistant. " * 12)
    assert len(system) > MIN_CASCADE_PREFIX  # the first call's rows share it: cascade
    results = {}
    for kernel in (True, False):
        eng = HFEngine(model, tok, seed=5, cpu_kernel=kernel)
        rec = Recorder(eng)
        rows = rec.fork(eng.add_row(system + tok.encode(" Question one?")), 3) + rec.fork(
            eng.add_row(system + tok.encode(" Two: what now")), 2)
        outs = rec.decode(rows, [6, 20, 11, 3, 16], SamplingParams())
        # A second call without a shared prefix: left-padded rows of different lengths.
        eng.append(rows[1], tok.encode(" <result>\n7\n</result>"))
        other = eng.add_row(tok.encode("Hi"))
        outs += rec.decode([rows[1], rows[4], other], [9, 5, 12], SamplingParams())
        worst = max(rec.max_error(model, r) for r in rows + [other])
        results[kernel] = ([(o.token_ids, o.logps) for o in outs], worst)
        if kernel:
            assert steps and max(steps) == 5  # decode steps went through the kernels
            n_fused = len(steps)
    assert len(steps) == n_fused  # ...and none with cpu_kernel=False
    return results


@pytest.mark.parametrize("model_type", ["tiny-test", "qwen2", "qwen3"])
def test_engine_decode_through_the_kernels_matches_the_torch_path(model_type, monkeypatch):
    from rollout_fakes import tiny_tokenizer

    from appo.models import load_model

    if model_type == "tiny-test":
        lm = load_model("tiny-test", device="cpu")
        model, tok = lm.model, lm.tokenizer
    else:
        tok = tiny_tokenizer()
        model = random_model(model_type, tok)
    results = decode_both_ways(model, tok, monkeypatch)
    for _outs, worst in results.values():
        assert worst < 1e-4  # the hf engine tests' tolerance
    (fused_outs, _), (torch_outs, _) = results[True], results[False]
    assert [t for t, _ in fused_outs] == [t for t, _ in torch_outs]
    gap = max(abs(a - b) for (_, x), (_, y) in zip(fused_outs, torch_outs, strict=True)
              for a, b in zip(x, y, strict=True))
    assert gap < 1e-4


def test_units_are_halved_where_there_would_be_too_few(k):
    # (rows, KV heads) -> units: 8 rows per unit, or 4 (or 2) where 8 make under 4 units.
    for (rows, kv_heads), n in {(32, 3): 12, (19, 3): 9, (8, 3): 6, (8, 1): 4, (1, 3): 3,
                                (5, 3): 6, (16, 2): 4, (8, 8): 8, (2, 1): 1}.items():
        assert k.units(rows, kv_heads) == n, (rows, kv_heads)


@pytest.mark.parametrize("rows", [5, 19])
def test_attention_split_over_units_and_threads_is_bit_identical(k, rows):
    # 19 rows: two full row blocks and a partial one per KV head (9 units).
    from appo.rollout.cpu import split

    gen = torch.Generator().manual_seed(11 + rows)
    heads, kv_heads, hd, prefix, length = 9, 3, 64, 40, 90
    start = torch.randint(0, 10, (rows,), generator=gen) + prefix
    buf, _ = batch_buffer(gen, 2, rows, kv_heads, length + 2, hd, start, length)
    buf, q = buf.float().numpy(), torch.randn(rows, heads, hd, generator=gen).numpy()
    shared = torch.randn(2, kv_heads, prefix, hd, generator=gen).numpy()
    whole = np.empty((rows, heads, hd), np.float32)
    k.attend(q, buf, 1, start.numpy(), length, shared[0], shared[1], hd**-0.5, whole)
    args = (q, buf, 1, start.numpy(), length, *k.pack_prefix(shared[0], shared[1]),
            hd**-0.5)
    n = k.units(rows, kv_heads)
    assert n == {5: 6, 19: 9}[rows]  # 5 rows: 2 blocks of up to 4 (3 of 8 are too few)
    one_each = tuple((u, u + 1) for u in range(n))
    uneven = ((0, 1), (1, n - 1), (n - 1, n))
    for threads, chunks in ((1, one_each), (2, one_each), (3, one_each), (2, uneven)):
        out = np.full((rows, heads, hd), np.nan, np.float32)
        split.run_chunks(k.attend_units, (*args, out), chunks, threads)
        assert np.array_equal(out, whole)  # every unit written, to the bit


@pytest.mark.parametrize("rows,norms", [(5, False), (19, True)])
def test_rope_inside_the_attention_units_equals_rope_write_then_attention(k, rows, norms):
    # The fused step's job: each unit rotates its own rows' heads and writes its KV head's
    # new column, then attends; any split of the units gives rope_write + attend_units,
    # queries, cache and output, to the bit.
    from appo.rollout.cpu import split

    gen = np.random.default_rng(rows)
    heads, kv_heads, hd, prefix, col = 9, 3, 64, 24, 50
    qkv = gen.standard_normal((rows, (heads + 2 * kv_heads) * hd), np.float32)
    angle = gen.random((rows, hd // 2), np.float32) * 6
    cos = np.cos(np.concatenate([angle, angle], 1))
    sin = np.sin(np.concatenate([angle, angle], 1))
    q_norm, k_norm = ((gen.random(hd, np.float32), gen.random(hd, np.float32)) if norms
                      else (np.empty(0, np.float32),) * 2)
    buf = gen.standard_normal((2, 2, rows, kv_heads, col + 4, hd), np.float32)
    first = gen.integers(0, 20, rows).astype(np.int64)
    pk, pvt = k.pack_prefix(gen.standard_normal((kv_heads, prefix, hd), np.float32),
                            gen.standard_normal((kv_heads, prefix, hd), np.float32))
    rope = (qkv, cos, sin, q_norm, k_norm, 1e-6)
    want_buf, want_q = buf.copy(), np.empty((rows, heads, hd), np.float32)
    k.rope_write(*rope, want_buf, 1, col, want_q)
    n = k.units(rows, kv_heads)
    want = np.empty((rows, heads, hd), np.float32)
    k.attend_units(want_q, want_buf, 1, first, col, pk, pvt, hd**-0.5, want, 0, n)
    for threads, chunks in ((1, ((0, n),)), (2, tuple((u, u + 1) for u in range(n))),
                            (3, ((0, 1), (1, n - 1), (n - 1, n)))):
        got_buf, q = buf.copy(), np.full((rows, heads, hd), np.nan, np.float32)
        out = np.full((rows, heads, hd), np.nan, np.float32)
        split.run_chunks(k.rope_attend_units,
                         (*rope, q, got_buf, 1, first, col, pk, pvt, hd**-0.5, out), chunks,
                         threads)
        assert np.array_equal(q, want_q) and np.array_equal(got_buf, want_buf)
        assert np.array_equal(out, want)
