"""The original ARPO reward (`deep_research.compute_score`), rule for rule.

ARPO trained on all of its data (math and multi-hop QA alike) with this function:

1. Format check; any failure scores -1:
   - `<think>` and `</think>` occur equally often, at least once;
   - exactly one `<answer>` and one `</answer>`, in that order, and the answer contains
     `\\boxed{` (and a closing brace);
   - every `<search>` (then every `<python>`), scanning left to right, is followed in order
     by its `</search>`, a `<result>` and a `</result>`; the scan resumes after that
     `</result>`.
2. The answer is the last `\\boxed{}` in the `<answer>` block; none extractable -> -1.
3. Score = token F1 against the ground truth(s) (SQuAD normalisation, yes/no mismatch 0),
   plus 0.1 when F1 > 0 and the trajectory contains both `</search>` and `</python>`.

With `tools.format=hermes` (`call_format="hermes"`, passed by `router_from_config`) rule 1's
tool rule is its native counterpart: every `<tool_call>` is followed by `</tool_call>` and a
complete `<tool_response>` block, with at least as many responses as calls; the bonus needs
calls named `search` and `python`.

Kept on purpose, although questionable: math answers are graded by token F1 (so `1/2` vs
`0.5` is wrong), tool results are not stripped before the checks, and the bonus needs both
tools. Use `math` / `qa` for the corrected graders.
"""

from __future__ import annotations

import re
from typing import Any

from appo.errors import AppoError
from appo.rewards.base import RewardOutput, as_answer_list, last_boxed
from appo.rewards.qa_reward import token_f1

FORMAT_FAILURE_SCORE = -1.0
BOTH_TOOLS_BONUS = 0.1


def _tag_calls_error(text: str) -> str | None:
    """The tag format (the original): every `<search>` (then every `<python>`) is followed in
    order by its closing tag, `<result>` and `</result>`."""
    for tag in ("search", "python"):
        pos = 0
        while (start := text.find(f"<{tag}>", pos)) != -1:
            close = text.find(f"</{tag}>", start)
            result_open = text.find("<result>", start)
            result_close = text.find("</result>", result_open) if result_open != -1 else -1
            if -1 in (close, result_open, result_close):
                return f"<{tag}> without a complete </{tag}> <result> </result> after it"
            if not start < close < result_open < result_close:
                return f"<{tag}> / <result> tags out of order"
            pos = result_close
    return None


def _native_calls_error(text: str) -> str | None:
    """The native counterpart (tools.format=hermes): every `<tool_call>` is followed in order
    by `</tool_call>`, `<tool_response>` and `</tool_response>` (parallel calls: one
    response per call)."""
    pos = 0
    while (start := text.find("<tool_call>", pos)) != -1:
        close = text.find("</tool_call>", start)
        if close == -1:
            return "<tool_call> without </tool_call>"
        response = text.find("<tool_response>", close)
        if response == -1 or text.find("</tool_response>", response) == -1:
            return "<tool_call> without a complete <tool_response> </tool_response> after it"
        pos = close + len("</tool_call>")
    if text.count("<tool_response>") < text.count("<tool_call>"):
        return "fewer <tool_response> blocks than <tool_call> blocks"
    return None


def _uses_both_tags(text: str) -> bool:
    return "</search>" in text and "</python>" in text


def _uses_both_native(text: str) -> bool:
    names = set(re.findall(r'<tool_call>\s*\{\s*"name"\s*:\s*"(\w+)"', text))
    return {"search", "python"} <= names


# tools.format -> (the tool-call format rule, the both-tools test of the bonus)
CALL_FORMAT_RULES = {
    "tags": (_tag_calls_error, _uses_both_tags),
    "hermes": (_native_calls_error, _uses_both_native),
}


def format_error(text: str, call_format: str = "tags") -> str | None:
    """The first format rule `text` breaks, or None if it follows them all."""
    n_think = text.count("<think>")
    if n_think != text.count("</think>"):
        return "<think> and </think> counts differ"
    if n_think == 0:
        return "no <think> block"
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return "expected exactly one <answer> and one </answer>"
    error = CALL_FORMAT_RULES[call_format][0](text)
    if error is not None:
        return error
    answer_open, answer_close = text.find("<answer>"), text.find("</answer>")
    if answer_open > answer_close:
        return "</answer> before <answer>"
    answer_text = text[answer_open:answer_close]
    if "\\boxed{" not in answer_text or "}" not in answer_text:
        return "no \\boxed{} in <answer>"
    return None


def deep_research_reward(
    solution_str: str, ground_truth: Any, extra_info: dict | None = None,
    call_format: str = "tags",
) -> RewardOutput:
    if call_format not in CALL_FORMAT_RULES:
        raise AppoError(f"deep_research: unknown call format {call_format!r} "
                        f"(choose from {', '.join(CALL_FORMAT_RULES)})")
    error = format_error(solution_str, call_format)
    if error is not None:
        return RewardOutput(FORMAT_FAILURE_SCORE, 0.0, False, f"bad format: {error}",
                            reward_fn="deep_research")
    open_at = solution_str.find("<answer>") + len("<answer>")
    answer = last_boxed(solution_str[open_at : solution_str.find("</answer>")])
    if answer is None:
        return RewardOutput(FORMAT_FAILURE_SCORE, 0.0, False, "cannot extract \\boxed{} answer",
                            reward_fn="deep_research")
    f1 = token_f1(answer, as_answer_list(ground_truth))
    both_tools = CALL_FORMAT_RULES[call_format][1](solution_str)
    bonus = BOTH_TOOLS_BONUS if f1 > 0 and both_tools else 0.0
    return RewardOutput(
        score=f1 + bonus,
        accuracy=f1,
        format_ok=True,
        reason=("correct" if f1 == 1.0 else "partial" if f1 > 0 else "wrong")
        + (" + both-tools bonus" if bonus else ""),
        answer=answer,
        reward_fn="deep_research",
        metrics={"f1": f1, "tool_bonus": bonus},
    )
