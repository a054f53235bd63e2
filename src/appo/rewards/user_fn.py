"""A user's reward function and how it is called: one of two forms, told by parameter names.

- **verl's form**: parameters among `data_source, solution_str, ground_truth, extra_info`
  (verl's `compute_score`; only those declared are passed, by name, so the original ARPO
  `compute_score(solution_str, ground_truth, extra_info)` files load as they are).
- **the example form**: parameters among `completion, example` (issue 42's
  `def my_reward(completion: str, example: dict) -> float`): `completion` is the response
  text, `example` the data row as a dict (`example_dict`).

A function taking `**kwargs` gets verl's four by name. Any other required parameter, or
names of both forms in one function, is refused with one line naming both forms: a
function that would be called with arguments it does not expect must fail at start-up, not
on every completion (where an exception only scores 0).

Pure Python (no torch): `appo.register_reward` checks a function's form when it registers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
EXAMPLE_PARAMS = ("completion", "example")
FORMS = {"verl": VERL_PARAMS, "example": EXAMPLE_PARAMS}
FORMS_TEXT = ("(data_source, solution_str, ground_truth, extra_info) as verl's compute_score "
              "(any of them, by name), or (completion, example)")


@dataclass(frozen=True)
class RewardForm:
    """How a function is called: `form` ("verl" or "example") and the parameter names it
    gets (all of the form's, for a function with `**kwargs` or without a signature)."""

    form: str
    params: tuple[str, ...]


def reward_form(fn: Callable[..., Any], label: str) -> RewardForm:
    """The form of `fn` by its parameter names; refused (`AppoError`, one line naming
    `label`) when it fits neither."""
    from appo.errors import AppoError

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return RewardForm("verl", VERL_PARAMS)  # a builtin without a signature: all four
    named = {name: p for name, p in params.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
    forms = [form for form, names in FORMS.items() if set(named) & set(names)]
    if len(forms) > 1:
        raise AppoError(f"reward function {label}: mixes the parameters of two forms "
                        f"({', '.join(named)}); take {FORMS_TEXT}")
    form = forms[0] if forms else "verl"
    required_positional = [name for name, p in params.items()
                           if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    unknown = [name for name, p in named.items()
               if name not in FORMS[form] and p.default is p.empty]
    if required_positional or unknown:
        raise AppoError(f"reward function {label}: parameter(s) "
                        f"{', '.join(required_positional + unknown)} cannot be given; a "
                        f"reward function takes {FORMS_TEXT}")
    passed = FORMS[form] if takes_all else tuple(n for n in FORMS[form] if n in named)
    return RewardForm(form, passed)


def example_dict(data_source: str, ground_truth: Any, extra_info: dict | None,
                 ability: str | None) -> dict[str, Any]:
    """The data row a `(completion, example)` function gets: the row's own extra columns
    (and `extra_info`'s entries), then `question` and `prompt` (the user's question text),
    `answer` and `ground_truth` (the same value), `data_source` and `ability`."""
    extra = dict(extra_info or {})
    question = extra.get("question", "")
    return {**extra, "question": question, "prompt": question, "answer": ground_truth,
            "ground_truth": ground_truth, "data_source": data_source, "ability": ability}


def call_arguments(form: RewardForm, data_source: str, solution_str: str, ground_truth: Any,
                   extra_info: dict | None, ability: str | None) -> dict[str, Any]:
    """The keyword arguments for one call of a function of `form`."""
    if form.form == "example":
        values = {"completion": solution_str,
                  "example": example_dict(data_source, ground_truth, extra_info, ability)}
    else:
        values = {"data_source": data_source, "solution_str": solution_str,
                  "ground_truth": ground_truth, "extra_info": extra_info}
    return {name: values[name] for name in form.params}
