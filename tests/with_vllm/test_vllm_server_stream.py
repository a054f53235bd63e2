"""Weights to a real `vllm serve` without a file: appo's worker extension and a gloo group.

One server for the module (a random 2-layer Llama, float32, CPU, 127.0.0.1), started with
`--worker-extension-cls appo.rollout.weight_group.WeightGroupExtension`, this tree's `appo`
first on its PYTHONPATH (checked: the probe names the file it was loaded from) and its own
temp dir. It checks that:
- `ServerWeightSync` with `rollout.weight_transfer=auto` picks the group for a local server
  with the extension, and after a push of a changed policy the server's log-probs equal a
  full HF forward of the same ids with the new weights (and moved far more than the
  tolerance), then equal the old ones after a push back;
- no file is written on either side: the trainer's temp dir and weights dir, the server's
  temp dir and model dir are the same before and after the pushes (names, sizes, times);
- the OpenAI engine's `sync_weights` (the trainer's call) goes the same way;
- `appo train rollout.name=openai rollout.weight_transfer=group` trains against the server:
  step 2 samples from the step-1 policy, pushed without a file;
- vLLM's answer for a method its workers lack is read as "no extension" (what a server
  started without it answers to the probe).

Tolerance as in test_vllm_server.py: float32 on both sides, different summation orders
(3e-5 measured); TOL = 1e-3, far below what the change moves (~0.3 mean).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from appo.http import endpoint
from conftest import hf_logprobs, max_gap  # tests/with_vllm/conftest.py

pytestmark = pytest.mark.vllm

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
TOL = 1e-3
REQUEST_TIMEOUT_S = 900
STARTUP_TIMEOUT_S = float(os.environ.get("APPO_VLLM_STARTUP_TIMEOUT", "1800"))
SCORED_TEXT = ("The capital of France is Paris. The capital of Germany is Berlin. Two plus two "
               "equals four, and the sky is blue.")
CHANGED = "model.layers.1.mlp.down_proj.weight"


def snapshot(*dirs: Path) -> dict[str, tuple[int, int]]:
    """Every file under `dirs`: path -> (size, mtime in ns)."""
    files = {}
    for d in dirs:
        for p in d.rglob("*"):
            if p.is_file():
                st = p.stat()
                files[str(p)] = (st.st_size, st.st_mtime_ns)
    return files


@pytest.fixture(scope="module")
def stream_server(tmp_path_factory, tiny_llama_dir):
    """A `vllm serve` of the random 2-layer Llama (`tiny_llama.py`): what is pushed and
    compared does not depend on the model's size, the start and the training do."""
    from appo.errors import AppoError
    from appo.rollout.vllm_server import wait_for_server
    from conftest import _stop, free_port  # tests/with_vllm/conftest.py

    model = tiny_llama_dir
    base = tmp_path_factory.mktemp("vllm-stream")
    server_tmp = base / "server-tmp"
    server_tmp.mkdir()
    log = base / "server.log"
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "TMPDIR": str(server_tmp),
           # this tree's appo is the one the server's workers import the extension from
           "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", "--seed", "0", "--logprobs-mode", "processed_logprobs",
           "--worker-extension-cls", "appo.rollout.weight_group.WeightGroupExtension"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, timeout=STARTUP_TIMEOUT_S, poll_s=2.0, process=proc)
    except AppoError as e:
        _stop(proc)
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
        pytest.fail(f"{e}\n--- {log} (tail) ---\n{tail}", pytrace=False)
    try:
        yield {"url": url, "model": str(model), "tmp": server_tmp, "log": log}
    finally:
        _stop(proc)


