"""The tool loop (docs/algorithms.md §1) with a scripted engine: calls, results, limits,
budgets, records."""

from __future__ import annotations

import json

import pytest
from rollout_fakes import FakeTools, ScriptedEngine, Step, tiny_tokenizer

from appo.config import load_config
from appo.errors import AppoError
from appo.rollout import RolloutPrompt, RolloutSettings, read_jsonl, rollout, write_jsonl
from appo.rollout.engine import SegmentOutput
from appo.rollout.loop import LIMIT_MESSAGE, TOOL_LIMIT_MESSAGE, ToolLoop
from appo.rollout.settings import segment_entropy


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def results_so_far(engine, ids):
    return engine.count(ids, "<result>")


def calls_then_answer(calls: int, code=lambda k: f"print({k})"):
    def script(engine, rid, ids):
        k = results_so_far(engine, ids)
        if k < calls:
            return Step(f"<think>step {k}</think><python>{code(k)}</python>", entropy=1.0 + k)
        return Step("<answer>\\boxed{2}</answer>", entropy=0.5, finish="eos")

    return script


def settings(**kw):
    # `mean`: H_seg is then the scripted per-token entropy itself (the default measure,
    # seed_topk_sum, is checked in test_segment_entropy_measures).
    base = dict(n=1, initial_rollouts=1, max_response_length=400, call_limit=3,
                entropy_measure="mean")
    base.update(kw)
    return RolloutSettings(**base)


def prompt(tok, uid="q", text="What is 1+1?"):
    return RolloutPrompt(uid, tok.encode(text), extra={"ground_truth": "2"})


def test_tool_results_are_forced_tokens_in_the_template(tok):
    eng = ScriptedEngine(tok, calls_then_answer(2))
    tools = FakeTools()
    batch = rollout([prompt(tok)], eng, tools, settings(), strategy="grpo")
    [traj] = batch.trajectories
    traj.check()
    assert [c.content for c in traj.tool_calls] == ["print(0)", "print(1)"]
    assert [c.result for c in traj.tool_calls] == ["out:print(0)", "out:print(1)"]
    for call in traj.tool_calls:
        forced = traj.response_ids[call.result_start : call.result_end]
        assert forced == tok.encode(f" <result>\n{call.result}\n</result>")
        assert traj.loss_mask[call.result_start : call.result_end] == [0] * len(forced)
        assert traj.logp_rollout[call.result_start : call.result_end] == [0.0] * len(forced)
    sampled = sum(traj.loss_mask)
    assert sampled == len(traj.response_ids) - sum(c.result_end - c.result_start
                                                   for c in traj.tool_calls)
    assert traj.finish_reason == "eos" and not traj.truncated
    assert traj.response_ids[-1] == tok.eos_token_id
    assert traj.extra == {"ground_truth": "2"}
    # Segments alternate model / tool and carry H_seg for model segments.
    kinds = [s.is_model for s in traj.segments]
    assert kinds == [True, False, True, False, True]
    assert [s.entropy for s in traj.segments if s.is_model] == [1.0, 2.0, 0.5]


def test_content_is_the_last_call_of_the_segment_and_empty_calls_get_errors(tok):
    def script(engine, rid, ids):
        k = results_so_far(engine, ids)
        if k == 0:
            return Step("<python>old</python> text <python>new</python>")
        if k == 1:
            return Step("no opening tag here </python>")
        if k == 2:
            return Step("<python>   </python>")
        return Step("<answer>x</answer>", finish="eos")

    eng = ScriptedEngine(tok, script)
    batch = rollout([prompt(tok)], eng, FakeTools(), settings(), strategy="grpo")
    [traj] = batch.trajectories
    calls = traj.tool_calls
    assert [c.content for c in calls] == ["new", "", ""]
    assert [c.ok for c in calls] == [True, False, False]
    assert "empty" in calls[1].result and traj.finish_reason == "eos"


