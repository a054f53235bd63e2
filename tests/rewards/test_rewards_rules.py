"""Reward rules one by one: the original's format checks, math equivalence, QA metrics,
routing, user functions, and robustness on garbage completions."""

from __future__ import annotations

import math
import random
import threading

import pytest

from appo.errors import AppoError
from appo.rewards import (
    REWARD_FNS,
    RewardOutput,
    RewardRouter,
    compute_reward,
    deep_research_reward,
    extract_final_answer,
    is_equivalent,
    last_boxed,
    math_reward,
    qa_reward,
)
from appo.rewards.deep_research import format_error

GOOD = (
    "<think>plan</think>\n<search>q</search> <result>\nr\n</result>\n"
    "<think>more</think>\n<python>print(1)</python> <result>\n1\n</result>\n"
    "<think>done</think>\n<answer>The answer is \\boxed{Paris}</answer>"
)


# --- deep_research: the original's format rules, one per case --------------------------

@pytest.mark.parametrize(
    "text, reason",
    [
        ("<answer>\\boxed{Paris}</answer>", "no <think> block"),
        ("<think>a</think><think>b<answer>\\boxed{Paris}</answer>", "counts differ"),
        ("<think>a</think>b</think><answer>\\boxed{Paris}</answer>", "counts differ"),
        ("<think>a</think><answer>\\boxed{Paris}</answer><answer>\\boxed{Rome}</answer>",
         "exactly one <answer>"),
        ("<think>a</think>no answer at all", "exactly one <answer>"),
        # result before the call: after <python> there is no <result> any more
        ("<think>a</think><result>1</result><python>1</python><answer>\\boxed{1}</answer>",
         "<python> without a complete"),
        ("<think>a</think><search>q</search><answer>\\boxed{1}</answer>",
         "<search> without a complete"),
        # the result opens before the call closes
        ("<think>a</think><search>q <result>r</search></result><answer>\\boxed{1}</answer>",
         "out of order"),
        ("<think>a</think><answer>Paris</answer>", "no \\boxed{} in <answer>"),
        ("<think>a</think></answer>\\boxed{Paris}<answer>", "</answer> before <answer>"),
    ],
)
def test_deep_research_format_failures(text, reason):
    out = deep_research_reward(text, "Paris")
    assert out.score == -1.0 and out.accuracy == 0.0 and not out.format_ok
    assert reason in out.reason
    assert reason in format_error(text)


def test_deep_research_good_format_and_bonus():
    assert format_error(GOOD) is None
    out = deep_research_reward(GOOD, "Paris")
    # F1 = 1 and both </search> and </python> present: 1 + 0.1
    assert out.score == pytest.approx(1.1) and out.accuracy == 1.0 and out.format_ok
    only_search = GOOD.replace("<python>print(1)</python> <result>\n1\n</result>\n", "")
    assert deep_research_reward(only_search, "Paris").score == pytest.approx(1.0)
    # wrong answer: F1 0, no bonus even with both tools
    assert deep_research_reward(GOOD, "Rome").score == 0.0


def test_deep_research_unextractable_box_scores_minus_one():
    # Passes the format check ("\boxed{" and a "}" are present) but the box never closes.
    text = "<think>a</think><answer>\\boxed{ {Paris }</answer>"
    assert format_error(text) is None
    out = deep_research_reward(text, "Paris")
    assert out.score == -1.0 and "cannot extract" in out.reason


def test_deep_research_token_f1_and_polar_rule():
    answer = "<think>a</think><answer>\\boxed{{{}}}</answer>"
    # pred [new, york] vs gold [new, york, city]: P=1, R=2/3, F1=2*(2/3)/(5/3)=0.8
    assert deep_research_reward(answer.format("New York"), "New York City").score == pytest.approx(0.8)
    # max over golds
    assert deep_research_reward(answer.format("NYC"), ["New York City", "NYC"]).score == 1.0
    # "no" vs "no way": a yes/no prediction scores only on identity
    assert deep_research_reward(answer.format("no"), "no way").score == 0.0
    assert deep_research_reward(answer.format("No."), "no").score == 1.0


