"""RL and evaluation prompts from data specs: `data.train_files` / `data.val_files` -> RLExamples.

Row forms accepted (checked in this order):
- the original ARPO parquet: `prompt` (chat list, system + user; the column is
  `data.prompt_key`), `data_source`, `ability`, `reward_model.ground_truth`, `extra_info`.
  Broken LaTeX escapes (`\\x08oxed`) are repaired on load;
- question rows (eval JSONL and the like): `question` or `problem` (or a string under
  `prompt_key`) and `answer` (string, number or list of accepted strings); a GSM8K-style
  answer ending in `#### 42` becomes `42`. The prompt is built from the template.
- `ground_truth` may stand in for `answer`.

`data_source` comes from the spec option, else the row, else the file's name (its parent
directory for `test.jsonl`-like names). `ability` comes from the spec option, else the row,
else the reward route of the data source (gsm8k -> math, hotpotqa -> qa, ...), else `qa` for
list answers and `math` otherwise. Columns not used above are kept in `extra_info`.

A row that already carries a system message keeps it unless `system_prompt="template"`.
`stage_prompt=True` (`data.appo_stage_prompt`) appends APPO's reasoning-stage paragraph to
every prompt's system message, kept or rendered (the original APPO added it to whatever
system turn the prompt had).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from appo.data.records import LoadStats, Message, RLData, RLExample
from appo.data.sources import InMemoryRows, parse_spec, read_spec_rows, rows_from_object
from appo.data.templates import (
    apply_stage_prompt,
    build_messages,
    render_system_prompt,
    repair_latex_escapes,
)
from appo.errors import AppoError, warn_once

ROLES = ("system", "user", "assistant")
GENERIC_FILE_STEMS = {"test", "train", "valid", "validation", "dev", "eval", "data"}
QUESTION_KEYS = ("question", "problem")
ANSWER_KEYS = ("answer", "ground_truth")
SYSTEM_PROMPT_MODES = ("keep", "template")


def _where(file: str, index: int) -> str:
    return f"{file} row {index}"


def _check_messages(value: Any, where: str, key: str) -> list[Message]:
    if not isinstance(value, list | tuple) or not value:
        raise AppoError(f"{where}: column {key!r} must be a non-empty list of chat messages")
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise AppoError(
                f"{where}: {key}[{i}] must be {{'role': one of {'/'.join(ROLES)}, 'content': str}}, "
                f"got {str(m)[:80]!r}"
            )
        if m["role"] == "user" and not m["content"].strip():
            raise AppoError(f"{where}: {key}[{i}] is an empty user message (an empty prompt)")
        messages.append({"role": m["role"], "content": repair_latex_escapes(m["content"])})
    return messages


def _answer(value: Any, where: str, key: str) -> str | list[str]:
    if isinstance(value, bool) or value is None:
        raise AppoError(f"{where}: column {key!r} must be a string, number or list, got {value!r}")
    if isinstance(value, str):
        # GSM8K keeps the worked solution in `answer`; the gold number follows '####'.
        return value.rsplit("####", 1)[1].strip() if "####" in value else value
    if isinstance(value, int | float):
        return str(int(value)) if float(value).is_integer() else repr(value)
    if isinstance(value, list | tuple) and value and all(
        isinstance(v, str | int | float) and not isinstance(v, bool) for v in value
    ):
        return [v if isinstance(v, str) else str(v) for v in value]
    raise AppoError(
        f"{where}: column {key!r} must be a string, number or non-empty list of them, "
        f"got {type(value).__name__} {str(value)[:80]!r}"
    )


def default_data_source(path: str) -> str:
    p = Path(path.rstrip("/"))
    stem = p.stem if p.suffix else p.name
    return p.parent.name if stem.lower() in GENERIC_FILE_STEMS and p.parent.name else stem


def infer_ability(data_source: str, ground_truth: str | list[str]) -> str:
    from appo.rewards.router import DATA_SOURCE_ROUTES

    route = DATA_SOURCE_ROUTES.get(data_source)
    if route in ("math", "qa"):
        return route
    return "qa" if isinstance(ground_truth, list) else "math"


def row_to_example(
    row: dict[str, Any],
    index: int,
    file: str,
    *,
    template: str,
    tools: Sequence[str] | None,
    prompt_key: str = "prompt",
    data_source: str | None = None,
    ability: str | None = None,
    system_prompt: str = "keep",
    call_format: str = "tags",
) -> RLExample:
    where = _where(file, index)
    used = {prompt_key, "data_source", "ability", "reward_model", "extra_info"}
    prompt_value = row.get(prompt_key)
    question: str | None = None
    if isinstance(prompt_value, list | tuple):
        prompt = _check_messages(prompt_value, where, prompt_key)
        if prompt[0]["role"] != "system":
            prompt.insert(0, {"role": "system",
                              "content": render_system_prompt(template, tools, call_format)})
        elif system_prompt == "template":
            prompt[0] = {"role": "system",
                         "content": render_system_prompt(template, tools, call_format)}
    else:
        if isinstance(prompt_value, str):
            question, column = prompt_value, prompt_key
        else:
            key = next((k for k in QUESTION_KEYS if isinstance(row.get(k), str)), None)
            if key is None:
                bad = next((k for k in (prompt_key, *QUESTION_KEYS) if k in row), None)
                if bad is not None:
                    raise AppoError(
                        f"{where}: column {bad!r} must be a string (or, for {prompt_key!r}, a "
                        f"chat list), got {type(row[bad]).__name__}"
                    )
                raise AppoError(
                    f"{where}: no prompt column: expected {prompt_key!r} (chat list or string), "
                    f"'question' or 'problem'; columns are {', '.join(sorted(row))}"
                )
            question, column = row[key], key
            used.add(key)
        if not question.strip():
            # The model would be asked nothing and still be rewarded against the answer.
            raise AppoError(f"{where}: empty prompt (column {column!r})")
        question = repair_latex_escapes(question)
        prompt = build_messages(question, template, tools, call_format)

    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        ground_truth = _answer(reward_model["ground_truth"], where, "reward_model.ground_truth")
    else:
        key = next((k for k in ANSWER_KEYS if k in row), None)
        if key is None:
            raise AppoError(
                f"{where}: no answer column: expected 'reward_model.ground_truth', 'answer' or "
                f"'ground_truth'; columns are {', '.join(sorted(row))}"
            )
        ground_truth = _answer(row[key], where, key)
        used.add(key)

    source = data_source or row.get("data_source") or default_data_source(file)
    if not isinstance(source, str):
        raise AppoError(f"{where}: column 'data_source' must be a string, got {source!r}")
    skill = ability or row.get("ability") or infer_ability(source, ground_truth)
    if not isinstance(skill, str):
        raise AppoError(f"{where}: column 'ability' must be a string, got {skill!r}")

    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise AppoError(f"{where}: column 'extra_info' must be a mapping, got {type(extra).__name__}")
    extra_info = dict(extra or {})
    extra_info.update({k: v for k, v in row.items() if k not in used and v is not None})
    extra_info.setdefault("index", index)
    extra_info.setdefault("question", question if question is not None else prompt[-1]["content"])
    return RLExample(prompt, source, skill, ground_truth, extra_info)


def load_rl_data(
    specs: Sequence[str | InMemoryRows] | str,
    *,
    template: str = "math",
    tools: Sequence[str] | None = None,
    prompt_key: str = "prompt",
    tokenizer: Any = None,
    max_prompt_length: int | None = None,
    overlong: str = "skip",
    system_prompt: str = "keep",
    stage_prompt: bool = False,
    call_format: str = "tags",
    tool_schemas: list[dict] | None = None,
) -> RLData:
    """Load every spec into RLExamples.

    With a `tokenizer` and `max_prompt_length`, prompts longer than that (chat template
    applied, generation prompt included) are dropped and counted (`overlong="skip"`) or
    raise (`"fail"`). `stage_prompt`: append APPO's paragraph to each system message (before
    the length check, which therefore counts it). `call_format` (`tools.format`) picks the
    system prompt's wording; `tool_schemas` go to the chat template as `tools=` (hermes).
    """
    from appo.data import synth

    if isinstance(specs, str):
        specs = [specs]
    if overlong not in ("skip", "fail"):
        raise AppoError(f"overlong must be 'skip' or 'fail', got {overlong!r}")
    if system_prompt not in SYSTEM_PROMPT_MODES:
        raise AppoError(f"system_prompt must be one of {SYSTEM_PROMPT_MODES}, got {system_prompt!r}")
    stats = LoadStats()
    examples: list[RLExample] = []
    for text in specs:
        spec = parse_spec(text) if not isinstance(text, InMemoryRows) else None
        if spec is None:  # rows given in Python: read as a file's rows, no spec options
            loaded = [
                row_to_example(row, i, text.label, template=template, tools=tools,
                               prompt_key=prompt_key, system_prompt=system_prompt,
                               call_format=call_format)
                for i, row in enumerate(text.rows)
            ]
        elif spec.kind == "synth":
            items = synth.generate(spec, default_split="train")
            needed = synth.SYNTH_TASKS[spec.target].tools
            if tools is not None and not set(needed) <= set(tools):
                raise AppoError(
                    f"{text!r} needs the {', '.join(needed)} tool, but the configured tools "
                    f"are {', '.join(tools) or 'none'} (add it under tools.tool_instances)"
                )
            loaded = [
                RLExample(build_messages(it.question, template, tools, call_format),
                          it.data_source,
                          it.ability, it.answer, dict(it.extra_info))
                for it in items
            ]
        else:
            rows = read_spec_rows(spec)
            loaded = [
                row_to_example(
                    row, i, spec.target, template=template, tools=tools, prompt_key=prompt_key,
                    data_source=spec.options.get("data_source"),
                    ability=spec.options.get("ability"), system_prompt=system_prompt,
                    call_format=call_format,
                )
                for i, row in enumerate(rows)
            ]
        stats.rows += len(loaded)
        if stage_prompt:
            for ex in loaded:
                ex.prompt = apply_stage_prompt(ex.prompt)
        if tokenizer is not None and max_prompt_length is not None:
            loaded = _drop_overlong(loaded, tokenizer, max_prompt_length, overlong, text, stats,
                                    tool_schemas)
        examples.extend(loaded)
    for ex in examples:
        stats.per_source[ex.data_source] += 1
        stats.per_ability[ex.ability] += 1
    return RLData(examples, stats)


def render_prompt_ids(messages: list[Message], tokenizer: Any,
                      tools: list[dict] | None = None) -> list[int]:
    """The prompt's token ids: chat template applied (`tools`: function schemas declared to
    it, for native calls), generation prompt included."""
    if not getattr(tokenizer, "chat_template", None):
        raise AppoError("the model's tokenizer has no chat template, which renders every "
                        "prompt: use a chat (instruct) model, or add a chat_template to its "
                        "tokenizer_config.json")
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _drop_overlong(examples, tokenizer, limit, overlong, spec_text, stats,
                   tool_schemas=None) -> list[RLExample]:
    kept = []
    for ex in examples:
        ex.prompt_ids = render_prompt_ids(ex.prompt, tokenizer, tool_schemas)
        n = len(ex.prompt_ids)
        stats.longest = max(stats.longest, n)
        if n <= limit:
            kept.append(ex)
        elif overlong == "fail":
            raise AppoError(
                f"{spec_text}: prompt of row {ex.extra_info.get('index')} has {n} tokens, more "
                f"than data.max_prompt_length={limit} (raise it, or set data.overlong=skip)"
            )
        else:
            stats.skipped_overlong += 1
    return kept


def load_rl_examples(specs: Sequence[str] | str, **kwargs: Any) -> list[RLExample]:
    """`load_rl_data(...).examples`."""
    return load_rl_data(specs, **kwargs).examples


def rl_data_from_config(cfg: Any, split: str = "train", tokenizer: Any = None,
                        rows: Any = None) -> RLData:
    """RL prompts for `data.train_files` (split="train") or `data.val_files` ("val"); with
    `rows` (a list of dicts, a pyarrow Table, a `datasets.Dataset`: `rows_from_object`),
    those rows instead of the files, under the config's template and limits."""
    from appo.data.templates import tools_from_config

    if split not in ("train", "val"):
        raise AppoError(f"split must be 'train' or 'val', got {split!r}")
    files: list[str | InMemoryRows] = (
        [rows_from_object(rows, f"{split}_data")] if rows is not None
        else list(cfg.data.train_files if split == "train" else cfg.data.val_files))
    return load_rl_data(
        files,
        template=cfg.data.template,
        tools=tools_from_config(cfg),
        prompt_key=cfg.data.prompt_key,
        tokenizer=tokenizer,
        max_prompt_length=cfg.data.max_prompt_length if tokenizer is not None else None,
        overlong=cfg.data.overlong,
        stage_prompt=cfg.data.appo_stage_prompt,
        call_format=cfg.tools.format,
        tool_schemas=template_tools(cfg),
    )


def template_tools(cfg: Any) -> list[dict] | None:
    """What the chat template gets as `tools=`: the enabled tools' function schemas with
    `tools.format=hermes`, None with tags (the system prompt describes the tags)."""
    if cfg.tools.format != "hermes":
        return None
    from appo.tools.registry import tool_schemas

    return tool_schemas(cfg.tools) or None


def report_overlong(key: str, data: Any, limit: int) -> None:
    """Prompts dropped for length change what a run trains on: say how many, and why."""
    skipped = data.stats.skipped_overlong if data is not None else 0
    if not skipped or (skipped == data.stats.rows and key == "data.train_files"):
        return  # nothing dropped, or no training data at all: an error says so
    warn_once(f"{key}: skipped {skipped} of {data.stats.rows} prompts longer "
              f"than data.max_prompt_length={limit} tokens (longest {data.stats.longest}); raise "
              "it to keep them, or set data.overlong=fail to stop instead")
