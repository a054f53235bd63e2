"""Server mode's file-free weight sync against a scripted server whose workers are appo's
worker extension on fake vLLM workers (no vLLM): the trainer's side (`server_sync`) and the
workers' side (`weight_group.WeightGroupExtension`) meet in a real gloo group on 127.0.0.1.

Checked: every state-dict name arrives with the trainer's values in the server's dtype
(a tied weight broadcast once, loaded under both names), in buckets within the bound, with
no file written and the group joined once across pushes; the route `auto` picks (group
with the extension, file without, file for a GPU server the policy cannot reach) and `group`
refuses instead; each bad case is one line (no extension, port in use, a join that fails or
times out, a load that fails half-way, after which the group still works). The CUDA branch
(NCCL) with recording fakes of torch's NCCL group and device placement: which calls, on
which devices, in which dtypes, in which order. A real vLLM server: tests/with_vllm/
test_vllm_server_stream.py.
"""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from appo.errors import AppoError
from appo.http import JsonClient
from appo.rollout import server_sync, weight_group
from appo.rollout.server_sync import ServerWeightSync
from appo.rollout.weight_group import WeightGroupExtension, decode_manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "eval"))
from eval_server import Reply, ScriptedServer  # noqa: E402


class FakeWorker(WeightGroupExtension):
    """What the extension needs of a vLLM worker: device, rank, model config, and an
    in-place `reload_weights` (here: copies what it is given into `loaded`)."""

    def __init__(self, rank: int, device: str = "cpu", dtype=torch.float32,
                 fail_after: int | None = None):
        self.device, self.rank = torch.device(device) if device == "cpu" else device, rank
        self.model_config = SimpleNamespace(dtype=dtype)
        self.loaded: dict[str, torch.Tensor] = {}
        self.fail_after = fail_after
        self.reloads = 0

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool) -> None:
        assert is_checkpoint_format
        self.reloads += 1
        for i, (name, t) in enumerate(weights_iterator):
            if self.fail_after is not None and i == self.fail_after:
                self.fail_after = None  # fail once
                raise ValueError(f"no parameter named {name}")
            self.loaded[name] = t.clone()


# vLLM 0.32's two answers for a method no worker has (HTTP 500): the worker's AttributeError,
# or `run_method`'s NotImplementedError (vllm/v1/serial_utils.py); which one depends on the
# executor's path (the clean-clone CI got the second, a helper's run the first).
MISSING = {"attribute": "'Worker' object has no attribute '{method}'",
           "run_method": "Call to collective_rpc method failed: Method '{method}' is not "
                         "implemented."}


def serve(workers: list[FakeWorker], extension: bool = True,
          missing: str = "attribute") -> ScriptedServer:
    """A server whose /collective_rpc runs the method on every worker at once (threads, as
    vLLM's workers are separate processes) and answers as vLLM's dev route does."""
    def rpc(body: dict):
        method, kwargs = body["method"], body.get("kwargs", {})
        if not extension and method.startswith("appo_"):
            return Reply(500, {"error": MISSING[missing].format(method=method)})
        if method == "reload_weights":
            return {"results": [None] * len(workers)}
        results: list = [None] * len(workers)

        def run(i: int) -> None:
            try:
                results[i] = getattr(workers[i], method)(**kwargs)
            except Exception as e:  # noqa: BLE001 - the worker's error, as vLLM reports it
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            return Reply(500, {"error": str(errors[0])})
        return {"results": results}

    s = ScriptedServer()
    s.routes = {"/collective_rpc": rpc, "/reset_prefix_cache": lambda body: {"success": True}}
    return s


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def methods(server: ScriptedServer) -> list[str]:
    return [r.body.get("method", r.path) if r.path == "/collective_rpc" else r.path
            for r in server.requests if r.body is not None]


@pytest.fixture
def servers():
    made: list[ScriptedServer] = []
    yield lambda *a, **k: made.append(serve(*a, **k)) or made[-1]
    for s in made:
        s.close()


def make_sync(server, tmp_path, mode="auto", **kw) -> ServerWeightSync:
    return ServerWeightSync([server.url + "/v1"], str(tmp_path / "weights"), mode,
                            client=JsonClient(timeout=60.0, retries=0), join_timeout_s=20.0,
                            **kw)