# --- answer extraction ------------------------------------------------------------------

def test_last_boxed_matches_braces_and_forms():
    assert last_boxed("\\boxed{1} then \\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\boxed 5$") == "5"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed{unclosed") is None
    assert last_boxed("no box") is None
    assert last_boxed("\\boxedx{1}") is None  # a different command


def test_extract_final_answer_strict_and_lenient():
    assert extract_final_answer("<answer>\\boxed{3}</answer>") == ("3", "boxed in <answer>")
    assert extract_final_answer("<answer>3</answer>")[0] is None
    assert extract_final_answer("\\boxed{3}")[0] is None
    assert extract_final_answer("so \\boxed{3}.", lenient=True) == ("3", "boxed outside <answer>")
    assert extract_final_answer("<answer> 3 </answer>", lenient=True) == ("3", "bare <answer> text")
    assert extract_final_answer("it is 1,234.", lenient=True) == ("1234", "last number")
    assert extract_final_answer("nothing", lenient=True) == (None, "no answer found")


# --- math -------------------------------------------------------------------------------

@pytest.mark.parametrize("a, b", [("0.5", "\\frac{1}{2}"), ("1/2", "0.5"), ("\\frac{1}{2}", "1/2"),
                                  ("3\\sqrt{3} - 6", "3\\sqrt{3}-6"), ("1000", "1,000"),
                                  ("5", "x = 5"), ("12", "12.0"), ("\\frac12", "0.5")])
def test_math_equivalent_forms(a, b):
    assert is_equivalent(b, a)
    out = math_reward(f"<think>t</think><answer>\\boxed{{{b}}}</answer>", a)
    assert out.score == 1.0 and out.accuracy == 1.0 and out.format_ok


@pytest.mark.parametrize("a, b", [("0.5", "0.25"), ("1/2", "2"), ("3\\sqrt{3} - 6", "3\\sqrt{3}+6"),
                                  ("1000", "100")])
def test_math_different_values(a, b):
    assert not is_equivalent(b, a)
    assert math_reward(f"<answer>\\boxed{{{b}}}</answer>", a).score == 0.0


def test_math_failures_record_reason():
    assert math_reward("I think 5", "5").reason == "no <answer>...</answer> block"
    assert math_reward("<answer>5</answer>", "5").reason == "no \\boxed{} in <answer>"
    assert math_reward("<answer>\\boxed{}</answer>", "5").reason == "empty \\boxed{}"
    long = math_reward("<answer>\\boxed{" + "1" * 5000 + "}</answer>", "5")
    assert not long.format_ok and "longer than" in long.reason
    # a verifier-hostile answer is just wrong, not an exception
    assert math_reward("<answer>\\boxed{\\frac{\\frac{}{}}{)(}</answer>", "5").score == 0.0


def test_math_ignores_answers_inside_tool_results():
    text = "<think>t</think><python>x</python> <result>\n<answer>\\boxed{42}</answer>\n</result>"
    out = math_reward(text, "42")
    assert out.score == 0.0 and not out.format_ok


def test_math_lenient_for_untrained_models():
    assert math_reward("The answer is 42.", "42").score == 0.0
    assert math_reward("The answer is 42.", "42", lenient=True).score == 1.0


def test_math_reward_off_the_main_thread():
    # math-verify's signal-based timeout fails off the main thread; we must still grade.
    results = []
    t = threading.Thread(target=lambda: results.append(
        [math_reward("<answer>\\boxed{1/2}</answer>", "0.5").score,
         math_reward("<answer>\\boxed{1/3}</answer>", "0.5").score]))
    t.start()
    t.join()
    assert results == [[1.0, 0.0]]


# --- qa ---------------------------------------------------------------------------------

def test_qa_metrics_hand_computed():
    ans = "<think>t</think><answer>\\boxed{{{}}}</answer>"
    out = qa_reward(ans.format("new york"), ["New York City"])
    # EM 0; F1: P=1, R=2/3 -> 0.8; contains: "new york city" not inside "new york" -> 0
    assert out.metrics == {"em": 0.0, "f1": pytest.approx(0.8), "contains": 0.0}
    assert out.score == pytest.approx(0.8) and out.accuracy == 0.0
    out = qa_reward(ans.format("It is New York City."), ["New York City"])
    # pred tokens [it, is, new, york, city]: P=3/5, R=1 -> F1=0.75; contains 1
    assert out.metrics == {"em": 0.0, "f1": pytest.approx(0.75), "contains": 1.0}
    out = qa_reward(ans.format("The  New-York City"), ["new york city"])
    # "new-york" loses its hyphen -> "newyork": F1 over [newyork, city] vs [new, york, city]
    assert out.metrics["em"] == 0.0 and out.metrics["f1"] == pytest.approx(0.4)
    assert qa_reward(ans.format("the Beatles"), "Beatles", metric="em").score == 1.0
    assert qa_reward(ans.format("a Beatles song"), "Beatles", metric="contains").score == 1.0
    with pytest.raises(ValueError):
        qa_reward(ans.format("x"), "x", metric="bleu")


def test_qa_number_and_list_ground_truths():
    ans = "<answer>\\boxed{1987}</answer>"
    assert qa_reward(ans, 1987).accuracy == 1.0
    assert qa_reward(ans, ["1986", "1987"]).accuracy == 1.0
    assert qa_reward(ans, 1987.0).accuracy == 1.0


# --- routing and user functions ---------------------------------------------------------

def test_routing_by_data_source_then_ability():
    r = RewardRouter()
    assert r.resolve("DR_grpo_mix", "math") == "deep_research"
    assert r.resolve("gsm8k") == "math"
    assert r.resolve("hotpotqa") == "qa"
    assert r.resolve("my_set", "math") == "math"
    assert r.resolve("qa", None) == "qa"  # a reward name works as a data source
    with pytest.raises(AppoError, match="no reward function for data_source 'my_set'"):
        r.resolve("my_set", "chemistry")
    assert RewardRouter(routes={"my_set": "qa"}).resolve("my_set", "math") == "qa"
    with pytest.raises(AppoError, match="unknown reward"):
        RewardRouter(routes={"x": "bleu"})
    # same text, different graders: deep_research gives -1 for no <think>; math gives 0
    text = "<answer>\\boxed{0.5}</answer>"
    assert compute_reward("DR_grpo_mix", text, "1/2").score == -1.0
    assert compute_reward("gsm8k", text, "1/2").score == 1.0


def test_router_reward_kwargs():
    r = RewardRouter(reward_kwargs={"qa": {"metric": "em"}})
    assert r("hotpotqa", "<answer>\\boxed{new york}</answer>", "New York City").score == 0.0


def test_custom_reward_function(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': 0.5, 'acc': 1.0, 'reason': data_source, 'length': len(solution_str)}\n"
        "def original_style(solution_str, ground_truth, extra_info=None):\n"
        "    return float(ground_truth in solution_str)\n"
        "def broken(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return 1 / 0\n"
        "def bad_type(**kwargs):\n"
        "    return 'high'\n"
    )
    out = RewardRouter(f, "compute_score")("src", "abcd", "x", {})
    assert (out.score, out.accuracy, out.reason, out.metrics) == (0.5, 1.0, "src", {"acc": 1.0, "length": 4.0})
    assert RewardRouter(f, "original_style")("anything", "say yes", "yes").score == 1.0
    broken = RewardRouter(f, "broken")
    out = broken("s", "t", "g")
    assert out.score == 0.0 and "ZeroDivisionError" in out.reason and broken.errors == 1
    with pytest.raises(AppoError, match="expected a number or a dict"):
        RewardRouter(f, "bad_type")("s", "t", "g")
    with pytest.raises(AppoError, match="has no function 'nope'.*compute_score"):
        RewardRouter(f, "nope")
    with pytest.raises(AppoError, match="file not found"):
        RewardRouter(tmp_path / "missing.py")
    (tmp_path / "syntax.py").write_text("def f(:\n")
    with pytest.raises(AppoError, match="importing .* failed: SyntaxError"):
        RewardRouter(tmp_path / "syntax.py", "f")


def test_router_from_config(tmp_path):
    from appo.config import load_config
    from appo.rewards import router_from_config

    f = tmp_path / "r.py"
    f.write_text("def score_it(data_source, solution_str, ground_truth, extra_info):\n    return 0.25\n")
    cfg = load_config(overrides=[f"custom_reward_function.path={f}",
                                 "custom_reward_function.name=score_it"])
    assert router_from_config(cfg)("x", "y", "z").score == 0.25
    assert router_from_config(load_config()).resolve("synth_arith") == "math"


# --- robustness: no completion crashes a reward -----------------------------------------

def test_no_completion_crashes_any_reward():
    rng = random.Random(0)
    atoms = ["<think>", "</think>", "<answer>", "</answer>", "<python>", "</python>", "<search>",
             "</search>", "<result>", "</result>", "\\boxed{", "\\boxed ", "{", "}", "$", "\\frac",
             "1/2", "0.5", "x", " ", "\n", "Paris", "\\", "^", "(", ")", "\x00", "é", "9" * 40]
    for _ in range(400):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 40)))
        for name, fn in REWARD_FNS.items():
            out = fn(text, rng.choice(["0.5", "Paris", ["Paris", "Rome"], "x"]), None)
            assert isinstance(out, RewardOutput) and math.isfinite(out.score), (name, text)
            assert out.format_ok or out.reason, (name, text)


