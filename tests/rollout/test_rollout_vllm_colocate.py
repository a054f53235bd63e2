"""The vllm engine's GPU branches with recording fakes of vLLM's API (no vLLM, no GPU).

What only a GPU run with vLLM would show, checked as calls: the engine options per device
and process group (external launcher in each rank, sleep mode, max_model_len, one seed per
tensor-parallel group), weights streamed one tensor at a time in the engine's dtype with
no file, and the trainer's order: weights before the first token, sleep before the update,
wake before the rollout. Also the version check and the per-request seeds switch.
"""

from __future__ import annotations

import sys
import tempfile
from types import ModuleType, SimpleNamespace

import pytest
import torch

from appo.config import load_config
from appo.errors import AppoError
from appo.rollout import vllm_engine
from appo.rollout.sampling import SamplingParams
from appo.rollout.vllm_engine import VLLMEngine, check_vllm_version, stream_weights


def test_version_check_names_installed_and_needed():
    assert check_vllm_version("0.32.0") is None
    assert check_vllm_version("0.32.1+cpu") is None
    with pytest.raises(AppoError, match=r"vLLM 0\.31\.2 is older .*vllm>=0\.32,<0\.33"):
        check_vllm_version("0.31.2")
    with pytest.raises(AppoError, match="cannot read"):
        check_vllm_version("dev")
    assert "newer" in check_vllm_version("0.34.0")


class FakeVllmModule(ModuleType):
    """`vllm` with an `LLM` that records its keyword arguments."""

    def __init__(self, version: str = "0.32.0"):
        super().__init__("vllm")
        self.__version__ = version
        self.made: list[dict] = []
        made = self.made

        class LLM:
            def __init__(self, **kwargs):
                made.append(kwargs)

        self.LLM = LLM


@pytest.fixture
def fake_vllm(monkeypatch):
    mod = FakeVllmModule()
    monkeypatch.setitem(sys.modules, "vllm", mod)
    for var in ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    import transformers

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: SimpleNamespace(max_position_embeddings=2048))
    return mod


def _cfg(*extra):
    return load_config(overrides=["model.path=tiny-test", "data.max_prompt_length=300",
                                  "data.max_response_length=200", "rollout.seed=5", *extra])


def _world(monkeypatch, cuda: bool, rank: int | None):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: rank is not None)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank or 0)


def test_on_cuda_under_a_process_group_each_rank_colocates_an_engine(fake_vllm, monkeypatch):
    import os

    _world(monkeypatch, cuda=True, rank=3)
    vllm_engine.start_llm(_cfg("rollout.tensor_model_parallel_size=2"))
    (kw,) = fake_vllm.made
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine in this rank
    assert kw["enable_sleep_mode"] is True  # null: on with CUDA
    assert kw["max_model_len"] == 500
    assert kw["seed"] == 5 + 3 // 2  # ranks 2 and 3 form one tensor-parallel group
    assert "enable_chunked_prefill" not in kw


def test_on_cpu_under_a_process_group_each_rank_colocates_too(fake_vllm, monkeypatch):
    import os

    _world(monkeypatch, cuda=False, rank=1)
    vllm_engine.start_llm(_cfg())
    (kw,) = fake_vllm.made
    assert kw["distributed_executor_backend"] == "external_launcher"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert "enable_sleep_mode" not in kw and kw["max_model_len"] == 500
    assert kw["enable_chunked_prefill"] is False and kw["max_num_batched_tokens"] == 4096


def test_one_process_keeps_the_engine_here_and_sleep_mode_follows_the_key(fake_vllm,
                                                                          monkeypatch):
    _world(monkeypatch, cuda=True, rank=None)
    vllm_engine.start_llm(_cfg("rollout.enable_sleep_mode=false"))
    (kw,) = fake_vllm.made
    assert "distributed_executor_backend" not in kw and "enable_sleep_mode" not in kw
    assert kw["seed"] == 5


def test_an_old_vllm_is_refused_before_it_starts(fake_vllm, monkeypatch):
    fake_vllm.__version__ = "0.20.0"
    _world(monkeypatch, cuda=True, rank=None)
    with pytest.raises(AppoError, match="0.20.0 is older"):
        vllm_engine.start_llm(_cfg())
    assert fake_vllm.made == []


