"""`rollout.name=auto`: the rule table, both sides of its crossovers, the fallbacks when vLLM
is missing or broken, the log line, and the workloads the commands hand it."""

from __future__ import annotations

import math

import pytest

from appo.config import CHOICES, load_config
from appo.errors import AppoError
from appo.rollout import auto
from appo.rollout.auto import Choice, Workload, break_even_tokens, choose_engine, decode_speeds


@pytest.fixture
def vllm_present(monkeypatch):
    """vLLM installed and importable, without importing it."""
    monkeypatch.setattr(auto, "vllm_installed", lambda: True)
    monkeypatch.setattr(auto, "vllm_import_error", lambda: None)


@pytest.fixture
def vllm_faster(monkeypatch):
    """The table measured before issue 43's CPU kernels (2026-11-25, AMD Zen 4), where
    vLLM decoded 2.0-2.1x faster: the rule's crossovers are tested on it."""
    monkeypatch.setattr(auto, "CPU_DECODE", ((8, 103.6, 214.9), (32, 175.4, 356.9)))


# ---------------------------------------------------------------- the table
def test_decode_speeds_are_the_measured_ones_and_interpolate_between(monkeypatch):
    monkeypatch.setattr(auto, "CPU_DECODE", ((32, 400.0, 250.0), (8, 100.0, 160.0)))
    assert decode_speeds(8) == (100.0, 160.0)  # the table's order does not matter
    assert decode_speeds(32) == (400.0, 250.0)
    hf16, vllm16 = decode_speeds(16)  # log-log midpoint: the geometric mean
    assert hf16 == pytest.approx(200.0)
    assert vllm16 == pytest.approx(math.sqrt(160.0 * 250.0))
    assert decode_speeds(1) == decode_speeds(8)  # held flat outside the measured sizes
    assert decode_speeds(256) == decode_speeds(32)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_with_the_measured_table_a_cpu_run_stays_on_hf(vllm_present, monkeypatch, isa):
    monkeypatch.setattr(auto, "CPU_DECODE", auto.CPU_DECODE_BY_ISA[isa])
    for rows in (1, 8, 16, 32, 256):
        assert break_even_tokens(rows) == math.inf
        choice = choose_engine(Workload(rows, 10_000, 512), cuda=False)
        assert choice.name == "hf"
        assert "hf decodes" in choice.reason or "within the table's noise" in choice.reason


def test_a_lead_under_the_minimum_is_no_lead(vllm_present, monkeypatch):
    monkeypatch.setattr(auto, "CPU_DECODE", ((8, 100.0, 104.0), (32, 100.0, 106.0)))
    assert break_even_tokens(8) == math.inf
    assert choose_engine(Workload(8, 10_000, 512), cuda=False).name == "hf"
    assert break_even_tokens(32) < math.inf  # 1.06x: a lead
    assert choose_engine(Workload(32, 100_000, 512), cuda=False).name == "vllm"


def test_break_even_is_the_start_up_gap_over_the_time_saved_per_token(vllm_faster):
    gap = auto.CPU_STARTUP_S["vllm"] - auto.CPU_STARTUP_S["hf"]
    assert break_even_tokens(8) == pytest.approx(gap / (1 / 103.6 - 1 / 214.9))
    assert 12_000 < break_even_tokens(8) < 12_400
    assert 20_800 < break_even_tokens(32) < 21_200


def test_expected_tokens_count_calls_rows_budget_and_fill():
    assert Workload(32, 3, 160).expected_tokens == 32 * 3 * 160 * auto.EXPECTED_FILL


# ---------------------------------------------------------------- the rule
def test_not_installed_is_hf_without_error(monkeypatch):
    monkeypatch.setattr(auto, "vllm_installed", lambda: False)
    monkeypatch.setattr(auto, "vllm_import_error",
                        lambda: pytest.fail("vLLM must not be imported when it is absent"))
    for cuda in (False, True):
        choice = choose_engine(Workload(32, 1000, 512), cuda=cuda)
        assert choice == Choice("hf", "vLLM is not installed in this environment")


def test_short_run_stays_on_hf_long_run_goes_to_vllm(vllm_present, vllm_faster):
    """The 3-step vLLM run of docs/vllm.md (4 prompts x 8 rows, 160-token budget) does not
    repay vLLM's start-up; ten such steps do."""
    short = choose_engine(Workload(32, 3, 160), cuda=False)
    long = choose_engine(Workload(32, 10, 160), cuda=False)
    assert short.name == "hf" and long.name == "vllm"
    assert "2.03x" in long.reason and "7.7k expected" in short.reason


