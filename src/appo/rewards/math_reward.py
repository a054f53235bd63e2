"""Math reward: the last `\\boxed{}` inside `<answer>`, checked by a real verifier.

Equivalence is decided by the `math-verify` package (sympy-backed), so `0.5`, `\\frac{1}{2}`
and `1/2` agree, `x = 5` matches `5`, and `1,000` matches `1000`. math-verify parses LaTeX
reliably only inside `$...$` or `\\boxed{}`, so bare ground truths are wrapped in `$...$`
first (bare `3\\sqrt{3} - 6` does not match `$3\\sqrt{3}-6$`; wrapped it does).

Deviation from the original: ARPO's math rows were graded by token F1 (see
`deep_research`); this function is the verifier-based grader of docs/algorithms.md
§6.2. It is binary
(score = accuracy = 0/1); a missing or unparsable answer scores 0 with the reason recorded.

math-verify guards its sympy calls with `signal.alarm`, which only works in the main
thread. Off the main thread the timeouts are switched off and the answer length bound
(`MAX_ANSWER_CHARS`) is what keeps a call short.
"""

from __future__ import annotations

import threading
from typing import Any

from appo.rewards.base import (
    MAX_ANSWER_CHARS,
    RewardOutput,
    as_answer_list,
    extract_final_answer,
    strip_results,
)

VERIFY_TIMEOUT_S = 5


def _wrap(expr: str) -> str:
    expr = expr.strip()
    if "$" in expr or "\\boxed" in expr or "\\(" in expr or "\\[" in expr:
        return expr
    return f"${expr}$"


def _squash(expr: str) -> str:
    return "".join(expr.split()).rstrip(".").lower()


def is_equivalent(prediction: str, gold: str) -> bool:
    """True if `prediction` and `gold` denote the same mathematical object."""
    if _squash(prediction) == _squash(gold):
        return True
    from math_verify import parse, verify

    in_main = threading.current_thread() is threading.main_thread()
    parse_timeout = VERIFY_TIMEOUT_S if in_main else None
    try:
        gold_parsed = parse(_wrap(gold), parsing_timeout=parse_timeout)
        pred_parsed = parse(_wrap(prediction), parsing_timeout=parse_timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=parse_timeout))
    except Exception:  # noqa: BLE001 - the verifier's failures mean "not shown equal"
        return False


def math_reward(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    lenient: bool = False,
) -> RewardOutput:
    answer, how = extract_final_answer(strip_results(solution_str), lenient=lenient)
    if answer is None:
        return RewardOutput(0.0, 0.0, False, how, reward_fn="math")
    if not answer:
        return RewardOutput(0.0, 0.0, False, "empty \\boxed{}", answer=answer, reward_fn="math")
    if len(answer) > MAX_ANSWER_CHARS:
        return RewardOutput(0.0, 0.0, False, f"answer longer than {MAX_ANSWER_CHARS} chars",
                            reward_fn="math")
    golds = as_answer_list(ground_truth)
    correct = any(is_equivalent(answer, gold) for gold in golds)
    return RewardOutput(
        score=float(correct),
        accuracy=float(correct),
        format_ok=True,
        reason=f"{'correct' if correct else 'wrong'} ({how})",
        answer=answer,
        reward_fn="math",
    )
