"""Decode matmuls: every implementation computes `F.linear`; the plan measures each row-count
bucket once, keeps the fastest, shares the choice through its store, and can be forced."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from appo.errors import AppoError
from appo.rollout import cpu_kernels, matmul_plan
from appo.rollout.matmul_plan import (
    BUCKETS,
    HEAD_BLOCK,
    IMPLEMENTATIONS,
    REPEATS,
    DecodeMatmulPlan,
    PlanStore,
    bucket_of,
)

needs_numba = pytest.mark.skipif(cpu_kernels.numba is None, reason="numba is not installed")


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(matmul_plan, "_MEMORY", {})
    monkeypatch.delenv(matmul_plan.FORCE_ENV, raising=False)
    monkeypatch.setenv("APPO_CACHE", str(tmp_path / "cache"))
    # Both kernels are candidates on any CPU here (the wide one is exact with AVX2 too).
    monkeypatch.setattr(cpu_kernels, "wide_registers", lambda: True)


def matrices(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(24, 16, generator=gen, dtype=dtype),
               torch.randn(16, 24, generator=gen, dtype=dtype)]
    return weights, torch.randn(40, 16, generator=gen, dtype=dtype)


class Costs:
    """A fake `measure`: seconds from `table(name, rows)`; records every call."""

    def __init__(self, table):
        self.table = table
        self.calls: list[tuple[str, int]] = []

    def __call__(self, impl, rows):
        self.calls.append((impl.name, rows))
        return self.table(impl.name, rows)


def raise_if_measured(impl, rows):
    raise AssertionError(f"measured {impl.name} at {rows} rows")


def plan(store, measure, use_kernels=True, dtype=torch.float32):
    weights, head = matrices(dtype)
    return DecodeMatmulPlan(weights, head, use_kernels=use_kernels, store=store, measure=measure)


# ---------------------------------------------------------------- implementations
@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_every_implementation_equals_f_linear(name, rows):
    impl = IMPLEMENTATIONS[name]
    if impl.kernel and cpu_kernels.numba is None:
        pytest.skip("numba is not installed")
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
    # float32, the dtype the engine uses: equal up to summation order.
    w32, x32 = weight.float(), x.float()
    torch.testing.assert_close(impl.linear(x32, w32), x32 @ w32.T, rtol=1e-5, atol=1e-5)


@needs_numba
@pytest.mark.parametrize("wide", [False, True], ids=["row-at-a-time", "wide"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 9, 12, 13])
def test_cpu_kernel_linear_equals_f_linear(rows, wide):
    # Row counts cover the row-at-a-time kernel's blocks of 8, of 4 and single rows and the
    # wide kernel's row pairs and odd last row; the weight height (37 = 4 x 8 + 5) leaves
    # a remainder after the wide kernel's blocks of 8 weight rows; K is not a multiple of
    # the SIMD lanes.
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(37, 29, generator=gen, dtype=torch.float64)
    bias = torch.randn(37, generator=gen, dtype=torch.float64)
    x = torch.randn(rows, 1, 29, generator=gen, dtype=torch.float64)
    for b in (None, bias):
        got = cpu_kernels.linear(x, weight, b, wide=wide)
        assert got.shape == (rows, 1, 37)
        torch.testing.assert_close(got, F.linear(x, weight, b), rtol=0, atol=1e-12)


# ---------------------------------------------------------------- the plan
def test_bucket_of_rows():
    assert BUCKETS[0] == 1
    expected = {1: 1, 2: 2, 5: 5, 6: 6, 7: 6, 8: 8, 11: 8, 12: 12, 13: 12, 47: 32, 48: 48,
                100: 96, 128: 128}
    assert {rows: bucket_of(rows) for rows in expected} == expected
    assert bucket_of(0) is None and bucket_of(BUCKETS[-1] + 1) is None


def test_plan_keeps_the_fastest_per_bucket_and_measures_each_bucket_once(tmp_path):
    def table(name, rows):
        # torch 1.0 everywhere; torch_weight_first wins at 2-3 rows, numba at 4-6,
        # numba_wide at 8-32 (where numba is 0.6); nothing beats torch past 32 rows.
        return {
            "torch": 1.0,
            "torch_weight_first": 0.7 if rows in (2, 3) else 1.5,
            "numba": 0.5 if 4 <= rows <= 6 else (0.6 if 8 <= rows <= 32 else 2.0),
            "numba_wide": 0.4 if 8 <= rows <= 32 else 1.2,
        }[name]

    costs = Costs(table)
    p = plan(PlanStore(tmp_path / "plan.json"), costs)
    chosen = {rows: p.implementation(rows).name for rows in (1, 2, 3, 4, 7, 9, 31, 64, 100)}
    assert chosen == {1: "torch", 2: "torch_weight_first", 3: "torch_weight_first",
                      4: "numba", 7: "numba", 9: "numba_wide", 31: "numba_wide",
                      64: "torch", 100: "torch"}
    # Buckets 1, 2, 3, 4, 6, 8, 24, 64, 96: each measured REPEATS times per candidate.
    measured = sorted({rows for _, rows in costs.calls})
    assert measured == [1, 2, 3, 4, 6, 8, 24, 64, 96]
    assert len(costs.calls) == len(measured) * REPEATS * len(IMPLEMENTATIONS)
    before = len(costs.calls)
    for rows in (1, 2, 3, 4, 5, 6, 7, 9, 31, 64, 100):  # 5 is a new bucket
        p.implementation(rows)
    assert len(costs.calls) == before + REPEATS * len(IMPLEMENTATIONS)
    # Past the last bucket: torch, with nothing measured.
    assert p.implementation(BUCKETS[-1] + 1).name == "torch"
    assert len(costs.calls) == before + REPEATS * len(IMPLEMENTATIONS)


def test_measurements_are_interleaved_and_the_best_of_each_side_counts(tmp_path):
    # numba is slow in its first measurement only (e.g. a noisy moment): its best (0.5)
    # still beats torch's steady 0.8.
    seen: dict[str, int] = {}

    def table(name, rows):
        seen[name] = seen.get(name, 0) + 1
        return {"torch": 0.8, "torch_weight_first": 0.9, "numba_wide": 0.95,
                "numba": 5.0 if seen[name] == 1 else 0.5}[name]

    costs = Costs(table)
    assert plan(PlanStore(tmp_path / "p.json"), costs).implementation(8).name == "numba"
    names = [name for name, _ in costs.calls]
    assert names == list(IMPLEMENTATIONS) * REPEATS  # one pass of every side per repeat


def test_choices_are_kept_in_the_store_for_later_processes(tmp_path):
    store = tmp_path / "plan.json"
    first = plan(PlanStore(store), Costs(lambda name, rows: 0.1 if name == "numba" else 1.0))
    assert first.implementation(8).name == "numba"
    data = json.loads(store.read_text())
    record = data["plans"][first.key]
    assert record["signature"]["threads"] == torch.get_num_threads()
    assert record["buckets"]["8"]["choice"] == "numba"
    assert record["buckets"]["8"]["ms"]["torch"] == pytest.approx(1000.0)
    # A new process (empty memory) reads the choice instead of measuring.
    matmul_plan._MEMORY.clear()
    later = plan(PlanStore(store), raise_if_measured)
    assert later.key == first.key and later.implementation(8).name == "numba"


def test_another_machine_or_model_measures_again(tmp_path, monkeypatch):
    store = PlanStore(tmp_path / "plan.json")
    plan(store, Costs(lambda name, rows: 0.1 if name == "numba" else 1.0)).implementation(8)
    # Other weight shapes: another key.
    weights, head = matrices()
    other = DecodeMatmulPlan(weights[:1], head, use_kernels=True, store=store,
                             measure=Costs(lambda name, rows: 0.1 if name == "torch" else 1.0))
    assert other.implementation(8).name == "torch"
    # Another CPU (or thread count, or library version): another key.
    signature = matmul_plan.machine_signature()
    monkeypatch.setattr(matmul_plan, "machine_signature",
                        lambda: {**signature, "cpu": "another CPU"})
    costs = Costs(lambda name, rows: 0.1 if name == "torch_weight_first" else 1.0)
    assert plan(store, costs).implementation(8).name == "torch_weight_first"
    assert costs.calls
    assert len(json.loads(store.path.read_text())["plans"]) == 3


def test_an_unreadable_store_is_replaced_with_a_warning(tmp_path, caplog):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="appo.rollout.matmul_plan"):
        p = plan(PlanStore(path), Costs(lambda name, rows: 0.1 if name == "numba" else 1.0))
        assert p.implementation(4).name == "numba"
    assert "unreadable" in caplog.text
    assert json.loads(path.read_text())["plans"][p.key]["buckets"]["4"]["choice"] == "numba"


def test_an_unwritable_store_keeps_choices_in_memory(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    costs = Costs(lambda name, rows: 0.1 if name == "numba" else 1.0)
    with caplog.at_level(logging.WARNING, logger="appo.rollout.matmul_plan"):
        p = plan(PlanStore(blocker / "plan.json"), costs)
        assert p.implementation(4).name == "numba"
        assert p.implementation(5).name == "numba"
    assert caplog.text.count("cannot write") == 1  # warned once, not per bucket
    calls = len(costs.calls)
    assert p.implementation(4).name == "numba" and len(costs.calls) == calls


def test_forcing_an_implementation(tmp_path, monkeypatch):
    monkeypatch.setenv(matmul_plan.FORCE_ENV, "torch_weight_first")
    p = plan(PlanStore(tmp_path / "p.json"), raise_if_measured)
    assert {p.implementation(r).name for r in (1, 8, 500)} == {"torch_weight_first"}
    monkeypatch.setenv(matmul_plan.FORCE_ENV, "fastest")
    with pytest.raises(AppoError, match="APPO_DECODE_MATMUL='fastest'.*choose from torch"):
        plan(PlanStore(tmp_path / "p.json"), raise_if_measured)
    monkeypatch.setenv(matmul_plan.FORCE_ENV, "numba")
    with pytest.raises(AppoError, match="needs the numba CPU kernels"):
        plan(PlanStore(tmp_path / "p.json"), raise_if_measured, use_kernels=False)
    with pytest.raises(AppoError, match="does not apply to a torch.float64 model"):
        plan(PlanStore(tmp_path / "p.json"), raise_if_measured, dtype=torch.float64)


def test_candidates_follow_the_kernel_switch_and_the_dtype(tmp_path):
    store = PlanStore(tmp_path / "p.json")
    off = plan(store, Costs(lambda name, rows: 0.1 if name == "torch_weight_first" else 1.0),
               use_kernels=False)
    assert [impl.name for impl in off.candidates] == ["torch", "torch_weight_first"]
    assert off.implementation(8).name == "torch_weight_first"
    # The kernels are float32 code: a float64 model has torch only, and nothing to measure.
    f64 = plan(store, raise_if_measured, dtype=torch.float64)
    assert [impl.name for impl in f64.candidates] == ["torch"]
    assert f64.implementation(8).name == "torch"


def test_measuring_for_real_keeps_the_fastest_recorded(tmp_path):
    store = PlanStore(tmp_path / "p.json")
    weights, head = matrices()
    p = DecodeMatmulPlan(weights, head, use_kernels=cpu_kernels.available(), store=store)
    choices = p.tune([1, 8])
    assert set(choices) == {1, 8}
    buckets = json.loads(store.path.read_text())["plans"][p.key]["buckets"]
    for bucket, record in buckets.items():
        ms = record["ms"]
        assert set(ms) == {impl.name for impl in p.candidates}
        assert all(v > 0 for v in ms.values())
        assert record["choice"] == min(ms, key=ms.get) == choices[int(bucket)]