def test_calls_of_a_round_run_in_one_concurrent_batch(tok):
    eng = ScriptedEngine(tok, calls_then_answer(2))
    tools = FakeTools()
    rollout([prompt(tok, "a"), prompt(tok, "b")], eng, tools, settings(n=3, initial_rollouts=3),
            strategy="grpo")
    # 6 rows, each calling twice, all in step: two rounds of 6 calls.
    assert [len(b) for b in tools.batches] == [6, 6]


def test_call_limit_notify_lets_the_model_answer(tok):
    eng = ScriptedEngine(tok, calls_then_answer(4))
    tools = FakeTools()
    batch = rollout([prompt(tok)], eng, tools, settings(call_limit=2, on_limit="notify"),
                    strategy="grpo")
    [traj] = batch.trajectories
    assert sum(len(b) for b in tools.batches) == 2  # only 2 calls executed
    kinds = [c.error_kind for c in traj.tool_calls]
    assert kinds == [None, None, "limit", "limit"]
    assert traj.tool_calls[2].result == LIMIT_MESSAGE.format(limit=2)
    assert traj.finish_reason == "eos"
    assert batch.stats.tool_calls == 2


def test_per_tool_limit_notifies_below_the_total_limit(tok):
    # python may run once; the total limit (5) is not reached: calls 2-4 get the per-tool
    # notice, do not execute and do not count against the total.
    eng = ScriptedEngine(tok, calls_then_answer(4))
    tools = FakeTools()
    batch = rollout([prompt(tok)], eng, tools,
                    settings(call_limit=5, tool_call_limits={"python": 1}, on_limit="notify",
                             max_response_length=2000),
                    strategy="grpo")
    [traj] = batch.trajectories
    assert sum(len(b) for b in tools.batches) == 1
    assert [c.error_kind for c in traj.tool_calls] == [None, "limit", "limit", "limit"]
    assert traj.tool_calls[1].result == TOOL_LIMIT_MESSAGE.format(tool="python", limit=1)
    assert traj.finish_reason == "eos"
    stopped = rollout([prompt(tok)], ScriptedEngine(tok, calls_then_answer(4)), FakeTools(),
                      settings(call_limit=5, tool_call_limits={"python": 1}, on_limit="stop"),
                      strategy="grpo").trajectories[0]
    assert len(stopped.tool_calls) == 1 and stopped.finish_reason == "call_limit"


def test_call_limit_stop_ends_with_eos(tok):
    eng = ScriptedEngine(tok, calls_then_answer(4))
    batch = rollout([prompt(tok)], eng, FakeTools(), settings(call_limit=2, on_limit="stop"),
                    strategy="grpo")
    [traj] = batch.trajectories
    assert len(traj.tool_calls) == 2
    assert traj.finish_reason == "call_limit"
    assert traj.response_ids[-1] == tok.eos_token_id and traj.loss_mask[-1] == 0


def test_max_response_length_bounds_model_and_tool_tokens(tok):
    long_result = "x" * 50
    eng = ScriptedEngine(tok, calls_then_answer(3))
    tools = FakeTools(reply=lambda tool, content: long_result)
    first = len(tok.encode("<think>step 0</think><python>print(0)</python>"))
    limit = first + 20  # the first result does not fit
    batch = rollout([prompt(tok)], eng, tools, settings(max_response_length=limit),
                    strategy="grpo")
    [traj] = batch.trajectories
    assert len(traj.response_ids) == limit
    assert traj.truncated and traj.finish_reason == "length"
    assert traj.tool_calls[0].result_end == limit
    # A model segment cut by the budget is truncated too.
    eng2 = ScriptedEngine(tok, calls_then_answer(0))
    batch2 = rollout([prompt(tok)], eng2, FakeTools(), settings(max_response_length=5),
                     strategy="grpo")
    [t2] = batch2.trajectories
    assert len(t2.response_ids) == 5 and t2.truncated and t2.finish_reason == "length"


def test_prompt_longer_than_the_limit_is_a_clear_error(tok):
    eng = ScriptedEngine(tok, calls_then_answer(0))
    with pytest.raises(AppoError, match="max_prompt_length"):
        rollout([prompt(tok, text="a long prompt")], eng, FakeTools(),
                settings(max_prompt_length=3), strategy="grpo")


