"""`appo.trainer.cpu_linear`: the training linears through oneDNN give F.linear's values and
gradients (float32: up to summation order), in a whole model's update too, and the switch
follows `actor.cpu_matmul` and the machine."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from appo.trainer import cpu_linear
from appo.trainer.cpu_linear import _OneDNNLinear, onednn_linears, uses_onednn

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="torch without oneDNN")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(7, 33), (3, 5, 33)])
def test_values_and_gradients_equal_f_linear(bias, shape):
    gen = torch.Generator().manual_seed(len(shape) + bias)
    x = torch.randn(*shape, generator=gen, requires_grad=True)
    w = torch.randn(19, 33, generator=gen, requires_grad=True)
    b = torch.randn(19, generator=gen, requires_grad=True) if bias else None
    g = torch.randn(*shape[:-1], 19, generator=gen)
    y = _OneDNNLinear.apply(x, w, b)
    (y * g).sum().backward()
    got = [t.grad.clone() for t in (x, w) + ((b,) if bias else ())]
    for t in (x, w) + ((b,) if bias else ()):
        t.grad = None
    # float64 reference: the float32 results differ from it by rounding only.
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    (F.linear(x, w, b) * g).sum().backward()
    want = [t.grad for t in (x, w) + ((b,) if bias else ())]
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-4)


def test_only_the_inputs_that_need_gradients_get_them():
    x = torch.randn(4, 8)  # no grad: a frozen input
    w = torch.randn(6, 8, requires_grad=True)
    _OneDNNLinear.apply(x, w, None).sum().backward()
    assert w.grad is not None and x.grad is None


def test_a_model_update_matches_torch_and_the_modules_are_restored():
    # A tiny causal LM: its loss and every parameter's gradient inside the block equal the
    # plain modules' (compared as gradients: an optimizer step would turn rounding into
    # steps where a gradient is ~0); outside, the modules are plain again.
    from appo.models import load_model

    model = load_model("tiny-test", device="cpu").model.float()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, model.config.vocab_size, (3, 17), generator=torch.Generator()
                        .manual_seed(0))
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears
    with onednn_linears(model):
        assert all("forward" in m.__dict__ for m in linears)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert not any("forward" in m.__dict__ for m in linears)
    want = twin(input_ids=ids, labels=ids).loss
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_gradient_checkpointing_recomputes_inside_the_block():
    from appo.models import load_model

    model = load_model("tiny-test", device="cpu").model.float()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    calls = []
    real = _OneDNNLinear.apply
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    try:
        _OneDNNLinear.apply = staticmethod(lambda *a: calls.append(1) or real(*a))
        with onednn_linears(model):
            loss = model(input_ids=ids, labels=ids).loss
            n_forward = len(calls)
            loss.backward()
    finally:
        _OneDNNLinear.apply = real
    assert n_forward and len(calls) > n_forward  # the recomputation went through it too


def test_disabled_is_a_no_op_and_other_dtypes_fall_back():
    layer = torch.nn.Linear(8, 4).double()
    with onednn_linears(layer, enabled=False):
        assert "forward" not in layer.__dict__
    x = torch.randn(2, 8, dtype=torch.float64)
    with onednn_linears(layer):
        assert "forward" in layer.__dict__
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_the_switch(monkeypatch):
    cpu = torch.device("cpu")
    assert not uses_onednn("torch", cpu, torch.float32, False)
    assert uses_onednn("onednn", cpu, torch.float32, False)
    assert not uses_onednn("onednn", cpu, torch.float32, True)  # FSDP
    assert not uses_onednn("onednn", cpu, torch.bfloat16, False)
    assert not uses_onednn("onednn", torch.device("cuda", 0), torch.float32, False)
    monkeypatch.setattr(cpu_linear, "_amd_avx512", lambda: True)
    assert uses_onednn("auto", cpu, torch.float32, False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert not uses_onednn("auto", cpu, torch.float32, False)  # MKL from 3 threads
    monkeypatch.undo()
    monkeypatch.setattr(cpu_linear, "_amd_avx512", lambda: False)
    assert not uses_onednn("auto", cpu, torch.float32, False)


def test_deciding_imports_no_numba():
    # vLLM's engine start-up scans every loaded module and fails on llvmlite's FFI object:
    # the trainer decides before its vLLM engine starts, so the decision imports no numba.
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from appo.trainer.cpu_linear import uses_onednn\n"
            "uses_onednn('auto', torch.device('cpu'), torch.float32, False)\n"
            "assert 'numba' not in sys.modules and 'llvmlite' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_config_key_takes_its_choices_only():
    from appo.config import load_config
    from appo.errors import AppoError

    assert load_config(overrides=["actor.cpu_matmul=onednn"]).actor.cpu_matmul == "onednn"
    with pytest.raises(AppoError, match="cpu_matmul"):
        load_config(overrides=["actor.cpu_matmul=mkl"])


def test_sft_runs_its_linears_through_onednn_when_asked(monkeypatch, tmp_path):
    # `train_sft(onednn=True)` puts its forward and backward through `_OneDNNLinear`;
    # its losses equal the plain run's to float32 rounding (same data order and seed).
    from collections import namedtuple

    from appo.config import SFTConfig
    from appo.models import load_model
    from appo.trainer.sft import train_sft

    Ex = namedtuple("Ex", "input_ids loss_mask")
    calls = []
    real = _OneDNNLinear.apply
    monkeypatch.setattr(_OneDNNLinear, "apply",
                        staticmethod(lambda *a: calls.append(1) or real(*a)))

    def run(onednn: bool, out: str):
        lm = load_model("tiny-test", device="cpu")
        ids = list(range(5, 30))
        examples = [Ex(ids, [0] * 10 + [1] * 15)] * 4
        params = SFTConfig(epochs=1, batch_size=2, max_steps=2, lr=1e-3, warmup_ratio=0.0,
                           output_dir=str(tmp_path / out))
        return train_sft(lm.model, lm.tokenizer, examples, params, seed=0, progress=False,
                         onednn=onednn)

    plain = run(False, "plain")
    assert not calls
    fast = run(True, "onednn")
    assert calls
    assert len(fast.train_loss) == len(plain.train_loss) == 2
    # Step 1's loss comes from the same weights: equal to rounding (step 2 follows an AdamW
    # step, which may turn rounding into a step: not compared).
    assert abs(fast.train_loss[0] - plain.train_loss[0]) < 1e-4


def test_the_lean_swiglu_down_projection_runs_through_onednn_inside_the_block(monkeypatch):
    # `_SwiGLUDown` computes the down projection outside its nn.Linear: inside the block its
    # three products (forward, input and weight gradients) go through oneDNN (`matmul_nt`),
    # so the lean model makes exactly the oneDNN products of the plain one, and its loss and
    # gradients equal the plain model's; outside the block, torch computes them.
    from collections import Counter

    from appo.models import load_model
    from appo.trainer import memory

    model = load_model("tiny-test", device="cpu").model.float()
    twin = copy.deepcopy(model)
    assert memory.lean_mlp_activations(model) > 0
    ids = torch.randint(0, model.config.vocab_size, (3, 17), generator=torch.Generator()
                        .manual_seed(1))
    shapes = []
    real = cpu_linear._mm
    monkeypatch.setattr(cpu_linear, "_mm", lambda a, b: shapes.append(
        (tuple(a.shape), tuple(b.shape))) or real(a, b))

    def products(m) -> tuple[Counter, torch.Tensor]:
        shapes.clear()
        with onednn_linears(m):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
        return Counter(shapes), loss

    lean, loss = products(model)
    plain, want = products(twin)
    assert lean == plain and sum(lean.values()) >= 3 * 7 * model.config.num_hidden_layers
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)
    shapes.clear()
    model(input_ids=ids, labels=ids).loss.backward()  # outside the block: torch's products
    assert shapes == []
