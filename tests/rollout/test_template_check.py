"""The template check (`appo.rollout.template_check`, `appo data check-template`): passes on
the tiny model's Qwen-style template in both formats, and names the problem of templates that
drop the end-of-turn token, rewrite earlier turns, or drop tool calls (SmolLM2's)."""

from __future__ import annotations

import pytest
from rollout_fakes import tiny_tokenizer

from appo.errors import AppoError
from appo.models.tiny import CHATML_TOOLS_TEMPLATE
from appo.rollout.template_check import _compare, check_template
from appo.tools.formats import function_schema
from appo.tools.python_tool import PythonTool
from cli_runner import run_cli

SCHEMAS = [function_schema("python", PythonTool)]

# SmolLM2-135M-Instruct's chat template, as its tokenizer ships it: ChatML with a default
# system prompt; it ignores tools=, drops an assistant message's tool_calls and renders a
# tool message as an `<|im_start|>tool` turn.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tokenizer_with(template: str):
    tok = tiny_tokenizer()
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("fmt", ["hermes", "tags"])
def test_tiny_template_passes_in_both_formats(fmt):
    tok = tiny_tokenizer()
    report = check_template(tok, fmt, SCHEMAS, ["python"])
    # hermes: three assistant turns (one call, two parallel calls, the answer); tags: one
    # assistant turn holding both calls and results.
    assert report.turns == (3 if fmt == "hermes" else 1)
    assert report.sampled > 0 and report.forced > 0
    assert "ok" in report.line()


def test_a_template_that_drops_the_end_of_turn_token_of_call_turns_fails():
    end_of_call_turn = "{%- endfor %}{{- '<|im_end|>\n' }}"
    assert CHATML_TOOLS_TEMPLATE.count(end_of_call_turn) == 1
    broken = CHATML_TOOLS_TEMPLATE.replace(end_of_call_turn, "{%- endfor %}{{- '\n' }}")
    with pytest.raises(AppoError, match="without the end-of-turn token '<\\|im_end\\|>'"):
        check_template(tokenizer_with(broken), "hermes", SCHEMAS, ["python"])
    # The tag format never renders a call turn: the same template passes there.
    check_template(tokenizer_with(broken), "tags", SCHEMAS, ["python"])


def test_a_template_that_rewrites_earlier_turns_fails():
    # The system turn states how many messages follow: every new turn rewrites the first.
    broken = CHATML_TOOLS_TEMPLATE.replace(
        "{{- '<|im_start|>' + message['role'] + '\n' + message['content']",
        "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "(' (' + (messages | length | string) + ')' if message['role'] == 'system' else '')")
    assert broken != CHATML_TOOLS_TEMPLATE
    with pytest.raises(AppoError, match="not prefix-preserving"):
        check_template(tokenizer_with(broken), "tags", SCHEMAS, ["python"])


def test_smollm2s_own_template_drops_the_calls():
    tok = tokenizer_with(SMOLLM2_TEMPLATE)
    with pytest.raises(AppoError, match="drops or rewrites the calls"):
        check_template(tok, "hermes", SCHEMAS, ["python"])
    check_template(tok, "tags", SCHEMAS, ["python"])  # the tag format needs no tool support


def test_first_difference_is_named_with_both_tokens():
    tok = tiny_tokenizer()
    a = tok.encode("abcd")
    b = tok.encode("abXd")
    with pytest.raises(AppoError, match=r"token 2 differs: the rollout has \d+ 'c', the chat "
                                        r"template has \d+ 'X'"):
        _compare(tok, a, b, "hermes")
    with pytest.raises(AppoError, match="token 3 differs: the rollout ends"):
        _compare(tok, a[:3], a, "hermes")
    _compare(tok, a, a + tok.encode("\n"), "hermes")  # a final newline after the end: fine


def test_cli_check_template():
    ok = run_cli("data", "check-template", "--model", "tiny-test", "--format", "hermes")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("template check (hermes): ok:")
    tags = run_cli("data", "check-template", "--format", "tags", "--tools", "python,search")
    assert tags.returncode == 0, tags.stderr
    # A tool that does not exist is refused, not checked against a made-up schema ("ok").
    bogus = run_cli("data", "check-template", "--tools", "python,bogus")
    assert bogus.returncode == 2 and bogus.stdout == ""
    assert bogus.stderr.strip() == "error: --tools: unknown tool 'bogus' (known: python, search)"


@pytest.mark.slow
def test_smollm2_real_tokenizer_tags_pass_hermes_fails():
    from appo.models import load_model

    tok = load_model("smollm2-135m").tokenizer
    assert check_template(tok, "tags", SCHEMAS, ["python"]).turns == 1
    with pytest.raises(AppoError, match="drops or rewrites the calls"):
        check_template(tok, "hermes", SCHEMAS, ["python"])
