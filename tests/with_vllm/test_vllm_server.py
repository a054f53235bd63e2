"""Server mode against a real `vllm serve` of SmolLM2-135M (float32, CPU) on 127.0.0.1.

One server for the module (`vllm_server` in conftest.py; one start costs 80-100 s, so
every test that needs a served model lives here). It checks that:
- the deep-search page step summarises with the server (SmolLM2-135M's tokenizer has no chat
  template, so the summariser sends the prompt as is, `api: completions`; greedy and short):
  the request is accepted, the text after `**Final Information**` (or the whole output)
  becomes the result, and a replay with the server out of reach and miss_policy=fail gives
  identical results (first: it needs no particular weights, the later tests change them);
- the OpenAI engine takes the server's sampled token ids (token out): a segment stopped by a
  stop string that ends inside a token keeps the completing token, as the hf engine does;
- the tool loop runs several turns on the server (a few-shot prompt that makes the model
  call the python tag) and greedy gives the same tokens, segments and calls as the local hf
  engine, each segment equal to a direct completions request;
- `appo eval --base-url` records the server's ids and log-probs (equal to direct
  completions requests of each model segment) and, greedy, gives the same samples and
  summary as `appo eval` on the local hf engine;
- `reload_server_weights` makes the server compute the log-probs of a modified checkpoint
  (equal to the hf model's on the same weights), then restores the original weights;
- `appo train rollout.name=openai` trains against the server: after each update the server
  reloads the policy, so step 2's rollout log-probs are those of the step-1 checkpoint.

Tolerance for log-probs, float32 on both sides: vLLM's CPU kernels and torch's (HF) sum in
different orders; on this model the gap measured 3e-5 at most over 26 tokens (the test
prints it). TOL = 1e-3 leaves 30x room for thread count and batch shape, and is far below
what the weight change moves (about 0.3 mean, 2 max), so both directions can fail.
"""

from __future__ import annotations

import json
import math
import urllib.request
from pathlib import Path

import pytest

from appo.cli import main
from appo.eval.records import read_samples
from appo.http import JsonClient, endpoint
from appo.rollout.loop import RolloutPrompt
from appo.rollout.openai_engine import OpenAICompletionsEngine
from appo.rollout.records import Trajectory, read_jsonl
from appo.rollout.sampling import SamplingParams
from appo.rollout.settings import RolloutSettings
from appo.rollout.stops import tool_stop_strings
from appo.rollout.strategies import rollout_grpo
from appo.rollout.vllm_server import reload_server_weights
from appo.tools.base import ToolResult
from appo.tools.executor import ToolCall, ToolExecutor
from appo.tools.pages import build_page_store
from appo.tools.search_tool import SearchTool
from conftest import hf_logprobs, max_gap  # tests/with_vllm/conftest.py

pytestmark = pytest.mark.vllm

TOL = 1e-3
# One request's bound: it catches a server that hangs, not a slow (loaded) machine.
REQUEST_TIMEOUT_S = 900
GREEDY = ["eval.temperature=0", "eval.top_p=1.0", "eval.top_k=0",
          "eval.repetition_penalty=1.0"]
MAX_RESPONSE = 64
DATA = "arith=synth:arith?split=eval&n=3"
# A fixed text whose per-token log-probs the weight-reload test compares.
SCORED_TEXT = ("The capital of France is Paris. The capital of Germany is Berlin. Two plus two "
               "equals four, and the sky is blue.")


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        return json.loads(r.read())


def complete(server, prompt: list[int], **fields) -> dict:
    body = {"model": server.model, "prompt": prompt, "temperature": 0.0, **fields}
    return post(endpoint(server.url, "completions"), body)["choices"][0]


@pytest.fixture(scope="module")
def tokenizer(vllm_server):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_server.model)