def test_crossover_in_tokens_at_a_fixed_batch(vllm_present, vllm_faster):
    need = break_even_tokens(8)
    budget = 100
    calls = math.ceil(need / (8 * budget * auto.EXPECTED_FILL))
    assert choose_engine(Workload(8, calls - 1, budget), cuda=False).name == "hf"
    assert choose_engine(Workload(8, calls, budget), cuda=False).name == "vllm"


def test_crossover_in_rows_at_a_fixed_run_length(vllm_present, vllm_faster):
    """10 rollout calls with a 256-token budget: a few rows decode too little to repay the
    start-up, a batch of 32 does."""
    assert choose_engine(Workload(4, 10, 256), cuda=False).name == "hf"
    assert choose_engine(Workload(8, 10, 256), cuda=False).name == "hf"
    assert choose_engine(Workload(32, 10, 256), cuda=False).name == "vllm"
    assert "(measured at 8, 32)" in choose_engine(Workload(4, 10, 256), cuda=False).reason


def test_hf_when_the_table_says_hf_is_faster(vllm_present, monkeypatch):
    monkeypatch.setattr(auto, "CPU_DECODE", ((8, 120.0, 100.0), (32, 200.0, 150.0)))
    choice = choose_engine(Workload(16, 10_000, 512), cuda=False)
    assert choice.name == "hf" and "hf decodes" in choice.reason


def test_cuda_is_vllm_at_any_batch(vllm_present):
    for rows in (1, 8, 512):
        assert choose_engine(Workload(rows, 1, 16), cuda=True).name == "vllm"


def test_installed_but_broken_import_falls_back_to_hf(monkeypatch, vllm_faster):
    monkeypatch.setattr(auto, "vllm_installed", lambda: True)
    monkeypatch.setattr(auto, "vllm_import_error",
                        lambda: "RuntimeError: operator torchvision::nms does not exist")
    choice = choose_engine(Workload(32, 100, 512), cuda=False)
    assert choice.name == "hf" and "does not import" in choice.reason
    # a pick of hf never imports vLLM (5 s, and a broken install would not matter)
    monkeypatch.setattr(auto, "vllm_import_error", lambda: pytest.fail("imported"))
    assert choose_engine(Workload(32, 1, 16), cuda=False).name == "hf"


def test_device_from_config(vllm_present):
    cfg = load_config(overrides=["model.device=cuda"])
    assert auto.resolve(cfg, Workload(2, 1, 16)).name == "vllm"
    cfg = load_config(overrides=["model.device=cpu"])
    assert auto.resolve(cfg, Workload(2, 1, 16)).name == "hf"


def test_training_workload_is_this_ranks_share():
    cfg = load_config(overrides=["data.train_batch_size=5", "rollout.n=8",
                                 "data.max_response_length=200"])
    assert Workload.training(cfg, steps=7) == Workload(40, 7, 200)
    assert Workload.training(cfg, steps=7, world=2) == Workload(24, 7, 200)  # ceil(5/2) x 8
    assert Workload.training(cfg, steps=0).calls == 1


# ---------------------------------------------------------------- config and build_engine
def test_config_accepts_auto_and_keeps_hf_the_default():
    assert "auto" in CHOICES["rollout.name"]
    assert load_config().rollout.name == "hf"
    assert load_config(overrides=["rollout.name=auto"]).rollout.name == "auto"
    with pytest.raises(AppoError, match="rollout.name"):
        load_config(overrides=["rollout.name=fastest"])


@pytest.fixture(scope="module")
def tiny_lm():
    from appo.models import load_model

    return load_model("tiny-test")


def test_build_engine_auto_without_vllm_is_the_hf_engine_and_says_why(
        tiny_lm, monkeypatch, capsys):
    from appo.rollout import build_engine
    from appo.rollout.hf_engine import HFEngine

    monkeypatch.setattr(auto, "vllm_installed", lambda: False)
    cfg = load_config(overrides=["rollout.name=auto", "model.device=cpu"])
    engine = build_engine(cfg, tiny_lm, workload=Workload(8, 100, 256))
    assert isinstance(engine, HFEngine)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["appo: rollout.name=auto -> hf (vLLM is not installed in this environment)"]
    build_engine(cfg, tiny_lm, announce=False)
    assert capsys.readouterr().err == ""


