"""SFT data: conversations -> token ids + loss mask, through the model's own chat template.

Accepted rows: OpenAI `messages` (`[{role, content}]`) and LLaMA-Factory sharegpt
(`conversations: [{from, value}]` with `from` in human/gpt/system, optional `system`
column); `synth:` specs give gold demonstrations. A conversation without a system message
gets the template's, exactly as RL prompts do, so the model sees the same prompt in both;
`data.appo_stage_prompt` appends APPO's paragraph to every system message here too (not
twice: data built by APPO's own pipeline already ends with it).

Loss mask: 1 on assistant content and on the end-of-turn token (EOS) that closes it, 0 on
everything else. Inside assistant content, each tool result (`<result>...</result>` plus the
lead-in that `rollout.result_template` puts before it, a space by default) is masked too
(`mask_tool_results`; the original trained on results).

Native calls (`tools.format=hermes`): OpenAI rows may carry assistant `tool_calls` and
`tool` messages; the tool schemas go to the template as `tools=`. A call turn is trained as
the template renders it (content and `<tool_call>` blocks) plus its end-of-turn token; tool
turns and the following assistant header are not trained, exactly the split a hermes
rollout makes (docs/algorithms.md §5.4).

Tokenisation is per piece, not over the whole string: the chat-template prefix, each model
piece and each result are tokenised separately and concatenated. This is how a rollout
builds the sequence (sampled tokens, then the result tokenised on its own), so SFT teaches
exactly the token sequences the model later produces and sees. Token ids are the same with
and without result masking; only the mask differs.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from appo.data.records import Conversation, LoadStats, Message, SFTData, SFTExample
from appo.data.rl import ROLES, default_data_source
from appo.data.sources import parse_spec, read_spec_rows
from appo.data.synth.common import DEFAULT_RESULT_TEMPLATE
from appo.data.templates import apply_stage_prompt, render_system_prompt, repair_latex_escapes
from appo.errors import AppoError

# OpenAI `messages` rows may also hold native tool calls: assistant `tool_calls` and `tool`
# results (tools.format=hermes; the chat template renders both).
SFT_ROLES = (*ROLES, "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}


def result_pattern(result_template: str = DEFAULT_RESULT_TEMPLATE) -> re.Pattern[str]:
    """Matches one tool result block including the template's lead-in (an unclosed one runs
    to the end of the text)."""
    lead = result_template.split("<result>", 1)[0] if "<result>" in result_template else ""
    lead_re = f"(?:{re.escape(lead)})?" if lead else ""
    return re.compile(lead_re + r"<result>.*?(?:</result>|\Z)", re.DOTALL)


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI `tool_calls` (`[{type, function: {name, arguments}}]`; `{name, arguments}` is
    accepted too) in the form chat templates take."""
    if not isinstance(value, list) or not value:
        raise AppoError(f"{where}: 'tool_calls' must be a non-empty list")
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(
                fn.get("arguments"), dict | str):
            raise AppoError(f"{where}: tool_calls[{j}] must be {{'function': {{'name': str, "
                            f"'arguments': object or JSON string}}}}, got {str(call)[:80]!r}")
        calls.append({"type": "function",
                      "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return calls


def _messages(value: Any, where: str) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise AppoError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    out = []
    for i, m in enumerate(value):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        content = m.get("content") if isinstance(m, dict) else None
        if calls and m.get("role") == "assistant" and content is None:
            content = ""  # OpenAI: an assistant message that only calls has content null
        if not isinstance(m, dict) or m.get("role") not in SFT_ROLES or not isinstance(content, str):
            raise AppoError(
                f"{where}: messages[{i}] must be {{'role': one of {'/'.join(SFT_ROLES)}, "
                f"'content': str}}, got {str(m)[:80]!r}"
            )
        message: dict[str, Any] = {"role": m["role"], "content": repair_latex_escapes(content)}
        if calls:
            if m["role"] != "assistant":
                raise AppoError(f"{where}: messages[{i}] has tool_calls but role {m['role']!r}")
            message["tool_calls"] = _tool_calls(calls, f"{where}: messages[{i}]")
        if m["role"] == "tool" and isinstance(m.get("name"), str):
            message["name"] = m["name"]
        out.append(message)
    return out


def _sharegpt(row: dict[str, Any], where: str) -> list[Message]:
    turns = row["conversations"]
    if not isinstance(turns, list) or not turns:
        raise AppoError(f"{where}: 'conversations' must be a non-empty list of {{from, value}}")
    out = []
    system = row.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise AppoError(f"{where}: 'system' must be a string, got {type(system).__name__}")
        if system:
            out.append({"role": "system", "content": repair_latex_escapes(system)})
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or not isinstance(t.get("value"), str):
            raise AppoError(f"{where}: conversations[{i}] must be {{'from': ..., 'value': str}}")
        role = SHAREGPT_ROLES.get(t.get("from"))
        if role is None:
            raise AppoError(
                f"{where}: conversations[{i}] has from={t.get('from')!r}; supported: "
                f"{', '.join(SHAREGPT_ROLES)} (tool calls and results belong inside the gpt "
                "turn as <python>/<search> and <result> blocks)"
            )
        out.append({"role": role, "content": repair_latex_escapes(t["value"])})
    return out


def row_to_conversation(row: dict[str, Any], where: str, data_source: str = "") -> Conversation:
    if "messages" in row:
        messages = _messages(row["messages"], where)
    elif "conversations" in row:
        messages = _sharegpt(row, where)
    else:
        raise AppoError(
            f"{where}: not an SFT row: expected 'messages' (OpenAI) or 'conversations' "
            f"(sharegpt); columns are {', '.join(sorted(row))}"
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise AppoError(f"{where}: conversation has no assistant turn (nothing to train on)")
    source = row.get("data_source") if isinstance(row.get("data_source"), str) else data_source
    return Conversation(messages, source)


def _render(tokenizer: Any, messages: list[Message], add_generation_prompt: bool,
            tools: list[dict] | None = None) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise AppoError("the tokenizer has no chat template; SFT needs one to render turns")
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False,
            add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # noqa: BLE001 - jinja errors (e.g. role order rules) are data errors
        raise AppoError(f"the chat template rejected a conversation: {e}") from None


def conversation_pieces(
    tokenizer: Any,
    messages: list[Message],
    mask_tool_results: bool = True,
    result_template: str = DEFAULT_RESULT_TEMPLATE,
    tools: list[dict] | None = None,
) -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive (text, trained) pieces. `tools`: function
    schemas for the template (native calls); an assistant turn with `tool_calls` is trained
    as the template renders it (content and call blocks) up to its end-of-turn token; tool
    turns and the next assistant header are not trained, as in a hermes rollout."""
    full = _render(tokenizer, messages, False, tools)
    results = result_pattern(result_template)
    eos = getattr(tokenizer, "eos_token", None)
    pieces: list[tuple[str, bool]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], True, tools)
        if not full.startswith(prefix) or len(prefix) < cursor:
            raise AppoError(
                "the chat template does not render conversations prefix by prefix, so the "
                f"assistant turn {i} cannot be located"
            )
        if message.get("tool_calls"):
            cursor = _call_turn(full, prefix, cursor, message, eos, i, pieces)
            continue
        content = message["content"]
        if not full.startswith(content, len(prefix)):
            content = content.strip()  # templates that trim turns (Qwen, Llama)
            if not full.startswith(content, len(prefix)):
                raise AppoError(
                    f"the chat template rewrites assistant turn {i} (e.g. drops its <think> "
                    "part), so its tokens cannot be masked reliably; use a template that keeps "
                    "assistant text verbatim"
                )
        pieces.append((full[cursor : len(prefix)], False))
        at = 0
        for m in results.finditer(content):
            pieces += [(content[at : m.start()], True), (m.group(0), not mask_tool_results)]
            at = m.end()
        pieces.append((content[at:], True))
        cursor = len(prefix) + len(content)
        if eos and full.startswith(eos, cursor):
            pieces.append((eos, True))
            cursor += len(eos)
    pieces.append((full[cursor:], False))
    return [(text, trained) for text, trained in pieces if text]


def _call_turn(full: str, prefix: str, cursor: int, message: Message, eos: str | None, i: int,
               pieces: list[tuple[str, bool]]) -> int:
    """Pieces of an assistant turn with tool calls: the template's rendering of the turn,
    trained, through its end-of-turn token; returns the new cursor."""
    end = full.find(eos, len(prefix)) if eos else -1
    if end < 0:
        raise AppoError(f"the chat template renders assistant turn {i} (tool calls) without "
                        f"the end-of-turn token {eos!r}")
    turn = full[len(prefix) : end]
    missing = [c["function"]["name"] for c in message["tool_calls"]
               if c["function"]["name"] not in turn]
    if missing:
        raise AppoError(f"the chat template drops the tool_calls of assistant turn {i} "
                        f"({', '.join(missing)}; SmolLM2's does): use a template with tool "
                        "support, or tag-format data (tools.format=tags)")
    pieces += [(full[cursor : len(prefix)], False), (turn, True), (eos, True)]
    return end + len(eos)


def tokenize_conversation(
    tokenizer: Any,
    messages: list[Message],
    mask_tool_results: bool = True,
    result_template: str = DEFAULT_RESULT_TEMPLATE,
    data_source: str = "",
    tools: list[dict] | None = None,
) -> SFTExample:
    pieces = conversation_pieces(tokenizer, messages, mask_tool_results, result_template,
                                 tools)
    encoded = tokenizer([text for text, _ in pieces], add_special_tokens=False)["input_ids"]
    ids: list[int] = []
    mask: list[int] = []
    for (_, trained), piece_ids in zip(pieces, encoded, strict=True):
        ids += piece_ids
        mask += [int(trained)] * len(piece_ids)
    return SFTExample(ids, mask, data_source)


def load_conversations(
    specs: Sequence[str] | str,
    *,
    template: str = "math",
    tools: Sequence[str] | None = None,
    tool_instances: Any = None,
    result_template: str = DEFAULT_RESULT_TEMPLATE,
    stage_prompt: bool = False,
    call_format: str = "tags",
) -> list[Conversation]:
    """Conversations from SFT files and `synth:` specs (gold demonstrations); `stage_prompt`
    appends APPO's paragraph to each system message; `call_format` (`tools.format`) words
    the system prompt added to rows without one."""
    from appo.data.synth import synth_conversations

    if isinstance(specs, str):
        specs = [specs]
    convs: list[Conversation] = []
    for text in specs:
        spec = parse_spec(text)
        if spec.kind == "synth":
            if call_format != "tags":
                raise AppoError(f"{text}: synthetic SFT demonstrations are written in the tag "
                                f"format; tools.format={call_format} needs OpenAI rows with "
                                "tool_calls and tool messages")
            convs += synth_conversations(spec, template=template, tools=tools,
                                         tool_instances=tool_instances,
                                         result_template=result_template)
            continue
        source = spec.options.get("data_source") or default_data_source(spec.target)
        for i, row in enumerate(read_spec_rows(spec)):
            conv = row_to_conversation(row, f"{spec.target} row {i}", source)
            if conv.messages[0]["role"] != "system":
                conv.messages.insert(
                    0, {"role": "system",
                        "content": render_system_prompt(template, tools, call_format)}
                )
            convs.append(conv)
    if stage_prompt:
        for conv in convs:
            conv.messages = apply_stage_prompt(conv.messages)
    return convs


def load_sft_data(
    specs: Sequence[str] | str,
    tokenizer: Any,
    *,
    template: str = "math",
    tools: Sequence[str] | None = None,
    max_length: int = 1024,
    overlong: str = "skip",
    mask_tool_results: bool = True,
    result_template: str = DEFAULT_RESULT_TEMPLATE,
    tool_instances: Any = None,
    stage_prompt: bool = False,
    call_format: str = "tags",
    tool_schemas: list[dict] | None = None,
) -> SFTData:
    """Tokenised SFT examples. Examples longer than `max_length` tokens are dropped and
    counted (`overlong="skip"`) or raise (`"fail"`); nothing is silently truncated."""
    if overlong not in ("skip", "fail"):
        raise AppoError(f"overlong must be 'skip' or 'fail', got {overlong!r}")
    convs = load_conversations(specs, template=template, tools=tools,
                               tool_instances=tool_instances, result_template=result_template,
                               stage_prompt=stage_prompt, call_format=call_format)
    stats = LoadStats(rows=len(convs))
    examples = []
    for i, conv in enumerate(convs):
        ex = tokenize_conversation(tokenizer, conv.messages, mask_tool_results, result_template,
                                   conv.data_source, tool_schemas)
        stats.longest = max(stats.longest, len(ex))
        if len(ex) > max_length:
            if overlong == "fail":
                raise AppoError(
                    f"SFT example {i} ({conv.data_source}) has {len(ex)} tokens, more than "
                    f"sft.max_length={max_length} (raise it, or set data.overlong=skip)"
                )
            stats.skipped_overlong += 1
            continue
        stats.per_source[ex.data_source] += 1
        examples.append(ex)
    return SFTData(examples, stats)


def sft_data_from_config(
    cfg: Any, tokenizer: Any, split: str = "train", tool_instances: Any = None
) -> SFTData:
    """SFT examples for `sft.train_files` (split="train") or `sft.val_files` ("val")."""
    from appo.data.rl import template_tools
    from appo.data.templates import tools_from_config

    files = list(cfg.sft.train_files if split == "train" else cfg.sft.val_files)
    return load_sft_data(
        files,
        tokenizer,
        template=cfg.data.template,
        tools=tools_from_config(cfg),
        max_length=cfg.sft.max_length,
        overlong=cfg.data.overlong,
        mask_tool_results=cfg.sft.mask_tool_results,
        result_template=cfg.rollout.result_template,
        tool_instances=tool_instances,
        stage_prompt=cfg.data.appo_stage_prompt,
        call_format=cfg.tools.format,
        tool_schemas=template_tools(cfg),
    )


def show_loss_mask(tokenizer: Any, example: SFTExample, open_mark: str = "[[",
                   close_mark: str = "]]") -> str:
    """The decoded example with trained spans wrapped in markers (for `appo data inspect`)."""
    out, run, state = [], [], None
    for tok, m in zip(example.input_ids, example.loss_mask, strict=True):
        if m != state and run:
            text = tokenizer.decode(run)
            out.append(f"{open_mark}{text}{close_mark}" if state else text)
            run = []
        state = m
        run.append(tok)
    if run:
        text = tokenizer.decode(run)
        out.append(f"{open_mark}{text}{close_mark}" if state else text)
    return "".join(out)
