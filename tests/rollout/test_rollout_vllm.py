"""The vllm engine against a fake `LLM` that checks its requests and returns scripted outputs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from rollout_fakes import FakeTools, tiny_tokenizer

from appo.errors import AppoError
from appo.rollout import RolloutPrompt, RolloutSettings, rollout
from appo.rollout.sampling import SamplingParams
from appo.rollout.vllm_engine import VLLMEngine, entropy_from_top_logprobs


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def step_logprobs(sampled: int, p_sampled: float, others: dict[int, float]):
    """One step's {token: Logprob} as vLLM returns it (the sampled token included)."""
    d = {sampled: SimpleNamespace(logprob=math.log(p_sampled), rank=1)}
    d.update({t: SimpleNamespace(logprob=math.log(p), rank=2) for t, p in others.items()})
    return d


class FakeLLM:
    """Records every generate() call; answers each request with `respond(prompt_ids, sp)`."""

    def __init__(self, respond):
        self.respond = respond
        self.calls: list[tuple[list[dict], list[dict]]] = []

    def generate(self, prompts, sampling_params, use_tqdm=True):
        assert use_tqdm is False
        assert isinstance(prompts, list) and isinstance(sampling_params, list)
        self.calls.append((prompts, sampling_params))
        return [self.respond(p["prompt_token_ids"], sp) for p, sp in zip(prompts, sampling_params,
                                                                        strict=True)]


def output(tok, text, finish_reason, stop_reason, cached=0, p=0.5):
    ids = tok.encode(text)
    if finish_reason == "stop" and stop_reason is None:
        ids = ids + [tok.eos_token_id]
    other = 1 if ids[0] != 1 else 2
    comp = SimpleNamespace(
        token_ids=ids,
        logprobs=[step_logprobs(t, p, {other if t != other else 3: 1 - p}) for t in ids],
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        text=text,
    )
    return SimpleNamespace(outputs=[comp], num_cached_tokens=cached)


def test_requests_carry_token_ids_stops_and_sampling(tok):
    seen = []

    def respond(prompt_ids, sp):
        seen.append((list(prompt_ids), sp))
        return output(tok, "<python>1+1</python>", "stop", "</python>", cached=3)

    llm = FakeLLM(respond)
    eng = VLLMEngine(llm, tok, stop_strings=["</python>"], seed=1, logprobs=5,
                     sampling_params_factory=dict)
    root = eng.add_row([5, 6, 7, 8])
    rows = eng.fork(root, 2)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, repetition_penalty=1.1)
    outs = eng.decode(rows, [10, 0], params)
    assert len(llm.calls) == 1 and len(seen) == 1  # the zero-budget row is not sent
    ids, sp = seen[0]
    assert ids == [5, 6, 7, 8]
    assert sp["max_tokens"] == 10 and sp["stop"] == ["</python>"]
    assert sp["include_stop_str_in_output"] is True and sp["logprobs"] == 5
    assert sp["temperature"] == 0.7 and sp["top_p"] == 0.9 and sp["top_k"] == -1
    assert sp["repetition_penalty"] == 1.1 and sp["skip_special_tokens"] is False
    out = outs[0]
    assert out.finish == "stop" and out.stop_string == "</python>"
    assert out.token_ids == tok.encode("<python>1+1</python>")
    assert out.logps == pytest.approx([math.log(0.5)] * len(out.token_ids))
    assert outs[1].token_ids == [] and outs[1].finish == "length"
    # token out: the row now holds the sampled ids; token in next round: all of them
    assert eng.row_ids(rows[0]) == [5, 6, 7, 8, *out.token_ids]
    assert eng.counters.prefilled == 1 and eng.counters.reused == 3
    assert eng.counters.decoded == len(out.token_ids)


def test_finish_reasons(tok):
    script = iter([
        output(tok, "done", "stop", None),
        output(tok, "cut", "length", None),
        output(tok, "<search>x</search>", "stop", "</search>"),
    ])
    eng = VLLMEngine(FakeLLM(lambda ids, sp: next(script)), tok,
                     stop_strings=["</search>"], sampling_params_factory=dict)
    rows = eng.fork(eng.add_row([1, 2]), 3)
    outs = eng.decode(rows, [8, 8, 8], SamplingParams())
    assert [o.finish for o in outs] == ["eos", "length", "stop"]
    assert outs[0].token_ids[-1] == tok.eos_token_id
    assert outs[2].stop_string == "</search>"