def test_segment_entropy_measures():
    ents = [1.0, 2.0, 3.0, 10.0]
    out = SegmentOutput([1, 2, 3, 4], [0.0] * 4, ents, "stop",
                        topk_entropies=[0.5, 1.0, 1.5, 5.0])
    s = settings(entropy_window=3, entropy_measure="mean")
    # mean of the full-vocabulary entropies over the first 3 tokens: (1+2+3)/3
    assert segment_entropy(out, s, 100) == pytest.approx(2.0)
    s2 = settings(entropy_window=3, entropy_measure="seed_topk_sum")
    # the original: top-10 entropies summed over the window / log|V| = 3.0 / log(100)
    assert segment_entropy(out, s2, 100) == pytest.approx(3.0 / 4.605170185988092)
    # ... which is the default (the scale entropy_weight and AEPO's beta were tuned on),
    # for the settings and for the config
    assert RolloutSettings(entropy_window=3).entropy_measure == "seed_topk_sum"
    assert segment_entropy(out, RolloutSettings(entropy_window=3), 100) == pytest.approx(
        3.0 / 4.605170185988092)
    assert RolloutSettings.from_config(load_config()).entropy_measure == "seed_topk_sum"


def test_jsonl_round_trip_is_lossless(tok, tmp_path):
    eng = ScriptedEngine(tok, calls_then_answer(2))
    batch = rollout([prompt(tok, "a"), prompt(tok, "b")], eng, FakeTools(),
                    settings(n=4, initial_rollouts=2, beam_size=2, branch_probability=1.0),
                    strategy="arpo")
    batch.trajectories[0].logp_rollout[0] = -0.1234567891234  # not float32-representable
    path = tmp_path / "t.jsonl"
    assert write_jsonl(batch.trajectories, path) == len(batch.trajectories)
    assert path.read_text().count("\n") == len(batch.trajectories)
    back = read_jsonl(path)
    assert back == batch.trajectories
    assert any(t.parent_id for t in back)


def test_jsonl_text_fields_decode_the_ids_and_are_dropped_on_read(tok, tmp_path):
    eng = ScriptedEngine(tok, calls_then_answer(1))
    batch = rollout([prompt(tok, "a")], eng, FakeTools(), settings(n=2, initial_rollouts=2),
                    strategy="grpo")
    path = tmp_path / "t.jsonl"
    write_jsonl(batch.trajectories, path, tokenizer=tok)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line, traj in zip(lines, batch.trajectories, strict=True):
        assert line["prompt_text"] == tok.decode(traj.prompt_ids)
        assert line["response_text"] == tok.decode(traj.response_ids)
        assert "<result>" in line["response_text"]  # the tool round is in the text
    assert read_jsonl(path) == batch.trajectories


def test_bad_jsonl_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"uid": "a"}\nnot json\n')
    with pytest.raises(AppoError, match="bad.jsonl:1"):
        read_jsonl(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(AppoError, match="bad.jsonl:1: .*must be a JSON object, got list"):
        read_jsonl(path)


def test_a_non_finite_reward_is_refused_before_writing(tok, tmp_path):
    eng = ScriptedEngine(tok, calls_then_answer(0))
    batch = rollout([prompt(tok)], eng, FakeTools(), settings(n=1, initial_rollouts=1),
                    strategy="grpo")
    batch.trajectories[0].reward = float("nan")
    with pytest.raises(AppoError, match="non-finite value nan"):
        write_jsonl(batch.trajectories, tmp_path / "t.jsonl")


def test_loop_releases_engine_rows(tok):
    eng = ScriptedEngine(tok, calls_then_answer(1))
    rollout([prompt(tok)], eng, FakeTools(), settings(n=4, initial_rollouts=2), strategy="arpo")
    assert eng.rows == {}
    ToolLoop(eng, None, settings())  # no tools: no stop strings, EOS only
    assert eng.stop_strings == []
