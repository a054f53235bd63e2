"""The template check (`appo data check-template`, run before training with
`tools.format=hermes`): does the rollout build exactly the tokens the chat template renders?

A scripted conversation (system, user, an assistant call, its result, a second assistant turn
with two parallel calls (hermes) or a second call (tags), the results, the final answer) is
built two ways:

1. as the rollout builds it: the real `ToolLoop` drives a replay engine that "samples" each
   assistant turn's tokens (the template's own rendering of that turn, end-of-turn token
   included, tokenised on its own) and a replay tool runner that returns the scripted
   results; the forced tokens are whatever the loop's call format appends;
2. as the chat template renders the whole conversation (`apply_chat_template(tokenize=True)`).

It checks, failing with one `AppoError` line that names the first problem:
- every assistant turn ends with the end-of-turn token and that token is in the loss mask;
- the template is prefix-preserving: rendering the first k messages gives a prefix of the
  rendering of all of them (a template that rewrites earlier turns, e.g. drops reasoning
  from them, fails here);
- the two token sequences are equal (the template's may only add whitespace after the last
  end-of-turn token); otherwise the first differing position and both tokens are named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from appo.errors import AppoError
from appo.rollout.engine import SegmentOutput
from appo.rollout.loop import RolloutPrompt, ToolLoop
from appo.rollout.records import EngineCounters, Trajectory
from appo.rollout.rows import RowTable, TableRows
from appo.rollout.settings import RolloutSettings
from appo.tools.formats import DEFAULT_RESULT_TEMPLATE, function_schema, schema_argument

SYSTEM = "You are a helpful assistant. Think, call a tool when it helps, then answer."
QUESTION = "What is 6 * 7, and what is 2 + 3?"
RESULTS = ["42", "5", "5"]


@dataclass
class TemplateReport:
    """What a passing check measured."""

    call_format: str
    tokens: int  # prompt + response tokens of the scripted conversation
    sampled: int  # response tokens with loss_mask 1
    forced: int  # response tokens with loss_mask 0
    turns: int  # assistant turns (each ends with a sampled end-of-turn token)

    def line(self) -> str:
        return (f"template check ({self.call_format}): ok: {self.tokens} tokens equal the chat "
                f"template's rendering; {self.turns} assistant turn(s) end with a sampled "
                f"end-of-turn token; {self.sampled} sampled, {self.forced} forced tokens")


# ------------------------------------------------------------------ replay doubles
class _ReplayEngine(TableRows):
    """An engine whose decode returns scripted segments, one per call, in order."""

    def __init__(self, tokenizer: Any, segments: list[list[int]], eos_id: int | None):
        self.tokenizer = tokenizer
        self.rows = RowTable()
        self.counters = EngineCounters()
        self.segments = list(segments)
        self.eos_id = eos_id
        self.stop_strings: list[str] = []

    def set_stop_strings(self, stop_strings: list[str]) -> None:
        self.stop_strings = list(stop_strings)

    def reseed(self, seed: int) -> None:
        pass

    def decode(self, rows, max_new_tokens, params) -> list[SegmentOutput]:
        outs = []
        for rid in rows:
            ids = self.segments.pop(0) if self.segments else []
            self.rows.append(rid, ids)
            text = self.tokenizer.decode(ids)
            stop = next((s for s in self.stop_strings if text.endswith(s)), None)
            finish = ("eos" if ids and ids[-1] == self.eos_id else
                      "stop" if stop is not None else "length")
            outs.append(SegmentOutput(ids, [0.0] * len(ids), [0.0] * len(ids), finish, stop,
                                      topk_entropies=[0.0] * len(ids)))
        return outs


@dataclass
class _ReplayTools:
    tags: list[str]
    schemas: list[dict]
    results: list[str]
    calls: list = field(default_factory=list)

    def execute_many(self, calls: list) -> list:
        from appo.tools.base import ToolResult

        self.calls.extend(calls)
        return [ToolResult(self.results.pop(0)) for _ in calls]


# ------------------------------------------------------------------ the conversation
def _call(schema: dict, value: str) -> dict:
    fn = schema.get("function", schema)
    return {"type": "function", "function": {"name": fn["name"],
                                             "arguments": {schema_argument(schema): value}}}


def scripted_conversation(call_format: str, schemas: list[dict], tags: list[str],
                          result_template: str) -> tuple[list[dict], list[str]]:
    """The check's messages and, for tags, the model's text pieces between results."""
    head = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    answer = "<think>Both are known now.</think>\n<answer>\\boxed{42}, \\boxed{5}</answer>"
    if call_format == "hermes":
        s = schemas[0]
        return head + [
            {"role": "assistant", "content": "<think>First the product.</think>",
             "tool_calls": [_call(s, "print(6 * 7)")]},
            {"role": "tool", "name": s["function"]["name"], "content": RESULTS[0]},
            {"role": "assistant", "content": "",
             "tool_calls": [_call(s, "print(2 + 3)"), _call(s, "print(3 + 2)")]},
            {"role": "tool", "name": s["function"]["name"], "content": RESULTS[1]},
            {"role": "tool", "name": s["function"]["name"], "content": RESULTS[2]},
            {"role": "assistant", "content": answer},
        ], []
    tag = tags[0]
    pieces = [f"<think>First the product.</think>\n<{tag}>print(6 * 7)</{tag}>",
              f"\n<think>Then the sum.</think>\n<{tag}>print(2 + 3)</{tag}>", "\n" + answer]
    content = pieces[0]
    for piece, result in zip(pieces[1:], RESULTS, strict=False):
        content += result_template.replace("{text}", result) + piece
    return head + [{"role": "assistant", "content": content}], pieces


def _render(tokenizer, messages, tools, generation_prompt: bool, tokenize: bool = False):
    out = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=tokenize,
                                        add_generation_prompt=generation_prompt)
    if tokenize and (isinstance(out, dict) or hasattr(out, "input_ids")):
        out = out["input_ids"]
    return [int(i) for i in out] if tokenize else out


def _assistant_texts(tokenizer, messages, tools, eot: str) -> list[str]:
    """Each assistant turn as the template renders it when it is generated: the text after
    the generation prompt, up to and including the end-of-turn token."""
    texts = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], tools, True)
        upto = _render(tokenizer, messages[: i + 1], tools, False)
        if not upto.startswith(before):
            raise AppoError(f"template check: the chat template is not prefix-preserving: "
                            f"adding assistant message {i} changes the rendering before it "
                            f"(first difference at character {_first_diff(before, upto)})")
        turn = upto[len(before):]
        at = turn.find(eot)
        if at < 0:
            raise AppoError(f"template check: the chat template renders assistant message {i} "
                            f"without the end-of-turn token {eot!r}: the model's end of turn "
                            "would never be sampled or trained")
        texts.append(turn[: at + len(eot)])
    return texts


def _check_calls_rendered(tokenizer, messages, texts, schemas) -> None:
    """Each assistant message's `tool_calls` must render as calls the rollout reads back."""
    from appo.tools.formats import HermesFormat

    fmt = HermesFormat(tokenizer, schemas=schemas)
    turns = [m for m in messages if m["role"] == "assistant"]
    for i, (m, text) in enumerate(zip(turns, texts, strict=True)):
        want = [(c["function"]["name"], next(iter(c["function"]["arguments"].values())))
                for c in m.get("tool_calls") or []]
        got = [(c.tool, c.content) for c in fmt.parse(text) if c.error is None]
        if got != want:
            raise AppoError(f"template check (hermes): the chat template renders assistant turn "
                            f"{i + 1}'s {len(want)} tool call(s) as {text[-80:]!r}: not "
                            "<tool_call>{json}</tool_call> blocks (it drops or rewrites the "
                            "calls), so the rollout cannot reproduce it")