def test_build_engine_auto_picks_vllm_for_a_long_run(tiny_lm, vllm_present, vllm_faster,
                                                      monkeypatch, capsys):
    from appo.rollout import build_engine
    from appo.rollout.vllm_engine import VLLMEngine

    built = []
    monkeypatch.setattr(VLLMEngine, "from_config",
                        classmethod(lambda cls, cfg, tokenizer=None, **kw: built.append(cfg)
                                    or "vllm-engine"))
    cfg = load_config(overrides=["rollout.name=auto", "model.device=cpu",
                                 "rollout.base_urls=[http://127.0.0.1:1]"])
    assert build_engine(cfg, tiny_lm, workload=Workload(32, 10, 160)) == "vllm-engine"
    assert built == [cfg]
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("appo: rollout.name=auto -> vllm (CPU, 32 rows per call: vLLM "
                           "decodes 2.03x faster")
    assert line.endswith("only rollout.name=openai uses servers)")
    # the same config, a short run: hf
    assert build_engine(cfg, tiny_lm, workload=Workload(32, 1, 160), announce=False) != \
        "vllm-engine"


def test_trainer_hands_auto_its_training_workload(tiny_lm, monkeypatch, tmp_path):
    from appo.trainer.loop import RLTrainer

    seen = []

    def resolve(cfg, workload, installed=None):
        seen.append(workload)
        return Choice("hf", "test")

    monkeypatch.setattr(auto, "resolve", resolve)
    cfg = load_config(overrides=[
        "model.path=tiny-test", "rollout.name=auto", "data.train_batch_size=2", "rollout.n=4",
        "data.max_response_length=16", "trainer.total_steps=3", "data.val_files=[]",
        "data.train_files=[synth:arith?split=train&levels=1&n=8]", "data.max_prompt_length=1024",
        f"trainer.default_local_dir={tmp_path}", "trainer.logger=[jsonl]"])
    trainer = RLTrainer(cfg, lm=tiny_lm, progress=False)
    assert seen == [Workload(8, 3, 16)]
    assert trainer.engine.name == "hf"


def test_the_table_follows_the_cpus_vector_width(monkeypatch, tmp_path):
    import builtins

    real_open = builtins.open

    def cpuinfo(flags: str):
        def fake(path, *a, **kw):
            if path == "/proc/cpuinfo":
                f = tmp_path / "cpuinfo"
                f.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
                return real_open(f, *a, **kw)
            return real_open(path, *a, **kw)
        return fake

    # This machine's table is the one in use (read at import, under this environment).
    assert auto.CPU_DECODE == auto.CPU_DECODE_BY_ISA[auto.cpu_isa()]
    from appo.rollout.cpu import cpuinfo as info

    def isa(flags: str) -> str:
        monkeypatch.setattr(builtins, "open", cpuinfo(flags))
        info.cpu_info.cache_clear()
        try:
            return auto.cpu_isa()
        finally:
            monkeypatch.setattr(builtins, "open", real_open)
            info.cpu_info.cache_clear()

    monkeypatch.delenv("NUMBA_CPU_FEATURES", raising=False)
    monkeypatch.delenv("NUMBA_CPU_NAME", raising=False)
    assert isa("fpu sse avx2 fma avx512f avx512bw") == "avx512"
    assert isa("fpu sse avx2 fma") == "avx2"
    # numba's own override of its target (`cpuinfo.avx2_environment`) wins over the flags.
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2,+fma,-avx512f")
    assert isa("fpu sse avx2 fma avx512f avx512bw") == "avx2"
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2,+avx512f")
    assert isa("fpu sse avx2 fma") == "avx512"
    monkeypatch.delenv("NUMBA_CPU_FEATURES")
    monkeypatch.setenv("NUMBA_CPU_NAME", "generic")
    assert isa("fpu sse avx2 fma avx512f") == "avx2"
    # Both tables hold the measured sizes.
    assert set(auto.CPU_DECODE_BY_ISA) == {"avx2", "avx512"}
    for table in auto.CPU_DECODE_BY_ISA.values():
        assert [r for r, _, _ in table] == [8, 32]

