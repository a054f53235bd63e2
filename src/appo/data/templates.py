"""Prompt templates: the system prompt that teaches the tag format, per task and tool set.

Templates (`data.template`): `code_search` (search + python: the original ARPO system prompt,
with its broken `\\x08oxed` repaired to `\\boxed`), `math` (python only), `search` (search
only). The tool tags a prompt describes follow the configured tools, not the template name:
`math` with tools {python} describes `<python>` only; with no tools it describes just
`<think>` and `<answer>`. `code_search` with exactly {search, python} reproduces the
original text verbatim; any other tool set gets the composed wording below.

`data.appo_stage_prompt` appends APPO's reasoning-stage paragraph (`APPO_STAGE_PROMPT`) to
the system prompt, as the original APPO rollout did (`add_stage_prompt`).

Also here: `repair_latex_escapes`, which undoes the original data's LaTeX commands whose
backslash was eaten by a non-raw Python string (`\\b` -> `\\x08`, `\\f` -> `\\x0c`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from appo.errors import AppoError

# The original system prompt of every ARPO training row (data/arpo/rl/*.parquet), repaired.
ORIGINAL_CODE_SEARCH_PROMPT = (
    "You are a helpful assistant that can solve the given question step by step with the help "
    "of the wikipedia search tool and python interpreter tool. Given a question, you need to "
    "first think about the reasoning process in the mind and then provide the answer. During "
    "thinking, you can invoke the wikipedia search tool to search and python interpreter tool "
    "to calculate the math problem for fact information about specific topics if needed. The "
    "reasoning process and answer are enclosed within <think> </think> and <answer> </answer> "
    "tags respectively, and the search query and result are enclosed within <search> </search> "
    "and <result> </result> tags respectively. For example, <think> This is the reasoning "
    "process. </think> <search> search query here </search> <result> search result here "
    "</result> <think> This is the reasoning process. </think> <python> python code here "
    "</python> <result> python interpreter result here </result> <think> This is the reasoning "
    "process. </think> <answer> The final answer is \\[ \\boxed{answer here} \\] </answer>. In "
    "the last part of the answer, the final exact answer is enclosed within \\boxed{} with "
    "latex format."
)

# The paragraph the original APPO appends to every prompt's system message
# (AMAP-ML/APPO cognitive_pipeline/config.py, COGNITIVE_SYSTEM_PROMPT_ADDON), verbatim. Its
# rollout inserts these tokens right before the system turn's closing <|im_end|>, so the
# text lands at the end of the system content, leading blank line and final newline kept.
APPO_STAGE_PROMPT = (
    "\n\nWhen you feel that a paragraph of your reasoning forms a self-contained stage "
    "(for example: a quick judgment, a planning step, a deduction, an induction, "
    "a hypothesis, integrating tool feedback, or a metacognitive correction), "
    "wrap that paragraph with <|extra_0|>...<|extra_1|>. "
    "Do not annotate tool calls or their results \u2014 only wrap pure reasoning paragraphs. "
    "Not every paragraph needs a tag; only use <|extra_0|> when a stage boundary is clear.\n"
)


def add_stage_prompt(system: str) -> str:
    """`system` with APPO_STAGE_PROMPT appended (unchanged if it already holds it: SFT data
    built by APPO's pipeline carries the paragraph, and appending twice helps no one)."""
    if APPO_STAGE_PROMPT.strip() in system:
        return system
    return system + APPO_STAGE_PROMPT


def apply_stage_prompt(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Messages whose system message (first; appo's prompts always have one) ends with the
    APPO paragraph. A new list; the input is not modified."""
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = add_stage_prompt(out[0]["content"])
    return out


# Only these broken escapes are repaired: a control character followed by the rest of a
# LaTeX command name. Other control characters in the data are genuine (e.g. \x0c standing
# for a PDF "fi" ligature in "\x0cnd") and are left alone.
_BROKEN_LATEX = {"\x08oxed": "\\boxed", "\x0crac": "\\frac"}
_BROKEN_LATEX_RE = re.compile("|".join(re.escape(k) for k in _BROKEN_LATEX))


def repair_latex_escapes(text: str) -> str:
    return _BROKEN_LATEX_RE.sub(lambda m: _BROKEN_LATEX[m.group(0)], text)


@dataclass(frozen=True)
class ToolDoc:
    phrase: str  # "a python interpreter": how the opening sentence names the tool
    usage: str  # one sentence telling when and how to call it
    example: str  # one call + result, as in the format example


TOOL_DOCS: dict[str, ToolDoc] = {
    "python": ToolDoc(
        phrase="a python interpreter",
        usage="To calculate, write python code within <python> </python>; what it prints is "
        "returned within <result> </result>.",
        example="<python> python code here </python> <result> python output here </result>",
    ),
    "search": ToolDoc(
        phrase="a search tool",
        usage="To look up facts, write a search query within <search> </search>; the search "
        "results are returned within <result> </result>.",
        example="<search> search query here </search> <result> search results here </result>",
    ),
}


def tool_doc(tag: str) -> ToolDoc:
    """The documentation of a tool tag; tools without an entry get a generic description."""
    if tag in TOOL_DOCS:
        return TOOL_DOCS[tag]
    return ToolDoc(
        phrase=f"a {tag} tool",
        usage=f"To use the {tag} tool, write its input within <{tag}> </{tag}>; its output is "
        "returned within <result> </result>.",
        example=f"<{tag}> {tag} input here </{tag}> <result> {tag} output here </result>",
    )


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    task: str  # completes "You are a helpful assistant that ..."
    default_tools: tuple[str, ...]
    original: str | None = None  # verbatim text used when the tools equal default_tools

    def system_prompt(self, tools: Sequence[str] | None = None, call_format: str = "tags") -> str:
        tags = tuple(self.default_tools if tools is None else tools)
        if call_format == "hermes":
            return compose_native_prompt(self.task, tags)
        if self.original is not None and sorted(tags) == sorted(self.default_tools):
            return self.original
        return compose_system_prompt(self.task, tags)


def compose_system_prompt(task: str, tools: Sequence[str]) -> str:
    docs = [tool_doc(t) for t in tools]
    helpers = ""
    if docs:
        names = [d.phrase for d in docs]
        helpers = " with the help of " + (
            names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        )
    think = "<think> reasoning here </think>"
    steps = " ".join(f"{think} {d.example}" for d in docs)
    example = f"{steps} {think}" if steps else think
    return " ".join(
        [
            f"You are a helpful assistant that {task} step by step{helpers}.",
            "First think about the reasoning process, then give the answer. The reasoning is "
            "enclosed within <think> </think> and the answer within <answer> </answer>.",
            *(d.usage for d in docs),
            f"For example, {example} <answer> \\boxed{{answer here}} </answer>.",
            "The final exact answer is enclosed within \\boxed{} in latex format.",
        ]
    )


def compose_native_prompt(task: str, tools: Sequence[str]) -> str:
    """The system prompt for native calls (`tools.format=hermes`): the chat template lists
    the tools and shows the call syntax, so the prompt only names them and keeps the
    reasoning / answer tags the rewards read."""
    helpers = f" with the help of the provided tools ({', '.join(tools)})" if tools else ""
    return " ".join(
        [
            f"You are a helpful assistant that {task} step by step{helpers}.",
            "First think about the reasoning process, then give the answer. The reasoning is "
            "enclosed within <think> </think> and the answer within <answer> </answer>.",
            *(["Call a tool whenever it helps; its result is returned to you."] if tools else []),
            "For example, <think> reasoning here </think> <answer> \\boxed{answer here} "
            "</answer>.",
            "The final exact answer is enclosed within \\boxed{} in latex format.",
        ]
    )


TEMPLATES: dict[str, PromptTemplate] = {
    "code_search": PromptTemplate(
        name="code_search",
        task="solves the given question",
        default_tools=("search", "python"),
        original=ORIGINAL_CODE_SEARCH_PROMPT,
    ),
    "math": PromptTemplate(name="math", task="solves the given math problem",
                           default_tools=("python",)),
    "search": PromptTemplate(name="search", task="answers the given question",
                             default_tools=("search",)),
}


def get_template(name: str) -> PromptTemplate:
    if name not in TEMPLATES:
        raise AppoError(f"unknown prompt template {name!r} (choose from {', '.join(TEMPLATES)})")
    return TEMPLATES[name]


def render_system_prompt(template: str, tools: Sequence[str] | None = None,
                         call_format: str = "tags") -> str:
    """The system prompt of `template` describing `tools` (None: the template's own set) in
    the call format `call_format` (`tools.format`)."""
    return get_template(template).system_prompt(tools, call_format)


def build_messages(
    question: str, template: str, tools: Sequence[str] | None = None, call_format: str = "tags"
) -> list[dict[str, str]]:
    """A [system, user] chat prompt for `question`."""
    return [
        {"role": "system", "content": render_system_prompt(template, tools, call_format)},
        {"role": "user", "content": question},
    ]


def tools_from_config(cfg: Any) -> list[str]:
    """The tool tags a run uses: `tools.tool_instances` keys, in order, filtered by
    `tools.enabled`."""
    from appo.config import enabled_tool_names

    return enabled_tool_names(cfg.tools)