def test_a_branch_resuming_mid_segment_stops_at_a_stop_string_across_its_split(tok):
    """appo branches resume inside a model segment. vLLM only matches stop strings in the
    text it generates, so `</calc>` begun before the split (`...</ca` | `lc>...`) would run
    on; the engine cuts the output where the stop string completes, like the hf engine."""
    assert len(tok.encode("</calc>", add_special_tokens=False)) > 1
    replies = iter(["<calc>1+1</calc>", "lc> and then more text"])

    def respond(prompt_ids, sp):
        text = next(replies)
        ids = tok.encode(text, add_special_tokens=False)
        stop = "</calc>" if text.endswith("</calc>") else None
        comp = SimpleNamespace(
            token_ids=ids, logprobs=[step_logprobs(t, 0.5, {}) for t in ids],
            finish_reason="stop" if stop else "length", stop_reason=stop, text=text)
        return SimpleNamespace(outputs=[comp], num_cached_tokens=0)

    eng = VLLMEngine(FakeLLM(respond), tok, stop_strings=["</calc>"],
                     sampling_params_factory=dict)
    prompt = tok.encode("Q:", add_special_tokens=False)
    row = eng.add_row(prompt)
    [first] = eng.decode([row], [32], SamplingParams())
    assert first.finish == "stop"
    # Branch inside the closing tag, after "</ca", continuing the same model segment.
    head = tok.encode("<calc>1+1</ca", add_special_tokens=False)
    assert first.token_ids[: len(head)] == head
    [kid] = eng.fork(row, 1, at=len(prompt) + len(head), segment_start=len(prompt))
    [out] = eng.decode([kid], [32], SamplingParams())
    assert (out.finish, out.stop_string) == ("stop", "</calc>")
    assert tok.decode(out.token_ids) == "lc>"
    assert len(out.logps) == len(out.entropies) == len(out.token_ids)
    assert tok.decode(eng.row_ids(kid)).endswith("<calc>1+1</calc>")
    # After forced tokens a new segment starts: nothing before it can complete a stop.
    replies = iter(["lc> is not a stop here"])
    eng.append(kid, tok.encode(" <result>2</result> </ca", add_special_tokens=False))
    [later] = eng.decode([kid], [32], SamplingParams())
    assert later.finish == "length" and tok.decode(later.token_ids) == "lc> is not a stop here"


def test_entropy_from_top_logprobs():
    # Full distribution given: exact entropy. p = (0.5, 0.25, 0.25): H = 1.5 ln 2
    h, top = entropy_from_top_logprobs([math.log(0.5), math.log(0.25), math.log(0.25)])
    assert h == pytest.approx(1.5 * math.log(2)) and top == pytest.approx(h)
    # Truncated: the missing 0.5 counts as one bucket -> a lower bound of the true entropy.
    h, _ = entropy_from_top_logprobs([math.log(0.5)])
    assert h == pytest.approx(2 * 0.5 * math.log(2))


def test_rollout_loop_on_the_vllm_engine(tok):
    """A whole grpo rollout: round 1 calls the tool, round 2 resends prompt + call + result."""
    prompts_seen = []

    def respond(prompt_ids, sp):
        prompts_seen.append(list(prompt_ids))
        if tok.decode(prompt_ids).count("<result>") == 0:
            return output(tok, "<python>2*21</python>", "stop", "</python>", cached=2)
        return output(tok, "<answer>42</answer>", "stop", None, cached=len(prompt_ids) - 1)

    eng = VLLMEngine(FakeLLM(respond), tok, sampling_params_factory=dict)
    tools = FakeTools(reply=lambda tool, content: "42")
    prompt = RolloutPrompt("q", tok.encode("What is 2*21?"))
    batch = rollout([prompt], eng, tools, RolloutSettings(n=2, max_response_length=200),
                    strategy="grpo")
    assert len(batch.trajectories) == 2
    for traj in batch.trajectories:
        assert [c.content for c in traj.tool_calls] == ["2*21"]
        assert traj.finish_reason == "eos"
        assert tok.decode(traj.response_ids) == (
            "<python>2*21</python> <result>\n42\n</result><answer>42</answer><|im_end|>")
    # Round 2 resends exactly the ids of round 1 plus the result tokens (token in/out).
    second = prompts_seen[2]
    first_traj = batch.trajectories[0]
    cut = first_traj.tool_calls[0].result_end
    assert second == prompt.prompt_ids + first_traj.response_ids[:cut]
    assert batch.stats.tokens_reused > 0


def test_from_config_without_vllm_is_a_clear_error(monkeypatch):
    import builtins

    from appo.config import load_config

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("no vllm")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    cfg = load_config(overrides=["rollout.name=vllm"])
    with pytest.raises(AppoError, match="vLLM"):
        VLLMEngine.from_config(cfg)


def test_reseed_restarts_the_request_seeds(tok):
    # Per-request seeds are seed * 1_000_003 + request count; reseeding restarts the count,
    # so the same step seed gives the same requests (a resumed run repeats its sampling).
    seen = []

    def respond(prompt_ids, sp):
        seen.append(sp["seed"])
        return output(tok, "ok", "stop", None)

    eng = VLLMEngine(FakeLLM(respond), tok, seed=1, sampling_params_factory=dict)
    rows = eng.fork(eng.add_row([5, 6]), 2)
    for _ in range(2):
        eng.reseed(7)
        eng.decode(rows, [4, 4], SamplingParams())
    assert seen[:2] == [7 * 1_000_003 + 1, 7 * 1_000_003 + 2] and seen[2:] == seen[:2]