# ---------------------------------------------------------------- page step
def test_page_step_summarises_with_vllm_and_replays(vllm_server, tmp_path, monkeypatch):
    monkeypatch.setenv("APPO_CACHE", str(tmp_path / "appo-cache"))
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"id": "1", "title": "Eiffel Tower", "text": "The Eiffel Tower was finished in "
             "1889. It is 330 metres tall."},
            {"id": "2", "title": "Paris", "text": "Paris is the capital of France."}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = tmp_path / "pages.sqlite"
    build_page_store(corpus, store)
    summariser = {"base_url": vllm_server.url, "model": vllm_server.model,
                  "api": "completions", "temperature": 0.0, "max_tokens": 24}

    def run(miss_policy: str, base_url: str) -> list:
        tool = SearchTool(backend="bm25", corpus=str(corpus),
                          cache_file=str(tmp_path / "cache.sqlite"), miss_policy=miss_policy,
                          pages={"enabled": True, "store": str(store), "top_k": 2,
                                 "summariser": {**summariser, "base_url": base_url}})
        with ToolExecutor({"search": tool}) as ex:
            calls = [ToolCall("search", "eiffel tower height",
                              ("<think>How tall?</think><search>eiffel tower height</search>",))]
            return [(r.ok, r.text, r.error_kind) for r in ex.execute_many(calls)]

    live = run("live", vllm_server.url)
    [(ok, text, kind)] = live
    assert ok and kind is None and text.strip(), live
    print(f"\nSmolLM2 summary: {text!r}")
    # the replay cannot reach any server (a closed port) and must not need one
    replay = run("fail", "http://127.0.0.1:9")
    assert replay == live


# ---------------------------------------------------------------- token out
def test_engine_keeps_the_token_that_completes_a_stop_string(vllm_server, tokenizer):
    prompt = tokenizer.encode("Here is code: <python>x = 2\nprint(x*3)",
                              add_special_tokens=False)
    free = complete(vllm_server, prompt, max_tokens=30, return_token_ids=True)
    ids = free["token_ids"]
    # A stop string that ends two characters into a longer token: the token completing it
    # carries more text than the stop string.
    for i in range(2, len(ids)):
        piece = tokenizer.decode([ids[i]])
        stop = tokenizer.decode(ids[i - 2 : i]) + piece[:2]
        if len(piece) >= 3 and piece[:2].strip() and tokenizer.decode(ids).find(stop) == len(
                tokenizer.decode(ids[: i - 2])):
            break
    else:
        pytest.fail(f"no token of 3+ characters in the greedy continuation {free['text']!r}")
    engine = OpenAICompletionsEngine(vllm_server.url, tokenizer, model=vllm_server.model,
                                     logprobs=1, client=JsonClient(timeout=REQUEST_TIMEOUT_S, retries=0))
    engine.set_stop_strings([stop])
    row = engine.add_row(prompt)
    [out] = engine.decode([row], [30], SamplingParams(temperature=0.0))
    assert (out.finish, out.stop_string) == ("stop", stop)
    assert out.token_ids == ids[: i + 1]  # up to and including the completing token
    text = tokenizer.decode(out.token_ids)
    assert text.endswith(piece) and stop in text and not text.endswith(stop)
    assert len(out.logps) == i + 1 and all(lp <= 0 for lp in out.logps)
    assert any(lp < 0 for lp in out.logps)  # the server's log-probs, not the 0 placeholder


# ---------------------------------------------------------------- the tool loop, multi-turn
# Two solved examples make the 135M model answer the third question with a python call.
FEW_SHOT = ("Q: 1+1? <python>print(1+1)</python> <result>\n2\n</result> A: 2\n"
            "Q: 2+3? <python>print(2+3)</python> <result>\n5\n</result> A: 5\nQ: 6*7?")


class LengthTool:
    """A python tool that runs nothing: its result is the length of the code (the test
    needs deterministic forced tokens, not execution of model output)."""

    tags = ["python"]

    def __init__(self):
        self.calls: list[str] = []

    def execute_many(self, calls):
        self.calls += [c.content for c in calls]
        return [ToolResult(str(len(c.content))) for c in calls]


def _segments_match_direct_requests(server, traj: Trajectory, budget: int,
                                    stops: list[str]) -> int:
    """Send each model segment's request again, directly: the trajectory must hold exactly
    the server's ids and log-probs. Returns the number of tokens compared."""
    compared = 0
    for seg in (s for s in traj.segments if s.is_model):
        prompt = traj.prompt_ids + traj.response_ids[: seg.start]
        direct = complete(server, prompt, max_tokens=budget - seg.start, stop=stops,
                          return_token_ids=True, logprobs=1)
        assert traj.response_ids[seg.start : seg.end] == direct["token_ids"]
        got = traj.logp_rollout[seg.start : seg.end]
        want = direct["logprobs"]["token_logprobs"]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOL
        compared += seg.end - seg.start
    return compared


