"""GPU-aware memory without a GPU: CUDA's allocator calls faked and recorded."""

from __future__ import annotations

import torch

from appo.trainer import memory
from appo.trainer.metrics import StepTimer


def _fake_cuda(monkeypatch, peaks: list[int], calls: list[str]):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: peaks.pop(0))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))


def test_each_phase_records_its_own_cuda_peak(monkeypatch):
    calls: list[str] = []
    _fake_cuda(monkeypatch, [3 * 2**30, 7 * 2**30, 2 * 2**30], calls)
    timer = StepTimer()
    with timer.measure("rollout"):
        pass
    with timer.measure("update"):
        pass
    with timer.measure("update"):  # a phase measured twice keeps its larger peak
        pass
    assert timer.cuda_peak_gb == {"rollout": 3.0, "update": 7.0}
    assert calls == ["reset"] * 3  # the peak counter restarts with every phase


def test_no_cuda_no_peaks():
    timer = StepTimer()
    with timer.measure("rollout"):
        pass
    if not torch.cuda.is_available():
        assert timer.cuda_peak_gb == {}


def test_the_cache_is_released_between_rollout_and_update(monkeypatch):
    calls: list[str] = []
    _fake_cuda(monkeypatch, [], calls)
    memory.trim_freed_memory()
    assert calls == ["empty_cache"]


def test_checkpointing_says_it_turns_the_shared_prefix_forward_off(monkeypatch):
    from appo.config import load_config
    from appo.models import load_model

    said: list[str] = []
    monkeypatch.setattr("appo.errors.warn_once", said.append)
    cfg = load_config(overrides=["model.path=tiny-test"])
    lm = load_model("tiny-test", device="cpu")
    memory.memory_options(lm.model, cfg.actor, False)
    assert said == []  # no checkpointing: nothing to say
    lm.model.gradient_checkpointing_enable()
    memory.memory_options(lm.model, cfg.actor, False)
    assert len(said) == 1 and "share_prefix_forward" in said[0]


def _fake_node(monkeypatch, gpus: int = 8, gib: float = 80.0):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: SimpleNamespace(total_memory=int(gib * 2**30)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


def test_startup_plan_passes_the_published_7b_run_under_fsdp_and_refuses_ddp(monkeypatch):
    import pytest

    from appo.config import load_config
    from appo.errors import AppoError
    from appo.trainer.plan_run import startup_plan

    _fake_node(monkeypatch)
    cfg = load_config("configs/arpo_qwen2.5_7b_reasoning.yaml")
    plan = startup_plan(cfg, world=8, fsdp=True)
    assert plan is not None and plan.fits and plan.inputs.world == 8
    with pytest.raises(AppoError, match=r"memory plan: does not fit.*AdamW.*skip_memory_plan"):
        startup_plan(cfg, world=8, fsdp=False)
    skip = load_config("configs/arpo_qwen2.5_7b_reasoning.yaml",
                       overrides=["trainer.skip_memory_plan=true"])
    assert not startup_plan(skip, world=8, fsdp=False).fits  # planned, and let through


def test_no_plan_on_cpu():
    from appo.config import load_config
    from appo.trainer.plan_run import startup_plan

    if not torch.cuda.is_available():
        assert startup_plan(load_config(overrides=["model.path=tiny-test"]), 1, False) is None


def test_the_trainer_plans_before_it_loads_the_model(monkeypatch, tmp_path):
    import pytest

    from appo.config import load_config
    from appo.errors import AppoError
    from appo.trainer import plan_run

    events = []

    def refuse(cfg, world, fsdp):
        events.append(("plan", world, fsdp))
        raise AppoError("memory plan: does not fit (test)")

    monkeypatch.setattr(plan_run, "startup_plan", refuse)
    monkeypatch.setattr("appo.models.load_model", lambda *a, **k: events.append("load"))
    cfg = load_config(overrides=["model.path=tiny-test",
                                 f"trainer.default_local_dir={tmp_path / 'run'}"])
    from appo.trainer.loop import RLTrainer

    with pytest.raises(AppoError, match="does not fit"):
        RLTrainer(cfg, progress=False)
    assert events == [("plan", 1, False)]