# --- native calls (tools.format=hermes): deep_research's format rule counterpart --------

def _native(name: str, arg: str, result: str) -> str:
    # A hermes trajectory decoded with skip_special_tokens: the call turn, then the tool turn.
    return (f'<tool_call>\n{{"name": "{name}", "arguments": {{"{arg}": "x"}}}}\n</tool_call>\n'
            f"user\n<tool_response>\n{result}\n</tool_response>\nassistant\n")


NATIVE_GOOD = ("<think>plan</think>\n" + _native("search", "query", "r") + "<think>more</think>\n"
               + _native("python", "code", "1") + "<think>done</think>\n"
               "<answer>The answer is \\boxed{Paris}</answer>")


def test_deep_research_native_format_and_bonus():
    assert format_error(NATIVE_GOOD, "hermes") is None
    # The tag rule does not apply: no <search>/<python> tags, so the tags check passes too,
    # but only the native rule sees the calls (no tag bonus without </search>, </python>).
    assert deep_research_reward(NATIVE_GOOD, "Paris").score == pytest.approx(1.0)
    out = deep_research_reward(NATIVE_GOOD, "Paris", call_format="hermes")
    assert out.score == pytest.approx(1.1) and out.format_ok  # F1 1 + both-tools bonus
    only_python = NATIVE_GOOD.replace(_native("search", "query", "r"), "")
    assert deep_research_reward(only_python, "Paris", call_format="hermes").score == 1.0


@pytest.mark.parametrize("text, reason", [
    ("<think>a</think><tool_call>{}<answer>\\boxed{1}</answer>", "without </tool_call>"),
    ("<think>a</think><tool_call>{}</tool_call><answer>\\boxed{1}</answer>",
     "without a complete <tool_response>"),
    ("<think>a</think><tool_call>{}</tool_call><tool_call>{}</tool_call>"
     "<tool_response>1</tool_response><answer>\\boxed{1}</answer>", "fewer <tool_response>"),
])
def test_deep_research_native_format_failures(text, reason):
    out = deep_research_reward(text, "1", call_format="hermes")
    assert out.score == -1.0 and reason in out.reason


def test_router_passes_the_call_format_and_math_ignores_tool_responses():
    from appo.config import load_config
    from appo.rewards.router import router_from_config

    router = router_from_config(load_config(overrides=["tools.format=hermes"]))
    assert router.reward_kwargs == {"deep_research": {"call_format": "hermes"}}
    assert router_from_config(load_config()).reward_kwargs == {}
    text = "<think>t</think><tool_response>\n<answer>\\boxed{42}</answer>\n</tool_response>"
    assert math_reward(text, "42").score == 0.0
