"""The reward record and the answer-extraction helpers every reward function shares.

A reward is a pure function of strings: `(solution_str, ground_truth, extra_info) ->
RewardOutput`. It never raises on a strange completion (no tags, unbalanced braces, a
megabyte of garbage): such a completion gets the function's failure score and the reason is
recorded in `RewardOutput.reason`, so the trainer can log why trajectories failed.

Answer extraction follows the ARPO convention: the final answer sits in
`<answer> ... \\boxed{...} </answer>`. `extract_final_answer(..., lenient=True)` adds
fallbacks for models that were never taught the format (no-tool baselines, foreign
checkpoints): any `\\boxed{}`, then the bare `<answer>` text, then the last number.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Bounds the work a single reward call can cause (math-verify on a 100 kB "answer" would
# take minutes); longer answers are scored as failures with this reason.
MAX_ANSWER_CHARS = 1000

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Tool output blocks: the tag format's <result> and the native format's <tool_response>.
_RESULT_BLOCK = re.compile(r"<result>.*?(?:</result>|\Z)|<tool_response>.*?(?:</tool_response>|\Z)",
                           re.DOTALL)
_BOXED_START = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass
class RewardOutput:
    """What a reward function returns for one trajectory.

    `score` is the shaped scalar the advantage estimator uses; `accuracy` is the plain
    correctness (0/1, or token F1 where that is the task's measure) that the trainer logs
    separately, so format shaping never hides whether answers got better.
    """

    score: float
    accuracy: float = 0.0
    format_ok: bool = True
    reason: str = ""
    answer: str | None = None
    reward_fn: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or `\\boxed 5`) in `text`.

    Braces are matched, so `\\boxed{\\frac{1}{2}}` gives `\\frac{1}{2}`. An unclosed last box
    gives None: the model stopped mid-answer, which is a failure, not an earlier answer.
    """
    starts = list(_BOXED_START.finditer(text))
    if not starts:
        return None
    i = starts[-1].end()
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        depth = 0
        for j in range(i, len(text)):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    return text[i + 1 : j].strip()
        return None
    if i > starts[-1].end():  # "\boxed 5": the old-style argument without braces
        token = re.match(r"[^\s$]+", text[i:])
        return token.group(0) if token else None
    return None


def answer_blocks(text: str) -> list[str]:
    """Contents of every complete `<answer>...</answer>` block, in order."""
    return _ANSWER_BLOCK.findall(text)


def strip_results(text: str) -> str:
    """Remove `<result>...</result>` and `<tool_response>...</tool_response>` blocks (an
    unclosed one runs to the end).

    Tool output is not model output: without this, code that prints
    `<answer>\\boxed{42}</answer>` would be graded as the model's answer.
    """
    return _RESULT_BLOCK.sub("", text)


def extract_final_answer(text: str, lenient: bool = False) -> tuple[str | None, str]:
    """(answer, how) where `how` names the rule used, or (None, failure reason).

    Strict: the last `\\boxed{}` inside the last `<answer>` block. Lenient adds, in order:
    the last `\\boxed{}` anywhere, the whole text of the last `<answer>` block, the last
    number in the text.
    """
    blocks = answer_blocks(text)
    if blocks:
        boxed = last_boxed(blocks[-1])
        if boxed is not None:
            return boxed, "boxed in <answer>"
    if not lenient:
        if not blocks:
            return None, "no <answer>...</answer> block"
        return None, "no \\boxed{} in <answer>"
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, "boxed outside <answer>"
    if blocks and blocks[-1].strip():
        return blocks[-1].strip(), "bare <answer> text"
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1].replace(",", ""), "last number"
    return None, "no answer found"


def as_answer_list(ground_truth: Any) -> list[str]:
    """Ground truths as a list of strings: a string, a number, or a list/tuple/array of them."""
    if isinstance(ground_truth, str):
        return [ground_truth]
    if isinstance(ground_truth, bool):
        return [str(ground_truth).lower()]
    if isinstance(ground_truth, int):
        return [str(ground_truth)]
    if isinstance(ground_truth, float):
        return [str(int(ground_truth)) if ground_truth.is_integer() else repr(ground_truth)]
    if ground_truth is None:
        return []
    try:
        return [item for value in ground_truth for item in as_answer_list(value)]
    except TypeError:
        return [str(ground_truth)]