class RecordingLLM:
    """The parts of `vllm.LLM` a sync and sleep mode use, recorded in order; the weights
    iterator is consumed as vLLM consumes it, one tensor at a time."""

    def __init__(self, dtype=torch.bfloat16):
        self.events: list[tuple] = []
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype))

    def collective_rpc(self, method, kwargs):
        it = kwargs["weights_iterator"]
        assert not isinstance(it, (list, tuple, dict))  # streamed, not materialised
        for name, t in it:
            self.events.append(("weight", name, t.dtype, t.device.type))
        self.events.append((method,))

    def reset_prefix_cache(self):
        self.events.append(("reset_prefix_cache",))

    def sleep(self, level):
        self.events.append(("sleep", level))

    def wake_up(self, tags=None):
        self.events.append(("wake_up", tuple(tags)))


def _tiny():
    from appo.models import load_model

    return load_model("tiny-test", device="cpu")


def test_weights_stream_in_the_engine_dtype_without_a_file(monkeypatch):
    lm = _tiny()
    llm = RecordingLLM()
    eng = VLLMEngine(llm, lm.tokenizer)

    def no_files(*a, **k):
        raise AssertionError("a weight sync in this process must not write a file")

    monkeypatch.setattr(tempfile, "mkdtemp", no_files)
    eng.sync_weights(lm.model)
    weights = [e for e in llm.events if e[0] == "weight"]
    names = [e[1] for e in weights]
    # The state dict's names: a tied head under its own name too (vLLM's reload keeps the old
    # tensor of a layer that receives nothing), no non-persistent buffer.
    assert names == list(lm.model.state_dict().keys())
    assert "lm_head.weight" in names and lm.model.config.tie_word_embeddings
    assert {e[2] for e in weights} == {torch.bfloat16}
    assert llm.events[len(weights):] == [("reload_weights",), ("reset_prefix_cache",)]
    assert eng.weight_syncs == 1


def test_stream_gathers_a_sharded_parameter_only_when_asked():
    gathered = []

    class Sharded(torch.nn.Parameter):
        def full_tensor(self):
            gathered.append(1)
            return self.data * 2  # the "other shard"

    m = torch.nn.Linear(2, 2)
    m.weight = Sharded(torch.ones(2, 2))
    it = stream_weights(m, torch.float16)
    assert gathered == []
    name, t = next(it)
    assert name == "weight" and gathered == [1]
    assert t.dtype == torch.float16 and torch.equal(t, torch.full((2, 2), 2.0,
                                                                   dtype=torch.float16))


def test_sleep_and_wake_order_on_the_engine():
    lm = _tiny()
    llm = RecordingLLM()
    eng = VLLMEngine(llm, lm.tokenizer, sleeps=True)
    eng.sleep()
    eng.sleep()  # idempotent
    eng.wake(lm.model)
    kinds = [e[0] if e[0] != "wake_up" else e for e in llm.events]
    first_weight = kinds.index("weight")
    assert kinds[:first_weight] == ["sleep", ("wake_up", ("weights",))]
    assert kinds[-3:] == ["reload_weights", "reset_prefix_cache", ("wake_up", ("kv_cache",))]
    eng.wake()  # awake already: nothing
    assert llm.events[-1] == ("wake_up", ("kv_cache",))
    # Without sleep mode neither call reaches vLLM.
    quiet = RecordingLLM()
    VLLMEngine(quiet, lm.tokenizer).sleep()
    assert quiet.events == []


def test_request_seeds_switch():
    tok = _tiny().tokenizer
    seeded = VLLMEngine(SimpleNamespace(), tok, sampling_params_factory=dict)
    unseeded = VLLMEngine(SimpleNamespace(), tok, sampling_params_factory=dict,
                          request_seeds=False)
    p = SamplingParams()
    assert isinstance(seeded._params(p, 4)["seed"], int)
    assert unseeded._params(p, 4)["seed"] is None
    cfg = _cfg()
    assert vllm_engine.request_seeds(cfg, on_cpu=True) is True
    assert vllm_engine.request_seeds(cfg, on_cpu=False) is False
    assert vllm_engine.request_seeds(_cfg("rollout.request_seeds=true"), on_cpu=False) is True