def _first_diff(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def _check_prefixes(tokenizer, messages, tools) -> None:
    full = _render(tokenizer, messages, tools, False)
    for k in range(1, len(messages)):
        if messages[k - 1]["role"] == messages[k]["role"] == "tool":
            continue  # consecutive results form one turn: only its end is a boundary
        gen = messages[k]["role"] == "assistant"
        part = _render(tokenizer, messages[:k], tools, gen)
        if not full.startswith(part):
            at = _first_diff(part, full)
            raise AppoError(
                f"template check: the chat template is not prefix-preserving: the rendering of "
                f"the first {k} messages is not a prefix of the whole conversation's (character "
                f"{at}: {part[at:at + 30]!r} vs {full[at:at + 30]!r})")


def _token(tokenizer, i: int) -> str:
    return f"{i} {tokenizer.decode([i])!r}"


# ------------------------------------------------------------------ the check
def check_template(tokenizer: Any, call_format: str = "hermes", schemas: list[dict] | None = None,
                   tags: list[str] | None = None,
                   result_template: str = DEFAULT_RESULT_TEMPLATE) -> TemplateReport:
    """Run the check (module docstring); raises `AppoError` naming the first problem."""
    tags = list(tags or ["python"])
    schemas = list(schemas) if schemas else [function_schema(t) for t in tags]
    eot, eot_id = tokenizer.eos_token, tokenizer.eos_token_id
    if eot is None or eot_id is None:
        raise AppoError("template check: the tokenizer has no end-of-turn (eos) token")
    if not getattr(tokenizer, "chat_template", None):
        raise AppoError("template check: the tokenizer has no chat template")
    tools = schemas if call_format == "hermes" else None
    messages, pieces = scripted_conversation(call_format, schemas, tags, result_template)
    _check_prefixes(tokenizer, messages, tools)
    if call_format == "hermes":
        texts = _assistant_texts(tokenizer, messages, tools, eot)
        _check_calls_rendered(tokenizer, messages, texts, schemas)
    else:
        [final] = _assistant_texts(tokenizer, messages, tools, eot)
        texts = pieces[:-1] + [final[final.rfind(pieces[-1]):]]
    segments = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    prompt_ids = _render(tokenizer, messages[:2], tools, True, tokenize=True)
    settings = RolloutSettings(n=1, initial_rollouts=1, call_limit=10, call_format=call_format,
                               result_template=result_template, max_response_length=1 << 20,
                               max_prompt_length=None)
    engine = _ReplayEngine(tokenizer, segments, eot_id)
    runner = _ReplayTools(tags=tags, schemas=schemas, results=list(RESULTS))
    loop = ToolLoop(engine, runner, settings)
    row = loop.start(RolloutPrompt("check", prompt_ids))
    loop.run_until_done([row])
    traj = row.traj
    turns = len(texts) if call_format == "hermes" else 1
    _check_turn_ends(traj, eot_id, turns, tokenizer)
    _compare(tokenizer, traj.prompt_ids + traj.response_ids,
             _render(tokenizer, messages, tools, False, tokenize=True), call_format)
    sampled = sum(traj.loss_mask)
    return TemplateReport(call_format, len(traj.prompt_ids) + len(traj.response_ids), sampled,
                          len(traj.response_ids) - sampled, turns)


def _check_turn_ends(traj: Trajectory, eot_id: int, turns: int, tokenizer) -> None:
    """The last token of each of the `turns` assistant turns (the last `turns` model
    segments; tags: one turn holds every segment) is a sampled end-of-turn token."""
    if traj.finish_reason != "eos":
        raise AppoError(f"template check: the scripted rollout ended with "
                        f"{traj.finish_reason!r} instead of the final end-of-turn token")
    ends = [s.end - 1 for s in traj.segments if s.is_model][-turns:]
    for p in ends:
        if traj.response_ids[p] != eot_id:
            raise AppoError(f"template check: an assistant turn ends with "
                            f"{_token(tokenizer, traj.response_ids[p])}, not the end-of-turn "
                            f"token {_token(tokenizer, eot_id)}")
        if traj.loss_mask[p] != 1:
            raise AppoError(f"template check: the end-of-turn token at response position {p} "
                            "is not in the loss mask")


def _compare(tokenizer, rollout: list[int], template: list[int], call_format: str) -> None:
    n = min(len(rollout), len(template))
    at = next((i for i in range(n) if rollout[i] != template[i]), None)
    if at is not None:
        raise AppoError(
            f"template check ({call_format}): token {at} differs: the rollout has "
            f"{_token(tokenizer, rollout[at])}, the chat template has "
            f"{_token(tokenizer, template[at])} (context {tokenizer.decode(template[max(0, at - 8):at])!r})")
    if len(rollout) > len(template):
        raise AppoError(f"template check ({call_format}): the rollout has {len(rollout)} "
                        f"tokens, the template {len(template)}: extra rollout token "
                        f"{_token(tokenizer, rollout[n])} at {n}")
    rest = tokenizer.decode(template[n:])
    if rest.strip():
        raise AppoError(f"template check ({call_format}): token {n} differs: the rollout "
                        f"ends, the chat template has {_token(tokenizer, template[n])}")


def check_call_format(cfg: Any, tokenizer: Any, announce: bool = True) -> None:
    """With `tools.format=hermes`, the template check (`appo data check-template`) on the
    model's tokenizer before anything trains: a template that would make the trained tokens
    differ from what its chat template renders stops the run with one line."""
    if cfg.tools.format != "hermes":
        return
    from appo.config import enabled_tool_names
    from appo.tools.registry import tool_schemas

    schemas = tool_schemas(cfg.tools)
    if not schemas:
        return  # no tools: nothing is called, every turn is a plain assistant turn
    report = check_template(tokenizer, "hermes", schemas, enabled_tool_names(cfg.tools),
                            cfg.rollout.result_template)
    if announce:
        print(f"appo: {report.line()}", flush=True)
