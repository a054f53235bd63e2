"""The OpenAI-compatible engine against a scripted completions server on 127.0.0.1.

The grpo strategy and the shared tool loop run unchanged on it: stop strings (re-appended
after OpenAI-style stripping), multi-turn continuation with tool results, sampling params,
and clear error results (HTTP errors, timeouts, junk) that end a row without a crash.
"""

from __future__ import annotations

import math

import pytest
from eval_server import Reply, ScriptedServer, completion

from appo.http import JsonClient
from appo.models.tiny import build_tiny_tokenizer
from appo.rollout.loop import RolloutPrompt
from appo.rollout.openai_engine import OpenAICompletionsEngine
from appo.rollout.sampling import SamplingParams
from appo.rollout.settings import RolloutSettings
from appo.rollout.strategies import rollout_grpo
from appo.tools.base import ToolResult

PARAMS = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1)


class EchoPython:
    """A tool runner whose python tool evaluates one arithmetic expression (no sandbox)."""

    tags = ["python"]

    def __init__(self):
        self.calls = []

    def execute_many(self, calls):
        self.calls += [c.content for c in calls]
        return [ToolResult(str(eval(c.content.removeprefix("print(").removesuffix(")"))))
                for c in calls]


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture
def server():
    s = ScriptedServer()
    yield s
    s.close()


def fast_client(timeout=5.0, retries=2):
    return JsonClient(timeout=timeout, retries=retries, backoff_s=0.0)


def test_grpo_multi_turn_with_tool_results(server, tok):
    prompt_ids = tok.encode("Q: what is 6*7?\n", add_special_tokens=False)

    def script(body):
        text = tok.decode(body["prompt"])
        assert body["prompt"][: len(prompt_ids)] == prompt_ids
        if "<result>" not in text:
            # vLLM semantics: the stop string is stripped from the text, named in stop_reason.
            return completion("<think>use python</think><python>print(6*7)",
                              stop_reason="</python>")
        assert text.endswith("<python>print(6*7)</python> <result>\n42\n</result>"), text
        return completion("<answer>\\boxed{42}</answer>", stop_reason=None)

    server.completions = script
    engine = OpenAICompletionsEngine(server.url, tok, client=fast_client())
    assert engine.model == "scripted-model"  # from GET /v1/models
    tools = EchoPython()
    settings = RolloutSettings(n=2, sampling=PARAMS, max_response_length=200, call_limit=3)
    batch = rollout_grpo([RolloutPrompt("q", prompt_ids)], engine, tools, settings)

    assert len(batch.trajectories) == 2 and tools.calls == ["print(6*7)", "print(6*7)"]
    expected = ("<think>use python</think><python>print(6*7)</python> <result>\n42\n</result>"
                "<answer>\\boxed{42}</answer><|im_end|>")
    for traj in batch.trajectories:
        traj.check()
        assert tok.decode(traj.response_ids) == expected
        assert traj.finish_reason == "eos"
        assert [(c.tool, c.content, c.result) for c in traj.tool_calls] == [
            ("python", "print(6*7)", "42")]
        # The model tokens are sampled (loss_mask 1), the tool result is forced (0).
        call = traj.tool_calls[0]
        assert set(traj.loss_mask[call.result_start : call.result_end]) == {0}
        assert traj.loss_mask[0] == 1
    posts = server.posts()
    assert len(posts) == 4  # two turns for each of the two trajectories
    first = posts[0].body
    assert first["model"] == "scripted-model" and first["stop"] == ["</python>"]
    assert (first["max_tokens"], first["temperature"], first["top_p"]) == (200, 0.6, 0.95)
    assert (first["top_k"], first["repetition_penalty"]) == (20, 1.1)
    # The continuation carries the whole row (token in) and only the budget that is left.
    traj = batch.trajectories[0]
    call = traj.tool_calls[0]
    second = [p.body for p in posts if len(p.body["prompt"]) > len(prompt_ids)]
    assert second[0]["prompt"] == prompt_ids + traj.response_ids[: call.result_end]
    assert second[0]["max_tokens"] == 200 - call.result_end


