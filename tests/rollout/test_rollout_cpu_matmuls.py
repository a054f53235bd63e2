"""CPU decode matmuls: every implementation computes `F.linear`; the rule maps row counts to
implementations, follows the CPU and the kernel switch, and `APPO_DECODE_MATMUL` overrides it."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from appo.errors import AppoError
from appo.rollout.cpu import kernels, matmuls, onednn
from appo.rollout.cpu.matmuls import (
    FORCE_ENV,
    HEAD_BLOCK,
    IMPLEMENTATIONS,
    MAX_RULE_THREADS,
    RULES,
    MatmulRule,
    decode_rule,
    rule_name,
)

needs_numba = pytest.mark.skipif(kernels.numba is None, reason="numba is not installed")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(FORCE_ENV, raising=False)


# ---------------------------------------------------------------- implementations
@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_every_implementation_equals_f_linear(name, rows):
    impl = IMPLEMENTATIONS[name]
    if impl.kernel and kernels.numba is None:
        pytest.skip("numba is not installed")
    if impl.low_precision and not onednn.bf16_available():
        pytest.skip("no bf16 dot-product instructions")
    gen = torch.Generator().manual_seed(rows)
    # float64: equal to F.linear up to summation order. The head's height is not a multiple
    # of HEAD_BLOCK (a partial last block) nor of the wide kernel's 8 weight rows.
    weight = torch.randn(37, 29, generator=gen, dtype=torch.float64)
    bias = torch.randn(37, generator=gen, dtype=torch.float64)
    x = torch.randn(rows, 1, 29, generator=gen, dtype=torch.float64)
    for b in (None, bias):
        got = impl.linear(x, weight, b)
        assert got.shape == (rows, 1, 37) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=0, atol=1e-12)
    head = torch.randn(2 * HEAD_BLOCK + 77, 29, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(impl.head(x[:, 0], head), x[:, 0] @ head.T, rtol=0, atol=1e-12)
    # float32, the dtype the engine uses: equal up to summation order (a low-precision
    # implementation: to the product of the bfloat16-rounded operands, rounded once).
    w32, x32 = weight.float(), x.float()
    if impl.low_precision:
        want = x32.bfloat16().double() @ w32.bfloat16().double().T
        torch.testing.assert_close(impl.linear(x32, w32).double(), want, rtol=2**-8, atol=1e-3)
    else:
        torch.testing.assert_close(impl.linear(x32, w32), x32 @ w32.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_numpy_entry_point_equals_linear_to_the_bit(name, dtype):
    # The fused decode step calls `numpy_linear` where an implementation has one and
    # `linear` otherwise: the two must run the same arithmetic (rollouts must not change
    # with the path), so they agree bit for bit, with and without a bias.
    impl = IMPLEMENTATIONS[name]
    if impl.kernel and kernels.numba is None:
        pytest.skip("numba is not installed")
    if impl.low_precision and dtype == torch.float32 and not onednn.bf16_available():
        pytest.skip("no bf16 dot-product instructions")
    assert impl.numpy_linear is not None  # every built-in implementation has one
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(300, 41, generator=gen, dtype=dtype)
    bias = torch.randn(300, generator=gen, dtype=dtype)
    for rows in (1, 5, 16):
        x = torch.randn(rows, 41, generator=gen, dtype=dtype)
        for b in (None, bias):
            got = impl.numpy_linear(x.numpy(), weight, b)
            assert isinstance(got, np.ndarray) and got.shape == (rows, 300)
            assert torch.equal(torch.from_numpy(got), impl.linear(x, weight, b))


@needs_numba
@pytest.mark.parametrize("kind", ["row", "wide", "tile"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 12, 13])
def test_cpu_kernel_linear_equals_f_linear(rows, kind):
    # Row counts cover the row-at-a-time kernel's blocks of 8, of 4 and single rows, the
    # wide kernel's row pairs and odd last row and the tile kernel's blocks of 4 input rows
    # and their remainder; the weight height (37 = 4 x 8 + 5 = 12 x 3 + 1) leaves a
    # remainder after the wide kernel's blocks of 8 and the tile kernel's blocks of 3
    # weight rows; K is not a multiple of the SIMD lanes.
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(37, 29, generator=gen, dtype=torch.float64)
    bias = torch.randn(37, generator=gen, dtype=torch.float64)
    x = torch.randn(rows, 1, 29, generator=gen, dtype=torch.float64)
    for b in (None, bias):
        got = kernels.linear(x, weight, b, kind)
        assert got.shape == (rows, 1, 37)
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- the rule
def test_a_rule_maps_each_row_count_to_the_step_it_falls_in():
    rule = MatmulRule.parse("1:numba, 3:torch_weight_first,8:numba_wide,64:torch")
    got = {rows: rule.name_for(rows) for rows in (1, 2, 3, 7, 8, 63, 64, 1000)}
    assert got == {1: "numba", 2: "numba", 3: "torch_weight_first", 7: "torch_weight_first",
                   8: "numba_wide", 63: "numba_wide", 64: "torch", 1000: "torch"}
    assert rule.implementation(9) is IMPLEMENTATIONS["numba_wide"]
    assert MatmulRule.parse(str(rule)) == rule and rule.kernels
    one = MatmulRule.parse("torch_weight_first")
    assert str(one) == "1:torch_weight_first" and not one.kernels
    assert {one.name_for(r) for r in (1, 5, 500)} == {"torch_weight_first"}


@pytest.mark.parametrize("text, message", [
    ("fastest", "fastest: not a decode matmul implementation.*choose from torch"),
    ("2:torch", "starts at 1 row and rises"),
    ("1:torch,8:numba,4:torch", "starts at 1 row and rises"),
    ("1:torch,1:numba", "starts at 1 row and rises"),
    ("1:torch,x:numba", "expected rows:name"),
    ("1:torch,numba", "expected rows:name"),
])
def test_a_malformed_rule_is_refused(text, message):
    with pytest.raises(AppoError, match=message):
        MatmulRule.parse(text)


def test_every_builtin_rule_is_chosen_for_some_cpu_and_respects_what_it_has():
    chosen = set()
    for kernels_on, vendor, avx512, threads in itertools.product(
            (True, False), ("AuthenticAMD", "GenuineIntel", "ARM", ""), (True, False),
            (1, MAX_RULE_THREADS, MAX_RULE_THREADS + 1)):
        name = rule_name(kernels_on, vendor, avx512, threads)
        rule = RULES[name]
        chosen.add(name)
        names = {n for _, n in rule.steps}
        assert kernels_on or not rule.kernels  # no numba, no kernel
        assert avx512 or "numba_wide" not in names  # the wide kernel needs 32 registers
        if threads > MAX_RULE_THREADS or vendor not in ("AuthenticAMD", "GenuineIntel"):
            assert rule == RULES["torch"]  # unmeasured: plain torch
    assert chosen == set(RULES)


def test_the_default_follows_the_kernel_switch(monkeypatch):
    monkeypatch.setenv("APPO_CPU_KERNELS", "0")
    assert not kernels.available()
    assert not decode_rule(torch.float32, CPU, use_kernels=False).kernels
    monkeypatch.setattr(matmuls, "cpu_info", lambda: {"vendor": "AuthenticAMD", "model": "x"})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert decode_rule(torch.float32, CPU, use_kernels=False) == RULES["amd-torch"]
    if kernels.numba is not None:
        monkeypatch.setattr(kernels, "wide_registers", lambda: True)
        assert decode_rule(torch.float32, CPU, use_kernels=True) == RULES["amd-avx512"]


def test_the_environment_overrides_the_rule(monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "torch_weight_first")
    assert decode_rule(torch.float32, CPU, use_kernels=True) == MatmulRule(
        ((1, "torch_weight_first"),))
    monkeypatch.setenv(FORCE_ENV, "1:torch,4:numba")
    assert decode_rule(torch.float32, CPU, use_kernels=True).name_for(5) == "numba"
    with pytest.raises(AppoError, match="needs the numba CPU kernels"):
        decode_rule(torch.float32, CPU, use_kernels=False)
    monkeypatch.setenv(FORCE_ENV, "fastest")
    with pytest.raises(AppoError, match="not a decode matmul implementation"):
        decode_rule(torch.float32, CPU, use_kernels=True)


def test_only_float32_on_cpu_has_a_choice(monkeypatch):
    # The kernels are float32 CPU code; the W @ x^T layout trick is MKL's.
    assert decode_rule(torch.float64, CPU, use_kernels=True) == RULES["torch"]
    assert decode_rule(torch.float32, torch.device("cuda"), use_kernels=True) == RULES["torch"]
    monkeypatch.setenv(FORCE_ENV, "torch")
    assert decode_rule(torch.float64, CPU, use_kernels=True) == RULES["torch"]
    monkeypatch.setenv(FORCE_ENV, "numba")
    with pytest.raises(AppoError, match="does not apply to a torch.float64 model"):
        decode_rule(torch.float64, CPU, use_kernels=True)