def _server_logprobs(server, ids: list[int]) -> list[float]:
    body = {"model": server["model"], "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0,
            "temperature": 0.0}
    req = urllib.request.Request(endpoint(server["url"], "completions"),
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        rows = json.loads(r.read())["choices"][0]["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(ids)
    return [row[str(tok)]["logprob"] for tok, row in zip(ids[1:], rows[1:], strict=True)]


def test_group_push_serves_the_new_weights_with_no_file(stream_server, tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from appo.http import JsonClient
    from appo.rollout.openai_engine import OpenAICompletionsEngine
    from appo.rollout.server_sync import ServerWeightSync
    from appo.rollout.vllm_server import probe_extension

    trainer_tmp = tmp_path / "trainer-tmp"
    trainer_tmp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(trainer_tmp))
    weights_dir = tmp_path / "rollout_weights"
    model_dir = Path(stream_server["model"])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer.encode(SCORED_TEXT, add_special_tokens=False)

    # the extension is loaded (from this tree: the server's PYTHONPATH starts with it)
    [info] = probe_extension(stream_server["url"], JsonClient(timeout=60.0, retries=0))
    assert info["device"] == "cpu" and info["dtype"] == "float32"
    assert Path(info["source"]).resolve() == SRC / "appo" / "rollout" / "weight_group.py"

    old_hf = hf_logprobs(model, ids)
    old_server = _server_logprobs(stream_server, ids)
    before = snapshot(trainer_tmp, tmp_path, stream_server["tmp"], model_dir)
    sync = ServerWeightSync([stream_server["url"] + "/v1"], str(weights_dir), "auto")
    try:
        with torch.no_grad():
            model.get_parameter(CHANGED).mul_(2.0)
        sync.sync(model)
        assert sync.routes == {stream_server["url"]: "group"}
        new_server = _server_logprobs(stream_server, ids)
        new_hf = hf_logprobs(model, ids)

        # back through the trainer's own call (the engine's sync_weights)
        with torch.no_grad():
            model.get_parameter(CHANGED).div_(2.0)
        engine = OpenAICompletionsEngine(stream_server["url"], tokenizer,
                                         model=stream_server["model"],
                                         weights_dir=str(weights_dir))
        engine.sync_weights(model)
        assert engine.weight_sync.routes == {stream_server["url"]: "group"}
        restored = _server_logprobs(stream_server, ids)
        engine.close()
    finally:
        sync.close()
    after = snapshot(trainer_tmp, tmp_path, stream_server["tmp"], model_dir)
    moved = [abs(a - b) for a, b in zip(new_server, old_server, strict=True)]
    print(f"\ngroup push {sync.seconds[stream_server['url']]:.2f} s, "
          f"{sync.bytes_sent[stream_server['url']] / 1e6:.0f} MB sent; server vs hf: old "
          f"{max_gap(old_server, old_hf):.2e}, new {max_gap(new_server, new_hf):.2e}; moved "
          f"{sum(moved) / len(moved):.3f} mean, {max(moved):.3f} max")
    assert after == before, set(after) ^ set(before)  # no file written on either side
    assert not weights_dir.exists()
    assert max_gap(old_server, old_hf) <= TOL
    assert max_gap(new_server, new_hf) <= TOL  # the server computes the pushed weights
    assert max(moved) > 100 * TOL and sum(moved) / len(moved) > 10 * TOL
    assert max_gap(restored, old_hf) <= TOL
    # the whole model went once: every parameter, the tied LM head not twice
    assert sync.bytes_sent[stream_server["url"]] == sum(
        p.numel() * 4 for p in model.parameters())


def test_a_server_without_the_method_reads_as_no_extension(stream_server):
    """vLLM's answer to a method its workers lack (HTTP 500, "... has no attribute ...") is
    what `probe_extension` reads as "no extension" (auto: file; group: refused in one line,
    tests/rollout/test_rollout_vllm_server_group.py); any other failure is an error."""
    from appo.http import JsonClient
    from appo.rollout.vllm_server import probe_extension

    client = JsonClient(timeout=60.0, retries=0)
    assert probe_extension(stream_server["url"], client, "appo_no_such_method") is None
    assert probe_extension(stream_server["url"], client) is not None


def test_train_against_the_server_pushes_the_policy_through_the_group(stream_server,
                                                                     tmp_path):
    """`appo train rollout.name=openai rollout.weight_transfer=group`: after each update the
    trainer broadcasts the policy (a fresh join: the earlier tests closed theirs), so step
    2's rollout log-probs are the step-1 checkpoint's, and no weights dir is written."""
    from appo.cli import main
    from appo.models import load_model
    from appo.rollout.records import read_jsonl

    out = tmp_path / "run"
    args = ["train", f"model.path={stream_server['model']}", "rollout.name=openai",
            f"rollout.base_urls=['{stream_server['url']}']", "rollout.weight_transfer=group",
            "rollout.strategy=grpo", "rollout.n=2", "data.template=math",
            "tools.enabled=[python]",
            "data.train_files=['synth:arith?split=train&levels=1&n=8']",
            "data.train_batch_size=2", "data.max_response_length=48",
            # the entropy bonus keeps the update non-zero when a group's advantages are 0
            "actor.optim.lr=1e-4", "actor.entropy_coeff=0.01", "trainer.save_freq=1",
            "trainer.total_steps=2", f"trainer.default_local_dir={out}",
            f"trainer.rollout_data_dir={out / 'rollouts'}"]
    assert main(args) == 0
    assert not (out / "rollout_weights").exists()  # the file route's dir: never made
    trajs = read_jsonl(out / "rollouts" / "step_00002.jsonl")
    gaps = {}
    for name, path in (("step1", out / "global_step_1"), ("base", stream_server["model"])):
        model = load_model(str(path), device="cpu").model
        worst = 0.0
        for t in trajs:
            hf = hf_logprobs(model, t.prompt_ids + t.response_ids)
            p = len(t.prompt_ids)
            for k, sampled in enumerate(t.sampled_mask()):
                if sampled and t.logp_rollout[k] != 0.0:  # 0: the engine's own stop tokens
                    worst = max(worst, abs(hf[p + k - 1] - t.logp_rollout[k]))
        gaps[name] = worst
    assert gaps["step1"] <= TOL, gaps
    assert gaps["base"] > 10 * TOL, gaps  # a server that missed the push would be stale