@pytest.mark.parametrize(
    ("reply", "segment_before", "finish", "stop"),
    [
        # Plain OpenAI: stop string stripped, no stop_reason: the unclosed tag names it.
        (completion("x <python>1+1"), "", "stop", "</python>"),
        # ... an unclosed tag opened earlier in the same segment counts too.
        (completion("1+1"), "<python>", "stop", "</python>"),
        # No unclosed tag: it stopped at EOS.
        (completion("<python>1</python> done"), "", "eos", None),
        # The server echoes the stop string (include_stop_str_in_output): not doubled.
        (completion("<python>1+1</python>", stop_reason="</python>"), "", "stop", "</python>"),
        (completion("<python>1+1</python>"), "", "stop", "</python>"),
        # vLLM: stop_reason None (or the EOS id) means EOS even with an open tag.
        (completion("<python>1+1", stop_reason=None), "", "eos", None),
        (completion("<python>1+1", stop_reason=2), "", "eos", None),
        (completion("long text", finish="length"), "", "length", None),
    ],
)
def test_stop_detection(server, tok, reply, segment_before, finish, stop):
    server.completions = lambda body: reply
    engine = OpenAICompletionsEngine(server.url, tok, model="m", client=fast_client())
    engine.set_stop_strings(["</python>", "</search>"])
    rid = engine.add_row(tok.encode("prompt:", add_special_tokens=False))
    if segment_before:
        # Text sampled earlier in this segment (no append since): part of the same segment.
        engine.rows[rid].ids.extend(tok.encode(segment_before, add_special_tokens=False))
    [out] = engine.decode([rid], [100], PARAMS)
    assert (out.finish, out.stop_string) == (finish, stop)
    text = tok.decode(out.token_ids)
    if stop is not None:
        assert text.endswith(stop) and text.count(stop) == reply["choices"][0]["text"].count(
            stop) + (0 if reply["choices"][0]["text"].endswith(stop) else 1)
    if finish == "eos":
        assert out.token_ids[-1] == tok.eos_token_id
    assert engine.row_ids(rid)[-len(out.token_ids):] == out.token_ids
    assert out.logps == [0.0] * len(out.token_ids) == out.entropies  # unknown over HTTP


def test_budget_truncates_long_replies(server, tok):
    server.completions = lambda body: completion("a" * 50, stop_reason=None)
    engine = OpenAICompletionsEngine(server.url, tok, model="m", client=fast_client())
    rid = engine.add_row([1, 2, 3])
    [out] = engine.decode([rid], [10], PARAMS)
    assert len(out.token_ids) == 10 and out.finish == "length"


