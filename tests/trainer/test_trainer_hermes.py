"""An ARPO training step with native calls (`tools.format=hermes`) on tiny-test: the template
check runs first, tool turns are rendered by the chat template, forced tokens stay out of the
loss, every call turn's end-of-turn token is trained, and the update changes the weights."""

from __future__ import annotations

import torch
from test_trainer_rl import make_toy, toy_config

from appo.rollout import read_jsonl
from appo.rollout.engine import SegmentOutput
from appo.tools.base import ToolResult
from appo.trainer.loop import RLTrainer

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'


class EchoTool:
    """A python tool without a sandbox: every program prints 42."""

    name = tag = "python"
    argument = "code"
    description = "Run Python code."

    def __init__(self, name: str = "python", timeout: float = 1.0):
        self.name = self.tag = name

    def execute(self, content: str) -> ToolResult:
        return ToolResult("42")


class FirstTurnCalls:
    """The trainer's hf engine, except that a row's first segment is a scripted call turn
    (the random tiny model never writes one) with its true behaviour log-probs and
    entropies (temperature 1, the config's), so the update sees on-policy numbers."""

    def __init__(self, inner, model, tokenizer):
        self.inner, self.model = inner, model
        self.call_ids = tokenizer.encode(CALL, add_special_tokens=False) + [
            tokenizer.eos_token_id]
        self.marker = tokenizer.encode("<tool_response>\n", add_special_tokens=False)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _called(self, ids: list[int]) -> bool:
        m = self.marker
        return any(ids[i : i + len(m)] == m for i in range(len(ids) - len(m) + 1))

    @torch.no_grad()
    def _scripted(self, row: int) -> SegmentOutput:
        ids = self.inner.row_ids(row)
        full = torch.tensor([ids + self.call_ids])
        logp = torch.log_softmax(self.model(full).logits[0, len(ids) - 1 : -1].float(), -1)
        picked = logp.gather(1, torch.tensor(self.call_ids)[:, None])[:, 0].tolist()
        ent = (-(logp.exp() * logp).sum(-1)).tolist()
        top = logp.topk(10, -1).values
        top_ent = (-(top.exp() * top).sum(-1)).tolist()
        self.inner.append(row, self.call_ids)
        return SegmentOutput(list(self.call_ids), picked, ent, "eos", topk_entropies=top_ent)

    def decode(self, rows, max_new_tokens, params):
        fresh = {r for r in rows if not self._called(self.inner.row_ids(r))}
        rest = [(r, b) for r, b in zip(rows, max_new_tokens, strict=True) if r not in fresh]
        outs = dict(zip([r for r, _ in rest],
                        self.inner.decode([r for r, _ in rest], [b for _, b in rest], params)
                        if rest else [], strict=True))
        outs.update({r: self._scripted(r) for r in fresh})
        return [outs[r] for r in rows]


def test_arpo_step_in_hermes_format(tmp_path, capsys):
    toy = make_toy(tmp_path)
    cfg = toy_config(toy, "rollout.strategy=arpo", "tools.format=hermes",
                     "tools.tool_instances.python.class_path=test_trainer_hermes.EchoTool",
                     "data.max_response_length=200", "data.max_prompt_length=1024",
                     "trainer.total_steps=1",
                     f"trainer.rollout_data_dir={tmp_path / 'rollouts'}")
    trainer = RLTrainer(cfg, progress=False)
    assert "template check (hermes): ok" in capsys.readouterr().out
    # The prompt declares the tool to the template (tools=) and teaches no tags.
    prompt = trainer.tokenizer.decode(trainer._prompt_ids(trainer.train_data[0]))
    assert '"name": "python"' in prompt and "<python>" not in prompt
    trainer.engine = FirstTurnCalls(trainer.engine, trainer.model, trainer.tokenizer)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    [metrics] = trainer.fit()
    assert metrics["rollout/tool_calls_per_traj"] >= 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(),
                                                     strict=True))
    trajs = read_jsonl(tmp_path / "rollouts" / "step_00001.jsonl")
    assert len(trajs) == 2 * 4
    eot = trainer.tokenizer.eos_token_id
    for t in trajs:
        assert t.tool_calls and t.tool_calls[0].result == "42" and t.tool_calls[0].ok
        forced = [s for s in t.segments if not s.is_model]
        first_call = t.segments[0]
        assert t.response_ids[first_call.end - 1] == eot and t.loss_mask[first_call.end - 1] == 1
        for s in forced:
            assert t.loss_mask[s.start : s.end] == [0] * (s.end - s.start)
            assert "<tool_response>\n42\n</tool_response>" in trainer.tokenizer.decode(
                t.response_ids[s.start : s.end])