def test_tool_loop_on_the_server_matches_the_hf_engine(vllm_server, tokenizer):
    from appo.models import load_model
    from appo.rollout.hf_engine import HFEngine

    budget = 64
    prompt = tokenizer.encode(FEW_SHOT, add_special_tokens=False)
    settings = RolloutSettings(n=1, sampling=SamplingParams(temperature=0.0),
                               max_response_length=budget, call_limit=3)

    def run(engine) -> tuple[Trajectory, list[str]]:
        tools = LengthTool()
        [traj] = rollout_grpo([RolloutPrompt("q", prompt)], engine, tools,
                              settings).trajectories
        traj.check()
        return traj, tools.calls

    remote = OpenAICompletionsEngine(vllm_server.url, tokenizer, model=vllm_server.model,
                                     logprobs=1, client=JsonClient(timeout=REQUEST_TIMEOUT_S, retries=0))
    traj, calls = run(remote)
    assert calls and calls[0] == "print(6*7)", tokenizer.decode(traj.response_ids)
    assert sum(not s.is_model for s in traj.segments) == len(traj.tool_calls) >= 1
    assert _segments_match_direct_requests(vllm_server, traj, budget, ["</python>"]) > 0

    lm = load_model(vllm_server.model)
    local, local_calls = run(HFEngine(lm.model, lm.tokenizer, seed=0))
    assert local_calls == calls
    assert local.response_ids == traj.response_ids, (
        tokenizer.decode(local.response_ids), tokenizer.decode(traj.response_ids))
    assert [(s.start, s.end, s.is_model) for s in local.segments] == [
        (s.start, s.end, s.is_model) for s in traj.segments]
    assert local.finish_reason == traj.finish_reason


# ---------------------------------------------------------------- appo eval --base-url
def _eval(out: Path, *extra: str) -> dict:
    assert main(["eval", "--data", DATA, "--k", "1", "--out", str(out), *extra,
                 f"eval.max_response_length={MAX_RESPONSE}", *GREEDY]) == 0
    return json.loads((out / "summary.json").read_text())


def test_eval_through_the_server_records_its_ids_and_matches_hf(vllm_server, tmp_path):
    srv = _eval(tmp_path / "server", "--base-url", vllm_server.url, "--model",
                vllm_server.model, "--logprobs", "1")
    assert srv["run"]["backend"] == "openai" and srv["overall"]["failed_samples"] == 0
    trajs = read_jsonl(tmp_path / "server" / "arith" / "trajectories.jsonl")
    assert len(trajs) == 3
    stops = tool_stop_strings(list(srv["run"]["tool_call_limits"]))
    compared = 0
    for traj in trajs:
        traj.check()
        compared += _segments_match_direct_requests(vllm_server, traj, MAX_RESPONSE, stops)
    assert compared > 0 and any(lp != 0.0 for t in trajs for lp in t.logp_rollout)

    local = _eval(tmp_path / "hf", "--model", vllm_server.model)
    assert local["run"]["backend"] == "hf"
    hf_trajs = read_jsonl(tmp_path / "hf" / "arith" / "trajectories.jsonl")
    # Greedy on the same float32 weights: the same tokens, question by question.
    by_uid = {t.uid: t for t in hf_trajs}
    for traj in trajs:
        assert traj.prompt_ids == by_uid[traj.uid].prompt_ids
        assert traj.response_ids == by_uid[traj.uid].response_ids, traj.uid
    assert srv["benchmarks"] == local["benchmarks"] and srv["overall"] == local["overall"]
    samples = read_samples(tmp_path / "server" / "arith" / "samples.jsonl")
    assert samples == read_samples(tmp_path / "hf" / "arith" / "samples.jsonl")