def test_text_prompts_and_api_key(server, tok, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-secret")
    server.completions = lambda body: completion("hi", stop_reason=None)
    engine = OpenAICompletionsEngine(server.url + "/v1", tok, model="m",
                                     prompt_format="text", client=None, retries=0)
    ids = tok.encode("<|im_start|>user\nhello<|im_end|>\n", add_special_tokens=False)
    rid = engine.add_row(ids)
    engine.decode([rid], [5], SamplingParams(temperature=0.0))
    [req] = server.posts()
    assert req.path == "/v1/completions"  # a base URL ending in /v1 is not doubled
    assert req.body["prompt"] == "<|im_start|>user\nhello<|im_end|>\n"
    assert req.body["temperature"] == 0.0
    assert "top_k" not in req.body and "repetition_penalty" not in req.body  # neutral: omitted
    assert req.headers["Authorization"] == "Bearer sk-test-secret"
    assert "sk-test" not in repr(engine.client) and "sk-test" not in repr(engine.__dict__)


@pytest.mark.parametrize(
    ("reply", "requests", "message"),
    [
        (Reply(500, {"error": "engine crashed"}), 3, "HTTP 500"),  # retried, then given up
        (Reply(503, "overloaded"), 3, "HTTP 503"),
        (Reply(400, {"error": "prompt too long"}), 1, "prompt too long"),  # not retried
        (Reply(200, "<html>not json"), 1, "non-JSON"),
        (Reply(200, {"choices": []}), 1, "no choices"),
        (Reply(200, {"choices": [{"finish_reason": "stop"}]}), 1, "without text"),
        (Reply(200, completion("late"), delay=1.0), 3, "timed out"),
    ],
)
def test_errors_end_the_row_with_a_clear_message(server, tok, reply, requests, message):
    server.completions = lambda body: reply
    engine = OpenAICompletionsEngine(server.url, tok, model="m",
                                     client=fast_client(timeout=0.3, retries=2))
    ok_row = engine.add_row([5, 6])
    [out] = engine.decode([ok_row], [20], PARAMS)
    assert out.token_ids == [] and out.finish == "error"
    assert message in out.error
    assert len(server.posts()) == requests


def test_failing_row_does_not_stop_the_others(server, tok):
    def script(body):
        if body["prompt"][0] == 9:
            return Reply(500, {"error": "bad row"})
        return completion("fine", stop_reason=None)

    server.completions = script
    engine = OpenAICompletionsEngine(server.url, tok, model="m",
                                     client=fast_client(retries=0))
    good, bad = engine.add_row([1, 2]), engine.add_row([9, 2])
    out_good, out_bad = engine.decode([good, bad], [20, 20], PARAMS)
    assert tok.decode(out_good.token_ids) == "fine<|im_end|>" and out_good.error is None
    assert out_good.finish == "eos"
    assert out_bad.token_ids == [] and out_bad.finish == "error" and "HTTP 500" in out_bad.error


def test_fork_and_append_are_local(server, tok):
    engine = OpenAICompletionsEngine(server.url, tok, model="m", client=fast_client())
    root = engine.add_row([1, 2, 3, 4])
    a, b = engine.fork(root, 2)
    engine.append(a, [7, 8])
    assert engine.row_ids(a) == [1, 2, 3, 4, 7, 8] and engine.row_ids(b) == [1, 2, 3, 4]
    [c] = engine.fork(a, 1, at=5)
    assert engine.row_ids(c) == [1, 2, 3, 4, 7]
    assert server.posts() == []


def test_unreachable_server_names_the_problem(tok):
    from appo.errors import AppoError

    with pytest.raises(AppoError, match="cannot list the models"):
        OpenAICompletionsEngine("http://127.0.0.1:9", tok, client=fast_client(retries=0))


def test_server_logprobs_when_tokens_line_up(server, tok):
    # Byte-level tiny tokenizer: "ab" is two tokens, as the server reports.
    top = [{"a": -0.1, "c": -2.4}, {"b": -0.2}]
    lp = {"tokens": ["a", "b"], "token_logprobs": [-0.1, -0.2], "top_logprobs": top}
    replies = iter([completion("ab", finish="length", logprobs=lp),
                    completion("abc", finish="length", logprobs=lp)])
    server.completions = lambda body: next(replies)
    engine = OpenAICompletionsEngine(server.url, tok, model="m", logprobs=2,
                                     client=fast_client())
    rid = engine.add_row([1])
    [out] = engine.decode([rid], [2], PARAMS)
    assert server.posts()[0].body["logprobs"] == 2
    assert out.logps == [-0.1, -0.2]
    # Top-k entropy proxy: -sum p log p over the returned top log-probs of each position.
    h0 = -(0.9048374180359595 * -0.1 + 0.09071795328941251 * -2.4)
    assert out.topk_entropies == pytest.approx([h0, -(0.8187307530779818 * -0.2)])
    # Entropy lower bound: the same plus the missing mass r = 1 - sum p as one token.
    r0, r1 = 1 - 0.9048374180359595 - 0.09071795328941251, 1 - 0.8187307530779818
    assert out.entropies == pytest.approx([h0 - r0 * math.log(r0),
                                           -(0.8187307530779818 * -0.2) - r1 * math.log(r1)])
    [out] = engine.decode([rid], [3], PARAMS)  # 3 local tokens, 2 from the server: unknown
    assert out.logps == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------- token out (vLLM token_ids)
def char_ids(tok, text):
    """`text` one character per token: a tokenisation the local tokenizer would not choose
    for a tag it has one token for, so a re-tokenised segment would differ from it."""
    return [tok.encode(c, add_special_tokens=False)[0] for c in text]


def logprobs_of(ids, values):
    return {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": values,
            "top_logprobs": [{f"token_id:{t}": v} for t, v in zip(ids, values, strict=True)]}


def test_server_token_ids_are_the_segment(server, tok):
    # vLLM: the text is stripped of the stop string, the ids keep the tokens that sampled it.
    ids = char_ids(tok, "<python>1+1</python>")
    assert tok.encode("</python>", add_special_tokens=False) != ids[-9:]  # one local token
    lps = [-0.01 * (i + 1) for i in range(len(ids))]
    server.completions = lambda body: completion(
        "<python>1+1", stop_reason="</python>", token_ids=ids, logprobs=logprobs_of(ids, lps))
    engine = OpenAICompletionsEngine(server.url, tok, model="m", logprobs=1,
                                     client=fast_client())
    engine.set_stop_strings(["</python>"])
    rid = engine.add_row([1, 2])
    [out] = engine.decode([rid], [100], PARAMS)
    [req] = server.posts()
    assert req.body["return_token_ids"] is True and req.body["logprobs"] == 1
    assert out.token_ids == ids  # not re-tokenised
    assert (out.finish, out.stop_string) == ("stop", "</python>")
    assert out.logps == pytest.approx(lps)  # per returned id, not "when they line up"
    assert out.topk_entropies == pytest.approx([-(math.exp(v) * v) for v in lps])
    assert engine.row_ids(rid) == [1, 2, *ids]


@pytest.mark.parametrize(
    ("returned", "reason", "added"),
    [
        ("ok<eos>", None, ""),  # vLLM returns the EOS id it sampled: kept, not doubled
        ("ok", None, "<eos>"),  # a server that leaves EOS out: appended (log-prob 0)
        ("ok<eos>", 257, ""),  # EOS named as a stop token id
        ("<python>1", "</python>", "</python>"),  # ids without the stop string: appended
    ],
)
def test_server_token_ids_eos_and_missing_stop(server, tok, returned, reason, added):
    def ids_of(text):
        eos = text.endswith("<eos>")
        ids = char_ids(tok, text.removesuffix("<eos>"))
        return ids + [tok.eos_token_id] * eos

    ids = ids_of(returned)
    lps = [-0.5] * len(ids)
    text = returned.removesuffix("<eos>")
    server.completions = lambda body: completion(
        text, stop_reason=reason, token_ids=ids, logprobs=logprobs_of(ids, lps))
    engine = OpenAICompletionsEngine(server.url, tok, model="m", logprobs=1,
                                     client=fast_client())
    engine.set_stop_strings(["</python>"])
    rid = engine.add_row([1])
    [out] = engine.decode([rid], [100], PARAMS)
    tail = ([tok.eos_token_id] if added == "<eos>" else
            tok.encode(added, add_special_tokens=False) if added else [])
    assert out.token_ids == ids + tail
    assert out.logps == lps + [0.0] * len(tail)
    assert out.finish == ("stop" if added == "</python>" else "eos")
    assert len(out.topk_entropies) == len(out.token_ids) == len(out.entropies)


def test_server_token_ids_over_the_budget_are_cut(server, tok):
    ids = char_ids(tok, "abcdef")
    server.completions = lambda body: completion("abcdef", finish="length", token_ids=ids)
    engine = OpenAICompletionsEngine(server.url, tok, model="m", client=fast_client())
    rid = engine.add_row([1])
    [out] = engine.decode([rid], [4], PARAMS)
    assert out.token_ids == ids[:4] and out.finish == "length"
    assert out.logps == [0.0] * 4  # not asked for (logprobs=0)


@pytest.mark.parametrize("bad", [["a", 1], [1.5], [-1], [10**6], "12", [True]])
def test_malformed_token_ids_end_the_row(server, tok, bad):
    server.completions = lambda body: completion("x", stop_reason=None, token_ids=bad)
    engine = OpenAICompletionsEngine(server.url, tok, model="m", client=fast_client())
    rid = engine.add_row([1])
    [out] = engine.decode([rid], [10], PARAMS)
    assert out.finish == "error" and out.token_ids == []
    assert "token_ids that are not ids of the local tokenizer" in out.error


def test_token_ids_off_leaves_the_field_out_and_ignores_ids(server, tok):
    server.completions = lambda body: completion("ab", finish="length",
                                                 token_ids=char_ids(tok, "xy"))
    engine = OpenAICompletionsEngine(server.url, tok, model="m", client=fast_client(),
                                     token_ids=False)
    rid = engine.add_row([1])
    [out] = engine.decode([rid], [5], PARAMS)
    assert "return_token_ids" not in server.posts()[0].body
    assert out.token_ids == tok.encode("ab", add_special_tokens=False)


def test_grpo_tool_loop_on_server_token_ids(server, tok):
    # The tool loop reads the closing tag from the server's ids (one token per character
    # here) and sends them back unchanged as the next prompt.
    prompt_ids = tok.encode("Q: 6*7?\n", add_special_tokens=False)
    first = char_ids(tok, "<python>print(6*7)</python>")
    final = char_ids(tok, "<answer>42</answer>") + [tok.eos_token_id]

    def script(body):
        if len(body["prompt"]) == len(prompt_ids):
            return completion("<python>print(6*7)", stop_reason="</python>", token_ids=first)
        assert body["prompt"][len(prompt_ids):len(prompt_ids) + len(first)] == first
        return completion("<answer>42</answer>", stop_reason=None, token_ids=final)

    server.completions = script
    engine = OpenAICompletionsEngine(server.url, tok, client=fast_client())
    tools = EchoPython()
    settings = RolloutSettings(n=1, sampling=PARAMS, max_response_length=200, call_limit=3)
    [traj] = rollout_grpo([RolloutPrompt("q", prompt_ids)], engine, tools, settings).trajectories
    traj.check()
    assert tools.calls == ["print(6*7)"] and traj.finish_reason == "eos"
    call = traj.tool_calls[0]
    assert traj.response_ids[: call.result_start] == first
    assert traj.response_ids[call.result_end:] == final


def test_several_servers_split_rows_by_prompt_and_reload_each(tok, tmp_path):
    """Rows go to the servers in turn by root (forks stay on their parent's server, where
    the shared prefix is cached); `sync_weights` saves once and has every server reload
    (servers without appo's worker extension: the file route)."""
    reloads: dict[int, list] = {0: [], 1: []}
    servers = []
    for i in range(2):
        def reload(body, i=i):
            reloads[i].append(body)
            return {"results": [None]}

        s = ScriptedServer(routes={"/collective_rpc": reload,
                                   "/reset_prefix_cache": lambda body: {"success": True}})
        s.completions = lambda body, i=i: completion(f"s{i}", finish="length")
        servers.append(s)
    try:
        engine = OpenAICompletionsEngine([s.url for s in servers], tok, client=fast_client(),
                                         weights_dir=str(tmp_path / "w"))
        roots = [engine.add_row([5, 6, 7]) for _ in range(3)]
        kids = engine.fork(roots[1], 2)
        outs = engine.decode(roots + kids, [8] * 5, PARAMS)
        texts = [tok.decode(o.token_ids) for o in outs]
        assert texts == ["s0", "s1", "s0", "s1", "s1"]
        assert len(servers[0].posts()) == 2 and len(servers[1].posts()) == 3

        import torch

        model = torch.nn.Linear(2, 2)
        engine.sync_weights(model)
        for i in range(2):
            # rollout.weight_transfer=auto probes for appo's worker extension first; this
            # server answers without it, so the weights go through the file
            probe, body = reloads[i]
            assert probe["method"] == "appo_weight_group_info"
            assert body["method"] == "reload_weights"
            assert body["kwargs"] == {"weights_path": str((tmp_path / "w").resolve())}
        assert engine.weight_syncs == 1
        from safetensors.torch import load_file

        saved = load_file(tmp_path / "w" / "model.safetensors")
        assert torch.equal(saved["weight"], model.weight) and sorted(saved) == ["bias", "weight"]
    finally:
        for s in servers:
            s.close()


def test_openai_engine_config_errors_are_one_line():
    from appo.config import load_config
    from appo.errors import AppoError
    from appo.rollout import build_engine

    cfg = load_config(overrides=["rollout.name=openai"])
    with pytest.raises(AppoError, match="rollout.base_urls"):
        build_engine(cfg, None)
    with pytest.raises(AppoError, match="list of URLs"):
        OpenAICompletionsEngine([], build_tiny_tokenizer())


def test_save_state_keeps_tied_weights(tmp_path):
    """A tied LM head is written too (save_pretrained drops it): a server reloading from the
    directory must see every weight the policy has."""
    import torch
    from safetensors.torch import load_file

    from appo.rollout.vllm_server import save_state

    model = torch.nn.Module()
    model.embed, model.head = torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False)
    model.head.weight = model.embed.weight
    save_state(model, str(tmp_path / "w"))
    saved = load_file(tmp_path / "w" / "model.safetensors")
    assert sorted(saved) == ["embed.weight", "head.weight"]
    assert torch.equal(saved["head.weight"], model.embed.weight)
    assert not (tmp_path / "w" / "model.safetensors.tmp").exists()
