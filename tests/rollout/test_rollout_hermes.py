"""Native calls (`tools.format=hermes`, docs/algorithms.md §5.4) with a scripted engine: the
rollout's prompt + sampled + forced tokens equal the chat template's rendering of the same
conversation, for plain rollouts, ARPO branches and the tag format; malformed calls become
error results; limits with parallel calls."""

from __future__ import annotations

import json

import pytest
from rollout_fakes import FakeTools, ScriptedEngine, ScriptedRng, Step, tiny_tokenizer

from appo.data.rl import render_prompt_ids
from appo.models.tiny import CHATML_TEMPLATE
from appo.rollout import RolloutPrompt, RolloutSettings, rollout
from appo.rollout.loop import LIMIT_MESSAGE
from appo.tools.formats import function_schema
from appo.tools.python_tool import PythonTool

SCHEMAS = [function_schema("python", PythonTool)]
SYSTEM = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "6*7?"}]
ANSWER = "<answer>\\boxed{42}</answer>"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def hermes_tools(**kw):
    tools = FakeTools(**kw)
    tools.schemas = SCHEMAS
    return tools


def call_text(code: str, content: str = "") -> str:
    # What the tiny template renders for an assistant message with one call (written out
    # by hand from the template: content, newline, the block; no newline without content).
    body = json.dumps({"name": "python", "arguments": {"code": code}})
    return f"{content}\n<tool_call>\n{body}\n</tool_call>" if content else \
        f"<tool_call>\n{body}\n</tool_call>"


def settings(**kw):
    base = dict(n=1, initial_rollouts=1, max_response_length=2000, call_limit=3,
                entropy_measure="mean", call_format="hermes")
    base.update(kw)
    return RolloutSettings(**base)


def prompt(tok, uid="q"):
    return RolloutPrompt(uid, render_prompt_ids(SYSTEM, tok, SCHEMAS))


def responses_so_far(engine, ids):
    # "<tool_response>\n": the system turn names the tag too, never followed by a newline
    return engine.count(ids, "<tool_response>\n")


def calls_then_answer(calls: int, entropy=lambda k: 1.0):
    def script(engine, rid, ids):
        k = responses_so_far(engine, ids)
        if k < calls:
            return Step(call_text(f"print({k})", "thinking" if k == 0 else ""), finish="eos",
                        entropy=entropy(k))
        return Step(ANSWER, finish="eos", entropy=0.5)

    return script


def conversation(traj) -> list[dict]:
    """The OpenAI messages a trajectory stands for, from its call records."""
    messages = list(SYSTEM)
    for i, c in enumerate(traj.tool_calls):
        call = {"type": "function", "function": {"name": "python", "arguments": {"code": c.content}}}
        messages.append({"role": "assistant", "content": "thinking" if i == 0 else "",
                         "tool_calls": [call]})
        messages.append({"role": "tool", "name": "python", "content": c.result})
    return messages + [{"role": "assistant", "content": ANSWER}]


def template_ids(tok, messages, tools=SCHEMAS):
    ids = tok.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    return [int(i) for i in ids]


def assert_equal_to_template(tok, traj, messages, tools=SCHEMAS):
    ref = template_ids(tok, messages, tools)
    ours = traj.prompt_ids + traj.response_ids
    # The template ends the final turn with "<|im_end|>\n"; generation stops at <|im_end|>.
    assert ref[: len(ours)] == ours
    assert tok.decode(ref[len(ours):]) == "\n"


def test_tiny_template_without_tools_is_plain_chatml(tok):
    plain = tiny_tokenizer()
    plain.chat_template = CHATML_TEMPLATE
    for gen in (True, False):
        assert (tok.apply_chat_template(SYSTEM, tokenize=False, add_generation_prompt=gen)
                == plain.apply_chat_template(SYSTEM, tokenize=False, add_generation_prompt=gen))


