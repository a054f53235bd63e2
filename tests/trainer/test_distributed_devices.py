"""The process group on GPUs, without a GPU: recording fakes of torch.distributed / CUDA.

What only an 8-GPU node would show: each rank pinned to its LOCAL_RANK device before the
group starts (`device_id`), a CPU backend beside NCCL for the object and CPU collectives,
every collective's tensor on a device its backend serves, and the model on the rank's
device whatever `model.device` says. (The gradient sum is torch's DDP: test_ddp_sync.py.)
"""

from __future__ import annotations

import pytest
import torch

from appo.trainer import distributed
from appo.trainer.distributed import DataParallel, init_process_group, rank_device


class FakeDist:
    """Records the calls; each collective checks its tensor against the group's backends
    as torch dispatches them ("cpu:gloo,cuda:nccl" -> {"cpu": "gloo", "cuda": "nccl"}; a
    bare "nccl" serves CUDA only), and a CUDA tensor against this rank's device."""

    class ReduceOp:
        MAX = "max"
        SUM = "sum"

    def __init__(self, local_rank: int = 0):
        self.calls: list[tuple] = []
        self.backends: dict[str, str] = {}
        self.local_rank = local_rank
        self.current_device: torch.device | None = None

    def init_process_group(self, backend: str, **kwargs):
        self.calls.append(("init", backend, kwargs, self.current_device))
        if ":" in backend:
            self.backends = dict(pair.split(":") for pair in backend.split(","))
        else:
            self.backends = {"cuda": backend} if backend == "nccl" else {"cpu": backend}

    def _check(self, t: torch.Tensor, name: str):
        kind = t.device.type
        if kind not in self.backends:
            raise RuntimeError(f"{name}: no backend for {kind} tensors in {self.backends}")
        if kind == "cuda" and t.device.index != self.local_rank:
            raise RuntimeError(f"{name}: tensor on {t.device}, rank's device cuda:{self.local_rank}")
        self.calls.append((name, kind, t.dtype, t.numel()))

    def all_reduce(self, t: torch.Tensor, op=None):
        self._check(t, "all_reduce")
        if op != self.ReduceOp.MAX:  # two ranks holding the same values
            t.mul_(2)

    def all_gather_object(self, parts: list, obj):
        # torch sends objects over the CPU backend when the group has one, else over the
        # current CUDA device (the bare-NCCL case: cuda:0 unless set_device was called).
        if "cpu" not in self.backends:
            device = self.current_device or torch.device("cuda", 0)
            if device.index != self.local_rank:
                raise RuntimeError(f"all_gather_object on {device}, rank's device "
                                   f"cuda:{self.local_rank}")
        self.calls.append(("all_gather_object",))
        for i in range(len(parts)):
            parts[i] = obj


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA 'available' with 8 devices; set_device recorded into the fake process group."""
    fake = FakeDist(local_rank=3)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: setattr(fake, "current_device", torch.device(d)))
    monkeypatch.setattr(torch.distributed, "init_process_group", fake.init_process_group)
    return fake


def test_init_pins_the_rank_device_before_the_group_with_a_cpu_backend(fake_cuda):
    init_process_group()
    (name, backend, kwargs, device_at_init), = fake_cuda.calls
    assert name == "init"
    assert backend == "cpu:gloo,cuda:nccl"
    assert kwargs["device_id"] == torch.device("cuda", 3)
    assert device_at_init == torch.device("cuda", 3)  # set before the group exists


def test_init_on_cpu_is_plain_gloo_without_a_device(monkeypatch):
    fake = FakeDist()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", fake.init_process_group)
    init_process_group()
    assert fake.calls == [("init", "gloo", {}, None)]


def _dp(fake: FakeDist) -> DataParallel:
    dp = DataParallel.__new__(DataParallel)
    dp.dist, dp.enabled, dp.rank, dp.world = fake, True, 3, 8
    return dp


def test_every_collective_goes_to_a_backend_that_serves_its_tensor(fake_cuda):
    init_process_group()
    dp = _dp(fake_cuda)
    assert dp.max_int(5) == 5
    assert dp.sum_floats([1.0, 2.5]) == [2.0, 5.0]
    assert dp.gather_objects(["a"]) == ["a"] * 8
    kinds = [c[1] for c in fake_cuda.calls if c[0] == "all_reduce"]
    assert kinds == ["cpu", "cpu"]  # counts and normalisers: gloo


def test_the_fake_refuses_what_nccl_alone_would(monkeypatch):
    """The old group (`init_process_group("nccl")`, no set_device): CPU all-reduces and
    object gathers on cuda:0 are refused, so the test above can fail."""
    fake = FakeDist(local_rank=3)
    fake.init_process_group("nccl")
    dp = _dp(fake)
    with pytest.raises(RuntimeError, match="no backend for cpu"):
        dp.max_int(5)
    with pytest.raises(RuntimeError, match="cuda:0"):
        dp.gather_objects(["a"])


@pytest.mark.parametrize("requested", ["auto", "cuda", "cuda:0", "cuda:5"])
def test_a_rank_trains_on_its_own_device_whatever_model_device_says(fake_cuda, requested):
    assert rank_device(requested, distributed=True) == "cuda:3"


def test_rank_device_leaves_cpu_and_single_process_runs_alone(fake_cuda):
    assert rank_device("cpu", distributed=True) == "cpu"
    assert rank_device("cuda", distributed=False) == "cuda"
    assert rank_device("auto", distributed=False) == "auto"


def test_from_env_starts_the_group_through_init_process_group(monkeypatch):
    seen = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed, "init_process_group", lambda: seen.append("init"))
    monkeypatch.setattr(distributed.atexit, "register", lambda fn: None)
    dp = DataParallel.from_env()
    assert seen == ["init"] and not dp.enabled  # the fake started nothing
