"""Tool-call formats (`tools.format`): how a model writes a call and how its result comes back.

- `tags` (default; the ARPO / AEPO / APPO format): `<python>code</python>` in the model's
  text, the segment stops at the closing tag, the result is `rollout.result_template`
  (`" <result>\\n{text}\\n</result>"`) appended inside the same assistant turn.
- `hermes` (Qwen2.5 / Qwen3 / Hermes native function calling): the tools are declared to the
  chat template (`tools=` of `apply_chat_template`, one JSON schema per tool), the model
  writes `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (one or more) and ends
  its turn with the end-of-turn token; the results come back as a `tool` turn that the chat
  template renders (`<tool_response>...` inside a user turn for Qwen), followed by the next
  assistant header.

Design decision (docs/algorithms.md §5.4): a hermes call turn ends at the end-of-turn token,
not at `</tool_call>`. The end-of-turn token is then sampled, so it carries the behaviour
log-prob and stays in the loss mask; stopping at `</tool_call>` would force it (loss mask 0,
the model never learns to end its call turn) or need a second decode. It also keeps
parallel calls (several `<tool_call>` blocks in one turn), which Qwen's template renders as
consecutive tool messages in one turn.

Token exactness: the forced tokens of a hermes tool turn are cut from the chat template's own
rendering (`HermesFormat.forced_text`): everything the template writes after the assistant's
end-of-turn token up to and including the next assistant header. `appo data check-template`
(`appo.rollout.template_check`) proves for a model that prompt + sampled + forced tokens
equal the template's rendering of the whole conversation.

Torch-free: the tokenizer is used through `encode` / `apply_chat_template` only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from appo.errors import AppoError

DEFAULT_RESULT_TEMPLATE = " <result>\n{text}\n</result>"


# ------------------------------------------------------------------ tool schemas
def function_schema(name: str, tool: Any = None) -> dict[str, Any]:
    """The OpenAI / Hermes function schema of a tool (instance or class).

    appo tools execute one string, so a schema has one required string argument: the
    tool's `argument` attribute (python: `code`, search: `query`; else `input`), described
    by `argument_description`; the function by `description`.
    """
    arg = getattr(tool, "argument", None) or "input"
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": getattr(tool, "description", None) or f"The {name} tool.",
            "parameters": {
                "type": "object",
                "properties": {arg: {
                    "type": "string",
                    "description": getattr(tool, "argument_description", None)
                    or f"The input of the {name} tool.",
                }},
                "required": [arg],
            },
        },
    }


def schema_argument(schema: Mapping[str, Any]) -> str:
    """The one required argument of a function schema."""
    fn = schema.get("function", schema)
    required = fn.get("parameters", {}).get("required") or []
    if len(required) != 1:
        raise AppoError(f"tool schema {fn.get('name')!r} must have exactly one required "
                        f"argument (appo tools run one string), got {required}")
    return str(required[0])


# ------------------------------------------------------------------ records
@dataclass
class ParsedCall:
    """One call read from a model segment.

    `tool`: the tool's name (tags: its tag) as written, "" when unreadable; `content`: the
    string the tool runs; `error`: set when the call cannot run (malformed JSON, unknown
    tool, missing argument): the text the model gets back instead of a result.
    """

    tool: str
    content: str
    error: str | None = None


class CallFormat(Protocol):
    name: str
    eos_after_limit: bool  # on_limit=stop appends EOS (the turn has not ended yet)

    def stop_strings(self) -> list[str]: ...

    def may_call(self, finish: str, last_id: int | None) -> bool: ...

    def parse(self, text: str, stop_string: str | None) -> list[ParsedCall]: ...

    def forced_text(self, outcomes: Sequence[tuple[ParsedCall, str]]) -> str: ...

    def template_tools(self) -> list[dict[str, Any]] | None: ...


# ------------------------------------------------------------------ tags
class TagFormat:
    """`<tag>content</tag>`; results formatted with `result_template` (docs §1.3)."""

    name = "tags"
    eos_after_limit = True

    def __init__(self, tokenizer: Any, tags: Sequence[str], schemas: Sequence[dict] = (),
                 result_template: str = DEFAULT_RESULT_TEMPLATE):
        self.tags = list(tags)
        self._close = {f"</{t}>": t for t in self.tags}
        self.result_template = result_template

    def stop_strings(self) -> list[str]:
        return list(self._close)

    def may_call(self, finish: str, last_id: int | None) -> bool:
        return finish == "stop"

    def parse(self, text: str, stop_string: str | None) -> list[ParsedCall]:
        """The last `<tag>...</tag>` of the segment (no opening tag: empty content, which
        the executor answers with an error)."""
        tag = self._close.get(stop_string or "")
        if tag is None:
            raise AppoError(f"engine stopped on unknown stop string {stop_string!r}")
        close, open_ = f"</{tag}>", f"<{tag}>"
        end = text.rfind(close)
        begin = text.rfind(open_, 0, end)
        content = "" if begin < 0 else text[begin + len(open_) : end].strip()
        return [ParsedCall(tag, content)]

    def forced_text(self, outcomes: Sequence[tuple[ParsedCall, str]]) -> str:
        return "".join(self.result_template.replace("{text}", text) for _, text in outcomes)

    def template_tools(self) -> None:
        return None


# ------------------------------------------------------------------ hermes
class HermesFormat:
    """Qwen / Hermes JSON calls, tools declared to the chat template (module docstring)."""

    name = "hermes"
    eos_after_limit = False  # the call turn already ended with the end-of-turn token
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tokenizer: Any, tags: Sequence[str] = (), schemas: Sequence[dict] = (),
                 result_template: str = DEFAULT_RESULT_TEMPLATE):
        if not getattr(tokenizer, "chat_template", None):
            raise AppoError("tools.format=hermes needs a tokenizer with a chat template")
        self.tokenizer = tokenizer
        self.schemas = [dict(s) for s in schemas]
        self.arguments = {s.get("function", s)["name"]: schema_argument(s) for s in self.schemas}
        self.eot = tokenizer.eos_token
        self.eot_id = tokenizer.eos_token_id
        if self.eot is None or self.eot_id is None:
            raise AppoError("tools.format=hermes needs a tokenizer with an end-of-turn "
                            "(eos) token")

    def stop_strings(self) -> list[str]:
        return []  # a call turn ends at the end-of-turn token, like every turn

    def may_call(self, finish: str, last_id: int | None) -> bool:
        # Another EOS (e.g. Qwen's <|endoftext|>) ends the conversation: the template's tool
        # turn only follows its own end-of-turn token.
        return finish == "eos" and last_id == self.eot_id

    def parse(self, text: str, stop_string: str | None = None) -> list[ParsedCall]:
        """Every `<tool_call>...</tool_call>` block of the turn, in order; an unclosed
        block is a malformed call (the model meant to call)."""
        if text.endswith(self.eot):
            text = text[: -len(self.eot)]
        calls, pos = [], 0
        while (begin := text.find(self.OPEN, pos)) >= 0:
            end = text.find(self.CLOSE, begin)
            if end < 0:
                calls.append(ParsedCall("", text[begin + len(self.OPEN):].strip(),
                                        f"Error: {self.OPEN} is not closed with {self.CLOSE}."))
                break
            calls.append(self.read_call(text[begin + len(self.OPEN) : end].strip()))
            pos = end + len(self.CLOSE)
        return calls

    def read_call(self, body: str) -> ParsedCall:
        """One call's JSON -> a ParsedCall (an error the model sees when it cannot run)."""
        usage = ('Write <tool_call>{"name": "TOOL", "arguments": {"ARGUMENT": "..."}}'
                 '</tool_call>.')
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            return ParsedCall("", body, f"Error: the tool call is not valid JSON ({e.msg} at "
                                        f"character {e.pos}). {usage}")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ParsedCall("", body, f'Error: a tool call needs a "name" string. {usage}')
        name = call["name"]
        if name not in self.arguments:
            known = ", ".join(self.arguments) or "none"
            return ParsedCall(name, body, f"Error: unknown tool {name!r} (available: {known}).")
        args = call.get("arguments", call.get("parameters"))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = None
        arg = self.arguments[name]
        value = args.get(arg) if isinstance(args, dict) else None
        if not isinstance(value, str):
            return ParsedCall(name, body, f'Error: {name} needs the argument "{arg}" (a '
                                          f'string) in "arguments". {usage}')
        return ParsedCall(name, value)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.schemas or None, tokenize=False,
            add_generation_prompt=generation_prompt)

    def forced_text(self, outcomes: Sequence[tuple[ParsedCall, str]]) -> str:
        """What the template writes after the assistant's end-of-turn token: the tool turn
        with every result, then the next assistant header. Cut from the rendering of a
        placeholder conversation (user, assistant with the calls, tool results)."""
        user = [{"role": "user", "content": "?"}]
        calls = [{"type": "function", "function": {"name": c.tool or "unknown", "arguments": {}}}
                 for c, _ in outcomes]
        tools = [{"role": "tool", "name": c.tool or "unknown", "content": text}
                 for c, text in outcomes]
        head = self._render(user, False)
        full = self._render(user + [{"role": "assistant", "content": "", "tool_calls": calls}]
                            + tools, True)
        if not full.startswith(head):
            raise AppoError("the chat template is not prefix-preserving: a conversation's "
                            "rendering does not start with the rendering of its first turn")
        tail = full[len(head):]
        at = tail.find(self.eot)
        if at < 0:
            raise AppoError(f"the chat template renders no end-of-turn token {self.eot!r} "
                            "after an assistant turn")
        return tail[at + len(self.eot):]

    def template_tools(self) -> list[dict[str, Any]]:
        return list(self.schemas)


CALL_FORMATS: dict[str, type] = {"tags": TagFormat, "hermes": HermesFormat}


def make_call_format(name: str, tokenizer: Any, tags: Sequence[str] = (),
                     schemas: Sequence[dict] | None = None,
                     result_template: str = DEFAULT_RESULT_TEMPLATE) -> CallFormat:
    """The `tools.format` named `name` for a tokenizer and tool set (schemas default to
    generic ones for the tags)."""
    if name not in CALL_FORMATS:
        raise AppoError(f"unknown tools.format {name!r} (choose from {', '.join(CALL_FORMATS)})")
    if schemas is None:
        schemas = [function_schema(t) for t in tags]
    return CALL_FORMATS[name](tokenizer, tags=tags, schemas=schemas,
                              result_template=result_template)
