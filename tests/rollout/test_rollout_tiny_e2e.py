"""Every strategy end to end on tiny-test with the hf engine and tool calls.

tiny-test is a random model; a logit bias on `</python>` and EOS makes tool calls and
endings frequent so the loop, branches and cache forks are all exercised. Checks:
token-in/token-out (the trainer's ids are the sampled ids plus the tool-result ids, and
decoding them reproduces the transcript) and log-prob exactness against one full forward.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from rollout_fakes import FakeTools, full_logits

from appo.models import load_model
from appo.rollout import RolloutPrompt, RolloutSettings, rollout
from appo.rollout.hf_engine import HFEngine
from appo.rollout.scoring import hf_score_fn

TOL = 1e-4


class BiasedHead(torch.nn.Module):
    def __init__(self, inner, bias: dict[int, float]):
        super().__init__()
        self.inner = inner
        self.weight = inner.weight
        self.bias_ids = torch.tensor(list(bias))
        self.bias_values = torch.tensor(list(bias.values()))

    def forward(self, h):
        out = self.inner(h).clone()
        out[..., self.bias_ids] += self.bias_values
        return out


@pytest.fixture(scope="module")
def lm():
    lm = load_model("tiny-test", device="cpu")
    tok = lm.tokenizer
    close = tok.convert_tokens_to_ids("</python>")
    lm.model.lm_head = BiasedHead(lm.model.lm_head, {close: 4.0, tok.eos_token_id: 2.0})
    return lm


@pytest.mark.parametrize("strategy", ["grpo", "arpo", "aepo", "appo"])
def test_strategy_end_to_end_token_in_token_out(lm, strategy):
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=7)
    tools = FakeTools(reply=lambda tool, content: f"ran {len(content)} chars")
    s = RolloutSettings(n=6, initial_rollouts=3, max_response_length=90, call_limit=2,
                        branch_probability=0.7)
    prompts = [RolloutPrompt("a", tok.encode("Compute 6*7 with python.")),
               RolloutPrompt("b", tok.encode("Hi"))]
    batch = rollout(prompts, eng, tools, s, strategy=strategy, rng=random.Random(0),
                    score_fn=hf_score_fn(lm.model))
    assert {u: len(g) for u, g in batch.by_uid().items()} == {"a": 6, "b": 6}
    assert batch.stats.tool_calls > 0
    assert eng.live_rows == 0  # every engine row was released
    if strategy in ("arpo", "appo"):
        assert batch.stats.branches > 0
    for traj in batch.trajectories:
        traj.check()
        ids = traj.prompt_ids + traj.response_ids
        # Tool results are exactly the template's tokens; everything else was sampled.
        sampled = traj.sampled_mask()
        for call in traj.tool_calls:
            assert traj.response_ids[call.result_start : call.result_end] == tok.encode(
                f" <result>\n{call.result}\n</result>")[: call.result_end - call.result_start]
            assert not any(sampled[call.result_start : call.result_end])
        # Decoding the ids reproduces the transcript: the model's text up to each closing
        # tag, then the tool's answer exactly as the tool gave it, in the result template.
        text = tok.decode(traj.response_ids)
        pos = 0
        for call in traj.tool_calls:
            before = tok.decode(traj.response_ids[pos : call.result_start])
            assert before.endswith("</python>")
            result = tok.decode(traj.response_ids[call.result_start : call.result_end])
            if call.result_end < len(traj.response_ids) or not traj.truncated:
                assert result == f" <result>\n{call.result}\n</result>"
            pos = call.result_end
        assert text == "".join(tok.decode(traj.response_ids[seg.start : seg.end])
                               for seg in traj.segments)
        assert tok.decode(ids) == tok.decode(traj.prompt_ids) + text
        # Behaviour log-probs equal a full forward over the final ids (temperature 1).
        logp = torch.log_softmax(full_logits(lm.model, ids), dim=-1)
        p0 = len(traj.prompt_ids)
        errs = [abs(float(logp[p0 + i - 1, ids[p0 + i]]) - traj.logp_rollout[i])
                for i, m in enumerate(sampled) if m]
        assert max(errs) < TOL
    # What the tools were asked to run is what the trajectories record (branches copy their
    # parent's calls, so count the calls each row made itself; aepo's pre-monitoring rollout
    # also called the tools, and is not one of the trajectories).
    asked = Counter(c.content for batch_ in tools.batches for c in batch_)
    made = Counter(c.content for t in batch.trajectories for c in t.tool_calls
                   if c.error_kind != "limit"  # the limit notice runs no tool
                   and (t.branch_token_index is None or c.result_start > t.branch_token_index))
    assert made <= asked if strategy == "aepo" else made == asked