def test_hermes_rollout_equals_template_rendering(tok):
    tools = hermes_tools()
    batch = rollout([prompt(tok)], ScriptedEngine(tok, calls_then_answer(2)), tools,
                    settings(), strategy="grpo")
    [traj] = batch.trajectories
    traj.check()
    assert traj.finish_reason == "eos"
    assert [c.content for c in traj.tool_calls] == ["print(0)", "print(1)"]
    assert [c.tool for b in tools.batches for c in b] == ["python", "python"]
    assert_equal_to_template(tok, traj, conversation(traj))
    # Every model segment (3 assistant turns) ends with <|im_end|> inside the loss mask;
    # every forced token (tool turn + next assistant header) is outside it.
    eot = tok.eos_token_id
    for seg in traj.segments:
        mask = traj.loss_mask[seg.start : seg.end]
        if seg.is_model:
            assert traj.response_ids[seg.end - 1] == eot and mask == [1] * len(mask)
        else:
            assert mask == [0] * len(mask)
            text = tok.decode(traj.response_ids[seg.start : seg.end])
            assert text.startswith("\n<|im_start|>user\n<tool_response>\n")
            assert text.endswith("</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert sum(s.is_model for s in traj.segments) == 3


def test_arpo_branches_equal_template_rendering(tok):
    # Branch after every result (rng 0.0 < p): each branch copies the row after a result
    # and continues on its own; each trajectory must still render token-exactly.
    s = settings(n=4, initial_rollouts=1, beam_size=2, branch_probability=1.0,
                 entropy_weight=0.0)
    batch = rollout([prompt(tok)], ScriptedEngine(tok, calls_then_answer(2)), hermes_tools(),
                    s, strategy="arpo", rng=ScriptedRng([0.0]))
    branches = [t for t in batch.trajectories if t.parent_id is not None]
    assert len(batch.trajectories) == 4 and branches
    for traj in batch.trajectories:
        traj.check()
        assert traj.finish_reason == "eos"
        assert_equal_to_template(tok, traj, conversation(traj))


def test_tags_rollout_equals_template_rendering(tok):
    # The tag format: one assistant message holding calls and results; no tools= given.
    def script(engine, rid, ids):
        k = engine.count(ids, "<result>")
        if k < 2:
            return Step(f"<think>step {k}</think><python>print({k})</python>")
        return Step(ANSWER, finish="eos")

    p = RolloutPrompt("q", render_prompt_ids(SYSTEM, tok))
    batch = rollout([p], ScriptedEngine(tok, script), FakeTools(),
                    settings(call_format="tags"), strategy="grpo")
    [traj] = batch.trajectories
    content = tok.decode(traj.response_ids[:-1])
    assert content.count("<result>") == 2
    assert_equal_to_template(tok, traj, SYSTEM + [{"role": "assistant", "content": content}],
                             tools=None)
    assert traj.loss_mask[-1] == 1 and traj.response_ids[-1] == tok.eos_token_id


@pytest.mark.parametrize("body, error", [
    ('{"name": "python", "arguments": {"code": "print(1)"', "not valid JSON"),
    ('{"name": "shell", "arguments": {"code": "ls"}}', "unknown tool 'shell' (available: python)"),
    ('{"name": "python", "arguments": {"source": "print(1)"}}', 'needs the argument "code"'),
    ('{"name": "python", "arguments": {"code": 7}}', 'needs the argument "code"'),
    ('["python"]', 'needs a "name" string'),
])
def test_malformed_calls_get_error_results_and_the_row_goes_on(tok, body, error):
    def script(engine, rid, ids):
        if responses_so_far(engine, ids) == 0:
            return Step(f"<tool_call>\n{body}\n</tool_call>", finish="eos")
        return Step(ANSWER, finish="eos")

    tools = hermes_tools()
    batch = rollout([prompt(tok)], ScriptedEngine(tok, script), tools, settings(),
                    strategy="grpo")
    [traj] = batch.trajectories
    [call] = traj.tool_calls
    assert not call.ok and call.error_kind == "error" and error in call.result
    assert tools.batches == []  # nothing was run
    forced = tok.decode(traj.response_ids[call.result_start : call.result_end])
    assert error in forced and "<tool_response>" in forced
    assert traj.finish_reason == "eos" and traj.response_ids[-1] == tok.eos_token_id
    assert batch.stats.tool_calls == 1  # an error result counts as a call, as with tags


def test_unclosed_call_is_an_error_and_text_without_call_ends_the_row(tok):
    def script(engine, rid, ids):
        if responses_so_far(engine, ids) == 0:
            return Step('<tool_call>\n{"name": "python"', finish="eos")
        return Step("no call here", finish="eos")

    batch = rollout([prompt(tok)], ScriptedEngine(tok, script), hermes_tools(), settings(),
                    strategy="grpo")
    [traj] = batch.trajectories
    [call] = traj.tool_calls
    assert "not closed" in call.result and not call.ok
    assert traj.finish_reason == "eos" and sum(s.is_model for s in traj.segments) == 2


def test_parallel_calls_share_one_tool_turn_and_limits_apply(tok):
    two = call_text("print(1)") + "\n" + call_text("print(2)")

    def script(engine, rid, ids):
        if responses_so_far(engine, ids) == 0:
            return Step(two, finish="eos")
        return Step(ANSWER, finish="eos")

    tools = hermes_tools()
    batch = rollout([prompt(tok)], ScriptedEngine(tok, script), tools,
                    settings(call_limit=1), strategy="grpo")
    [traj] = batch.trajectories
    first, second = traj.tool_calls
    assert [c.content for b in tools.batches for c in b] == ["print(1)"]  # only one ran
    assert first.result == "out:print(1)" and second.error_kind == "limit"
    assert second.result == LIMIT_MESSAGE.format(limit=1)
    assert (first.result_start, first.result_end) == (second.result_start, second.result_end)
    forced = tok.decode(traj.response_ids[first.result_start : first.result_end])
    assert forced.count("<tool_response>") == 2 and forced.count("<|im_start|>user") == 1
    assert batch.stats.tool_calls == 1


def test_on_limit_stop_ends_the_row_without_a_forced_eos(tok):
    tools = hermes_tools()
    batch = rollout([prompt(tok)], ScriptedEngine(tok, calls_then_answer(5)), tools,
                    settings(call_limit=1, on_limit="stop"), strategy="grpo")
    [traj] = batch.trajectories
    assert traj.finish_reason == "call_limit" and len(traj.tool_calls) == 1
    # The second call turn ended with its own sampled <|im_end|>: nothing forced after it.
    assert traj.segments[-1].is_model and traj.loss_mask[-1] == 1
    assert traj.response_ids[-1] == tok.eos_token_id


def test_sft_of_a_native_conversation_trains_what_the_rollout_samples(tok):
    # The same conversation as SFT data (OpenAI messages with tool_calls) and as a rollout:
    # identical ids, and the SFT loss mask is the rollout's (sampled 1, forced 0).
    from appo.data.sft import _messages, tokenize_conversation

    batch = rollout([prompt(tok)], ScriptedEngine(tok, calls_then_answer(2)), hermes_tools(),
                    settings(), strategy="grpo")
    [traj] = batch.trajectories
    messages = _messages(conversation(traj), "row")
    ex = tokenize_conversation(tok, messages, tools=SCHEMAS)
    n = len(traj.prompt_ids) + len(traj.response_ids)
    assert ex.input_ids[:n] == traj.prompt_ids + traj.response_ids
    assert ex.loss_mask[:n] == [0] * len(traj.prompt_ids) + traj.loss_mask
    assert tok.decode(ex.input_ids[n:]) == "\n" and ex.loss_mask[n:] == [0]


def test_sft_rejects_bad_tool_calls_and_templates_that_drop_them(tok):
    from appo.data.sft import _messages, tokenize_conversation
    from appo.errors import AppoError

    with pytest.raises(AppoError, match=r"tool_calls\[0\] must be"):
        _messages([{"role": "assistant", "content": None, "tool_calls": [{"function": {}}]}],
                  "row 3")
    messages = _messages([*SYSTEM, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "python", "arguments": {"code": "1"}}}]},
        {"role": "tool", "content": "1"}, {"role": "assistant", "content": ANSWER}], "row")
    plain = tiny_tokenizer()
    plain.chat_template = CHATML_TEMPLATE  # SmolLM2-like: tool_calls are not rendered
    with pytest.raises(AppoError, match="drops the tool_calls of assistant turn 2"):
        tokenize_conversation(plain, messages, tools=SCHEMAS)
