"""Tutorial reward (docs/tutorial.md): exact match of the last <answer>...</answer> block.

appo calls `compute_score` (the name in `custom_reward_function.name`) with the parameters
it declares, chosen from `data_source`, `solution_str` (the model's response),
`ground_truth` (the row's `answer`) and `extra_info`. It returns a number, or a dict with a
numeric `score` and, optionally, `acc`, `format_ok`, `reason` and more numbers to log.
"""

import re

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def compute_score(solution_str: str, ground_truth: str) -> dict:
    answers = ANSWER.findall(solution_str)
    if not answers:
        return {"score": -1.0, "acc": 0.0, "format_ok": False, "reason": "no <answer> block"}
    # Accept "ananab" as well as "\boxed{ananab}" inside the answer block.
    given = re.sub(r"\\boxed\{(.*)\}", r"\1", answers[-1]).strip().strip("'\"").lower()
    correct = given == str(ground_truth).strip().lower()
    return {"score": 1.0 if correct else 0.0, "acc": float(correct)}