def test_group_push_delivers_every_weight_in_bounded_buckets_without_a_file(
        servers, tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    workers = [FakeWorker(0), FakeWorker(1)]  # two workers: a tensor-parallel server
    server = servers(workers)
    model = tiny_model()
    sync = make_sync(server, tmp_path, bucket_bytes=4096)
    try:
        sync.sync(model)
        state = model.state_dict()
        assert "lm_head.weight" in state  # tied: the same tensor as the embedding
        for w in workers:
            assert set(w.loaded) == set(state)
            for name, t in state.items():
                assert w.loaded[name].dtype == torch.float32
                assert torch.equal(w.loaded[name], t), name
        unique = {id(p) for p in model.parameters()}
        tensor_bytes = sum(p.numel() * 4 for p in model.parameters())
        assert len(unique) < len(state) and sync.bytes_sent[sync.roots[0]] == tensor_bytes
        # buckets: one dtype each, within the bound unless a single tensor is larger
        [receive] = [r for r in server.requests if r.body and
                     r.body.get("method") == "appo_receive_weights"]
        buckets = decode_manifest(receive.body["kwargs"]["manifest"])
        assert len(buckets) > 2
        for b in buckets:
            assert b.numel * 4 <= 4096 or len(b.tensors) == 1
        names = [n for b in buckets for t in b.tensors for n in t.names]
        assert sorted(names) == sorted(state)  # each name once; the tie's two in one entry
        assert ("model.embed_tokens.weight", "lm_head.weight") in [
            t.names for b in buckets for t in b.tensors]

        # a second push after an update: no new join, the new values arrive
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight.mul_(2.0)
            model.model.embed_tokens.weight.add_(1.0)
        sync.sync(model)
        for w in workers:
            assert torch.equal(w.loaded["model.layers.1.mlp.down_proj.weight"],
                               model.model.layers[1].mlp.down_proj.weight)
            assert torch.equal(w.loaded["lm_head.weight"], model.model.embed_tokens.weight)
        assert methods(server) == [
            "appo_weight_group_info", "appo_join_weight_group", "appo_receive_weights",
            "/reset_prefix_cache", "appo_receive_weights", "/reset_prefix_cache"]
        assert sync.routes == {sync.roots[0]: "group"}
    finally:
        sync.close()
    assert methods(server)[-1] == "appo_close_weight_group"
    assert all(w._appo_group is None for w in workers)
    # no file: neither the weights dir nor anything in the temp dir
    # (torch may leave an empty dir of its own there)
    assert not (tmp_path / "weights").exists()
    assert [p for p in (tmp_path / "tmp").rglob("*") if p.is_file()] == []


def test_floating_weights_go_in_the_servers_dtype(servers, tmp_path):
    worker = FakeWorker(0, dtype=torch.bfloat16)
    server = servers([worker])
    model = tiny_model()
    sync = make_sync(server, tmp_path, mode="group")
    try:
        sync.sync(model)
    finally:
        sync.close()
    for name, t in model.state_dict().items():
        assert worker.loaded[name].dtype == torch.bfloat16
        assert torch.equal(worker.loaded[name], t.to(torch.bfloat16)), name
    assert sync.bytes_sent[sync.roots[0]] == sum(p.numel() * 2 for p in model.parameters())


@pytest.mark.parametrize("missing", sorted(MISSING))
def test_auto_without_the_extension_goes_through_a_file(servers, tmp_path, capsys, missing):
    server = servers([FakeWorker(0)], extension=False, missing=missing)
    sync = make_sync(server, tmp_path)
    sync.sync(tiny_model())
    assert sync.routes == {sync.roots[0]: "file"}
    assert (tmp_path / "weights" / "model.safetensors").is_file()
    assert methods(server) == ["appo_weight_group_info", "reload_weights",
                               "/reset_prefix_cache"]
    err = capsys.readouterr().err
    assert "through a file" in err and "--worker-extension-cls" in err


@pytest.mark.parametrize("missing", sorted(MISSING))
def test_group_without_the_extension_is_one_line(servers, tmp_path, missing):
    server = servers([FakeWorker(0)], extension=False, missing=missing)
    with pytest.raises(AppoError) as info:
        make_sync(server, tmp_path, mode="group").sync(tiny_model())
    message = str(info.value)
    assert "\n" not in message and "no appo worker extension" in message
    assert "--worker-extension-cls appo.rollout.weight_group.WeightGroupExtension" in message
    assert not (tmp_path / "weights").exists()


def test_file_mode_never_probes(servers, tmp_path):
    server = servers([FakeWorker(0)])
    make_sync(server, tmp_path, mode="file").sync(tiny_model())
    assert methods(server) == ["reload_weights", "/reset_prefix_cache"]


def test_a_port_in_use_is_one_line(servers, tmp_path):
    server = servers([FakeWorker(0)])
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        sync = make_sync(server, tmp_path, mode="group", port=port)
        with pytest.raises(AppoError) as info:
            sync.sync(tiny_model())
    message = str(info.value)
    assert "\n" not in message and f"port {port} is in use" in message
    assert "appo_join_weight_group" not in methods(server)  # nothing asked of the server


def test_a_failed_or_missing_join_is_one_line(servers, tmp_path):
    server = servers([FakeWorker(0)])
    # the server's join fails at once: seen without waiting for the timeout
    server.routes["/collective_rpc"] = lambda body, rpc=server.routes["/collective_rpc"]: (
        Reply(500, {"error": "connect() timed out"})
        if body["method"] == "appo_join_weight_group" else rpc(body))
    with pytest.raises(AppoError, match=r"could not join the weight-transfer group on "
                       r"127\.0\.0\.1:\d+: HTTP 500 .*connect\(\) timed out") as info:
        make_sync(server, tmp_path, mode="group").sync(tiny_model())
    assert "\n" not in str(info.value)

    # the server never reaches the store: the trainer gives up after join_timeout_s
    hung = servers([FakeWorker(0)])
    hung.routes["/collective_rpc"] = lambda body, rpc=hung.routes["/collective_rpc"]: (
        Reply(200, {"results": [None]}, delay=3.0)
        if body["method"] == "appo_join_weight_group" else rpc(body))
    sync = ServerWeightSync([hung.url], None, "group", join_timeout_s=0.5)
    with pytest.raises(AppoError, match=r"did not join the weight-transfer group on "
                       r"127\.0\.0\.1:\d+ within 0\.5 s .*rollout\.weight_transfer=file"):
        sync.sync(tiny_model())


def test_a_load_failing_half_way_is_one_line_and_the_group_still_works(servers, tmp_path):
    worker = FakeWorker(0, fail_after=3)
    server = servers([worker])
    model = tiny_model()
    sync = make_sync(server, tmp_path, mode="group", bucket_bytes=1024)
    try:
        with pytest.raises(AppoError) as info:
            sync.sync(model)
        message = str(info.value)
        assert "\n" not in message and "failed to load the weights" in message
        assert "no parameter named" in message and "restart it" in message
        # the worker received the rest of the broadcast, so the group is in step: the
        # next push goes through the same group
        sync.sync(model)
        assert set(worker.loaded) == set(model.state_dict()) and worker.reloads == 2
        assert methods(server).count("appo_join_weight_group") == 1
    finally:
        sync.close()


def test_unknown_mode_is_one_line(tmp_path):
    with pytest.raises(AppoError, match="rollout.weight_transfer must be one of auto, file, "
                       "group, got 'nccl'"):
        ServerWeightSync(["http://127.0.0.1:9"], None, "nccl")


# ---------------------------------------------------------------- CUDA: recording fakes
class FakeNccl:
    """`torch.distributed.ProcessGroupNCCL` over an in-process wire: rank 0's broadcast is
    queued for every other rank; every call is recorded."""

    calls: list[tuple] = []
    wires: dict[int, list] = {}
    cond = threading.Condition()

    class Options:
        def __init__(self):
            self._timeout = None

    def __init__(self, store, rank, size, opts):
        self.rank, self.size = rank, size
        FakeNccl.calls.append(("ProcessGroupNCCL", rank, size, opts._timeout is not None))

    def broadcast(self, tensors, opts):
        [t] = tensors
        FakeNccl.calls.append(("broadcast", self.rank, opts.rootRank, t.dtype, t.numel()))
        with FakeNccl.cond:
            if self.rank == 0:
                for r in range(1, self.size):
                    FakeNccl.wires.setdefault(r, []).append(t.clone())
                FakeNccl.cond.notify_all()
            else:
                FakeNccl.cond.wait_for(lambda: FakeNccl.wires.get(self.rank))
                t.copy_(FakeNccl.wires[self.rank].pop(0))
        return SimpleNamespace(wait=lambda: True)


@pytest.fixture
def fake_cuda(monkeypatch):
    FakeNccl.calls, FakeNccl.wires = [], {}
    placed: list[tuple] = []
    # raising=False: a CPU build of torch has no ProcessGroupNCCL at all
    monkeypatch.setattr(torch.distributed, "ProcessGroupNCCL", FakeNccl, raising=False)
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: FakeNccl.calls.append(("set_device", str(d))))

    def to_device(t, device, dtype):
        placed.append(("to", str(device), dtype))
        return t.to(dtype=dtype).contiguous()  # stays on the CPU: no GPU here

    def empty_on(numel, dtype, device):
        placed.append(("empty", str(device), dtype))
        return torch.empty(numel, dtype=dtype)

    monkeypatch.setattr(weight_group, "to_device", to_device)
    monkeypatch.setattr(weight_group, "empty_on", empty_on)
    return placed


