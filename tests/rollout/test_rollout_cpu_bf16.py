"""`rollout.cpu_weights=bfloat16`: the hf engine's matmuls on bfloat16 copies of the weights
through oneDNN's bf16 kernels (`appo.rollout.cpu.onednn.linear_bf16`), and its errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onednn_cases import lean_engine
from onednn_cases import random_linear as _case

from appo.errors import AppoError
from appo.rollout.cpu import onednn
from appo.rollout.cpu.matmuls import BF16_RULE, CPU_WEIGHTS, IMPLEMENTATIONS, decode_rule

pytestmark = pytest.mark.usefixtures("onednn_dropped")
needs_bf16 = pytest.mark.skipif(not onednn.bf16_available(),
                                reason="no bf16 dot-product instructions or no oneDNN bf16")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 8, 33, 300])
def test_bf16_linear_is_the_product_of_the_rounded_operands(rows):
    # Inputs and weight rounded to bfloat16, products summed in float32, the sum rounded
    # to bfloat16 once: within one bfloat16 rounding (2^-8 relative) of the exact product
    # of the rounded operands, and measurably off the float32 product.
    x, w, b = _case(rows)
    got = onednn.linear_bf16(x, w, b)
    assert got.shape == (rows, 200) and got.dtype == torch.float32
    exact = F.linear(x.bfloat16().double(), w.bfloat16().double()) + b.double()
    y = got.double() - b.double()  # the bias is added in float32 after the GEMM
    torch.testing.assert_close(y, exact - b.double(), rtol=2**-8, atol=1e-4)
    assert not torch.allclose(got, F.linear(x, w, b), rtol=1e-6, atol=1e-6)
    assert len(onednn._packed_bf16) == 1 and not onednn._packed
    packed = next(iter(onednn._packed_bf16.values()))[2]
    assert packed.layout == torch._mkldnn and packed.dtype == torch.bfloat16


@needs_bf16
def test_bf16_leading_dimensions_numpy_entry_and_registry():
    x, w, b = _case(12)
    got = onednn.linear_bf16(x.reshape(3, 4, 96), w, b)
    assert got.shape == (3, 4, 200)
    assert torch.equal(got.reshape(12, 200), onednn.linear_bf16(x, w, b))
    arr = onednn.numpy_linear_bf16(x.numpy(), w, b)
    assert isinstance(arr, np.ndarray) and arr.dtype == np.float32
    assert torch.equal(torch.from_numpy(arr), onednn.linear_bf16(x, w, b))
    impl = IMPLEMENTATIONS["onednn_bf16"]
    assert not impl.kernel and torch.equal(impl.head(x, w), onednn.linear_bf16(x, w))
    # An optimizer step in place: the bfloat16 copy is remade from the new values.
    before = onednn.linear_bf16(x, w)
    with torch.no_grad():
        w.mul_(2)
    torch.testing.assert_close(onednn.linear_bf16(x, w), 2 * before)


def test_the_rule_and_its_errors(monkeypatch):
    cpu, f32 = torch.device("cpu"), torch.float32
    monkeypatch.delenv("APPO_DECODE_MATMUL", raising=False)
    assert CPU_WEIGHTS == ("float32", "bfloat16")
    with pytest.raises(AppoError, match="choose from float32, bfloat16"):
        decode_rule(f32, cpu, False, "int8")
    with pytest.raises(AppoError, match="float32 model on CPU"):
        decode_rule(torch.float64, cpu, False, "bfloat16")
    monkeypatch.setattr(onednn, "bf16_available", lambda: False)
    with pytest.raises(AppoError, match="avx512_bf16 or amx_bf16"):
        decode_rule(f32, cpu, False, "bfloat16")
    monkeypatch.setattr(onednn, "bf16_available", lambda: True)
    assert decode_rule(f32, cpu, False, "bfloat16") == BF16_RULE
    assert {BF16_RULE.name_for(r) for r in (1, 8, 64)} == {"onednn_bf16"}
    assert BF16_RULE.prefill == "onednn_bf16" and not BF16_RULE.kernels
    monkeypatch.setenv("APPO_DECODE_MATMUL", "torch")
    with pytest.raises(AppoError, match="APPO_DECODE_MATMUL=torch also chooses"):
        decode_rule(f32, cpu, False, "bfloat16")


def test_config_key_and_engine_errors(monkeypatch):
    from appo.config import load_config
    from appo.config_schema import CHOICES
    from appo.models import load_model
    from appo.rollout.hf_engine import HFEngine

    assert CHOICES["rollout.cpu_weights"] == CPU_WEIGHTS
    assert load_config().rollout.cpu_weights == "float32"  # the default: the model's weights
    with pytest.raises(AppoError, match="cpu_weights"):
        load_config(overrides=["rollout.cpu_weights=fp8"])
    lm = load_model("tiny-test", device="cpu")
    monkeypatch.setattr(onednn, "bf16_available", lambda: True)
    with pytest.raises(AppoError, match="needs the lean forward"):
        HFEngine(lm.model, lm.tokenizer, lean_forward=False, cpu_weights="bfloat16")


@needs_bf16
def test_the_engine_decodes_on_bf16_weights_close_to_float32():
    # Every matmul of prefill and decode runs on bfloat16 copies (QKV and gate/up kept only
    # packed in bfloat16); log-probs of the tokens both engines drew (up to where a row's
    # draws part) are the float32 engine's up to bfloat16 noise, and not bit-equal to them
    # (the option is really on); sampling stays seeded.
    from appo.rollout.sampling import SamplingParams

    def run(weights: str, params: SamplingParams):
        eng, tok = lean_engine(cpu_weights=weights)
        rows = [eng.add_row(tok.encode(f"A question, number {i}, about the sea?"))
                for i in range(5)]
        outs = eng.decode(rows, 6, params)
        return eng, [(o.token_ids, o.logps) for o in outs]

    sampled = SamplingParams(temperature=1.0)  # the same seed: the same draws
    eng, got = run("bfloat16", sampled)
    assert eng._lean.rule == BF16_RULE
    assert all(lw.qkv.layout == torch._mkldnn and lw.qkv.dtype == torch.bfloat16
               for lw in eng._lean._layers)
    assert onednn._packed_bf16 and not onednn._packed
    _, want = run("float32", sampled)
    diffs = []
    for (ids_a, lp_a), (ids_b, lp_b) in zip(got, want, strict=True):
        for x, y, a, b in zip(ids_a, ids_b, lp_a, lp_b, strict=True):
            diffs.append(abs(a - b))
            if x != y:  # the contexts part here: later tokens are not comparable
                break
    assert diffs and max(diffs) < 0.05 and max(diffs) > 0
    assert run("bfloat16", sampled)[1] == got  # seeded: repeats


def test_appo_default_noise_tolerance_follows_the_engine_weights():
    # A float32 scorer of rows decoded on bfloat16 weights sees bfloat16-sized log-ratio
    # noise (benchmarks/appo_lr_noise.py): the default tolerance is bfloat16's.
    from appo.rollout.scoring import LR_NOISE_TOL, default_lr_noise_tol, noisiest

    f32, bf16 = torch.float32, torch.bfloat16
    assert noisiest(f32, bf16) == noisiest(bf16, f32) == bf16
    assert noisiest(f32, None) == f32 and noisiest(None, None) is None
    assert default_lr_noise_tol(noisiest(f32, bf16)) == LR_NOISE_TOL[bf16] > LR_NOISE_TOL[f32]


def test_engine_reports_its_matmul_dtype(monkeypatch):
    from appo.models import load_model
    from appo.rollout.hf_engine import HFEngine

    lm = load_model("tiny-test", device="cpu")
    eng = HFEngine(lm.model, lm.tokenizer)
    assert eng.matmul_dtype == torch.float32
    if eng._lean is None:
        pytest.skip("the tiny model is not served by the lean decoder")
    monkeypatch.setattr(onednn, "bf16_available", lambda: True)
    monkeypatch.delenv("APPO_DECODE_MATMUL", raising=False)
    assert HFEngine(lm.model, lm.tokenizer, cpu_weights="bfloat16").matmul_dtype == torch.bfloat16


def test_the_override_cannot_pick_bf16(monkeypatch):
    # bfloat16 matmuls are a precision choice with its own key, not a speed override.
    monkeypatch.setenv("APPO_DECODE_MATMUL", "1:torch,8:onednn_bf16")
    with pytest.raises(AppoError, match="rollout.cpu_weights=bfloat16, not here"):
        decode_rule(torch.float32, torch.device("cpu"), False)