# ---------------------------------------------------------------- weight reload
def _server_logprobs(server, ids: list[int]) -> list[float]:
    choice = complete(server, ids, max_tokens=1, prompt_logprobs=0)
    rows = choice["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(ids)  # no log-prob for the first token
    return [row[str(tok)]["logprob"] for tok, row in zip(ids[1:], rows[1:], strict=True)]


def test_weight_reload_serves_the_new_weights(vllm_server, tokenizer, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    ids = tokenizer.encode(SCORED_TEXT, add_special_tokens=False)
    model_dir = Path(vllm_server.model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # SmolLM2 ties lm_head to the embeddings (no lm_head in the file, and vLLM ignores one),
    # so the change is inside the network: one MLP's output doubled.
    weights = load_file(model_dir / "model.safetensors")
    key = "model.layers.10.mlp.down_proj.weight"
    assert key in weights
    weights[key] = weights[key] * 2.0
    new_dir = tmp_path / "step_1"
    new_dir.mkdir()
    # Weights only, no config.json or tokenizer: vLLM's reload reads just the weight files.
    save_file(weights, new_dir / "model.safetensors", metadata={"format": "pt"})

    old_server = _server_logprobs(vllm_server, ids)
    old_hf = hf_logprobs(model, ids)
    model.load_state_dict(weights, strict=False)  # strict=False: the tied lm_head key
    new_hf = hf_logprobs(model, ids)
    try:
        result = reload_server_weights(vllm_server.url, new_dir)
        new_server = _server_logprobs(vllm_server, ids)
    finally:
        reload_server_weights(vllm_server.url, model_dir)  # leave the server as it was
    restored = _server_logprobs(vllm_server, ids)
    moved = [abs(a - b) for a, b in zip(new_server, old_server, strict=True)]
    print(f"\nreload {result.seconds:.2f} s; server vs hf: old {max_gap(old_server, old_hf):.2e}, "
          f"new {max_gap(new_server, new_hf):.2e}; the change moved log-probs by "
          f"{sum(moved) / len(moved):.3f} mean, {max(moved):.3f} max")
    assert result.weights_path == str(new_dir.resolve()) and result.worker_results == [None]
    assert max_gap(old_server, old_hf) <= TOL
    assert max_gap(new_server, new_hf) <= TOL  # the server now computes the new weights
    assert max(moved) > 100 * TOL and sum(moved) / len(moved) > 10 * TOL
    assert max_gap(restored, old_hf) <= TOL
    assert all(math.isfinite(x) for x in new_server)


# ---------------------------------------------------------------- training in server mode
def test_train_against_the_server_reloads_the_policy(vllm_server, tmp_path):

    from appo.models import load_model

    out = tmp_path / "run"
    args = ["train", "model.path=smollm2-135m", "rollout.name=openai",
            f"rollout.base_urls=['{vllm_server.url}']", "rollout.strategy=grpo", "rollout.n=2",
            "data.template=math", "tools.enabled=[python]",
            "data.train_files=['synth:arith?split=train&levels=1&n=8']",
            "data.train_batch_size=2", "data.max_response_length=48",
            # group advantages may all be 0 for the base model; the entropy bonus keeps the
            # update non-zero (Adam then moves every weight by about lr)
            "actor.optim.lr=1e-4", "actor.entropy_coeff=0.01", "trainer.save_freq=1",
            "trainer.total_steps=2", f"trainer.default_local_dir={out}",
            f"trainer.rollout_data_dir={out / 'rollouts'}"]
    try:
        assert main(args) == 0
    finally:
        reload_server_weights(vllm_server.url, vllm_server.model)  # leave it as it was
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (out / "rollout_weights" / "model.safetensors").is_file()
    trajs = read_jsonl(out / "rollouts" / "step_00002.jsonl")
    gaps = {}
    for name, path in (("step1", out / "global_step_1"), ("base", "smollm2-135m")):
        model = load_model(str(path), device="cpu").model
        worst = 0.0
        for t in trajs:
            ids = t.prompt_ids + t.response_ids
            hf = hf_logprobs(model, ids)
            p = len(t.prompt_ids)
            for k, sampled in enumerate(t.sampled_mask()):
                # the engine's own EOS / put-back stop tokens carry 0: skip those
                if sampled and t.logp_rollout[k] != 0.0:
                    worst = max(worst, abs(hf[p + k - 1] - t.logp_rollout[k]))
        gaps[name] = worst
    assert gaps["step1"] <= TOL, gaps
    assert gaps["base"] > 10 * TOL, gaps  # without the reload the server would be stale