def test_a_gpu_server_gets_the_weights_over_nccl_from_the_policys_gpu(
        servers, tmp_path, monkeypatch, fake_cuda):
    monkeypatch.setattr(server_sync, "policy_device", lambda m: torch.device("cuda", 1))
    worker = FakeWorker(0, device="cuda:0", dtype=torch.bfloat16)
    server = servers([worker])
    model = tiny_model()
    sync = make_sync(server, tmp_path, bucket_bytes=2048)
    try:
        sync.sync(model)
    finally:
        sync.close()
    calls = FakeNccl.calls
    # each side sets its own GPU before making its communicator (2 ranks), then only
    # broadcasts rooted at the trainer
    setup = [c for c in calls if c[0] in ("set_device", "ProcessGroupNCCL")]
    assert sorted(setup) == sorted([("set_device", "cuda:1"), ("ProcessGroupNCCL", 0, 2, True),
                                    ("set_device", "cuda:0"), ("ProcessGroupNCCL", 1, 2, True)])
    for rank, device in ((0, "cuda:1"), (1, "cuda:0")):
        mine = [c for c in calls if c[0] == "set_device" and c[1] == device or
                c[0] != "set_device" and c[1] == rank]
        assert mine[0] == ("set_device", device) and mine[1][0] == "ProcessGroupNCCL"
    sends = [c for c in calls if c[0] == "broadcast" and c[1] == 0]
    receives = [c for c in calls if c[0] == "broadcast" and c[1] == 1]
    buckets = decode_manifest([r for r in server.requests if r.body and r.body.get(
        "method") == "appo_receive_weights"][0].body["kwargs"]["manifest"])
    assert [c[2:] for c in sends] == [c[2:] for c in receives] == [
        (0, torch.bfloat16, b.numel) for b in buckets]
    # the trainer's tensors go to its GPU in the server's dtype; the worker's buffers are
    # made on the worker's GPU in that dtype
    assert {p for p in fake_cuda if p[0] == "to"} == {("to", "cuda:1", torch.bfloat16)}
    assert {p for p in fake_cuda if p[0] == "empty"} == {("empty", "cuda:0", torch.bfloat16)}
    assert len([p for p in fake_cuda if p[0] == "empty"]) == len(buckets)
    for name, t in model.state_dict().items():
        assert torch.equal(worker.loaded[name], t.to(torch.bfloat16)), name
    # weights before the prefix-cache reset, the group closed last
    assert methods(server) == ["appo_weight_group_info", "appo_join_weight_group",
                               "appo_receive_weights", "/reset_prefix_cache",
                               "appo_close_weight_group"]


def test_a_gpu_server_and_a_cpu_policy_fall_back_to_the_file_or_refuse(
        servers, tmp_path, capsys):
    server = servers([FakeWorker(0, device="cuda:0")])
    sync = make_sync(server, tmp_path)
    sync.sync(tiny_model())
    assert sync.routes == {sync.roots[0]: "file"}
    assert "NCCL needs the trainer's tensors on a GPU" in capsys.readouterr().err
    with pytest.raises(AppoError, match=r"^rollout.weight_transfer=group: .*on cuda:0 and the "
                       r"policy on cpu: NCCL needs .*weight_transfer=file$"):
        make_sync(server, tmp_path, mode="group").sync(tiny_model())


def test_the_config_key_reaches_the_trainers_engine(servers, tmp_path):
    """`rollout.weight_transfer` from the config to `build_engine`'s server engine, whose
    `sync_weights` (the trainer's call) then takes that route."""
    from appo.config import load_config
    from appo.rollout import build_engine

    worker = FakeWorker(0)
    server = servers([worker])
    lm = SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=None))
    model = tiny_model()
    for mode, route in (("group", "group"), ("file", "file")):
        cfg = load_config(overrides=[
            "model.path=tiny-test", "rollout.name=openai", f"rollout.base_urls=['{server.url}']",
            f"rollout.weight_transfer={mode}", f"trainer.default_local_dir={tmp_path / mode}"])
        engine = build_engine(cfg, lm)
        assert engine.weight_transfer == mode
        try:
            engine.sync_weights(model)
            assert engine.weight_sync.routes == {server.url: route}
        finally:
            engine.close()
        written = (tmp_path / mode / "rollout_weights" / "model.safetensors").is_file()
        assert written == (mode == "file")
    assert set(worker.loaded) == set(model.state_dict())
