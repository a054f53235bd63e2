"""`data.appo_stage_prompt`: APPO's reasoning-stage paragraph appended to the system prompt."""

from __future__ import annotations

import json

import pytest

from appo.config import load_config
from appo.data import load_conversations, load_rl_data, rl_data_from_config
from appo.data.rl import render_prompt_ids
from appo.data.templates import (
    APPO_STAGE_PROMPT,
    ORIGINAL_CODE_SEARCH_PROMPT,
    add_stage_prompt,
    apply_stage_prompt,
)

# Copied by hand from AMAP-ML/APPO cognitive_pipeline/config.py (COGNITIVE_SYSTEM_PROMPT_ADDON),
# not from appo: the test pins appo's constant to the original's text.
ORIGINAL_ADDON = (
    "\n\nWhen you feel that a paragraph of your reasoning forms a self-contained stage "
    "(for example: a quick judgment, a planning step, a deduction, an induction, "
    "a hypothesis, integrating tool feedback, or a metacognitive correction), "
    "wrap that paragraph with <|extra_0|>...<|extra_1|>. "
    "Do not annotate tool calls or their results — only wrap pure reasoning paragraphs. "
    "Not every paragraph needs a tag; only use <|extra_0|> when a stage boundary is clear.\n"
)


def _questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "Who wrote Hamlet?", "answer": "Shakespeare"}) + "\n")
    return str(path)


def test_the_paragraph_is_the_originals():
    assert APPO_STAGE_PROMPT == ORIGINAL_ADDON


def test_appended_to_the_code_search_system_prompt(tmp_path):
    ex = load_rl_data(_questions(tmp_path), template="code_search", tools=["search", "python"],
                      stage_prompt=True).examples[0]
    # the original's token insertion before the system turn's <|im_end|> = text appended to
    # the end of the system content: blank line before, newline after, nothing stripped
    assert ex.prompt[0] == {"role": "system", "content": ORIGINAL_CODE_SEARCH_PROMPT + ORIGINAL_ADDON}
    assert ex.prompt[1] == {"role": "user", "content": "Who wrote Hamlet?"}


def test_off_by_default_changes_nothing(tmp_path):
    cfg = load_config()
    assert cfg.data.appo_stage_prompt is False
    ex = load_rl_data(_questions(tmp_path), template="code_search").examples[0]
    assert ex.prompt[0]["content"] == ORIGINAL_CODE_SEARCH_PROMPT
    default = rl_data_from_config(cfg, "val").examples[0]
    assert "<|extra_0|>" not in default.prompt[0]["content"]


def test_config_key_reaches_rl_prompts():
    cfg = load_config(overrides=["data.appo_stage_prompt=true"])
    for split in ("train", "val"):
        ex = rl_data_from_config(cfg, split).examples[0]
        assert ex.prompt[0]["content"].endswith(ORIGINAL_ADDON)
        assert ex.prompt[0]["content"].count("<|extra_1|>") == 1


def test_kept_system_message_of_the_original_parquet_gets_it(shared_data):
    # the original APPO appended it to whatever system turn the prompt carried
    ex = load_rl_data(str(shared_data / "arpo/rl/valid.parquet"), stage_prompt=True).examples[0]
    assert ex.prompt[0]["content"] == ORIGINAL_CODE_SEARCH_PROMPT + ORIGINAL_ADDON


def test_never_appended_twice():
    once = add_stage_prompt("sys")
    assert once == "sys" + ORIGINAL_ADDON and add_stage_prompt(once) == once
    # APPO's SFT builder wrote `system.rstrip() + "\n" + addon`: already there, left alone
    built = "sys\n" + ORIGINAL_ADDON
    assert add_stage_prompt(built) == built
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    out = apply_stage_prompt(msgs)
    assert msgs[0]["content"] == "s" and out[0]["content"] == "s" + ORIGINAL_ADDON
    assert out[1] == msgs[1]


def test_sft_conversations(tmp_path):
    path = tmp_path / "sft.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "system", "content": "own" + ORIGINAL_ADDON},
                      {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plain = load_conversations(str(path), template="code_search")
    marked = load_conversations(str(path), template="code_search", stage_prompt=True)
    assert plain[0].messages[0]["content"] == ORIGINAL_CODE_SEARCH_PROMPT
    assert marked[0].messages[0]["content"] == ORIGINAL_CODE_SEARCH_PROMPT + ORIGINAL_ADDON
    assert marked[1].messages[0]["content"] == "own" + ORIGINAL_ADDON


@pytest.mark.slow
def test_token_ids_equal_the_originals_insertion_before_im_end():
    """The original encodes the paragraph on its own and splices the ids in before the first
    <|im_end|>; appo renders the longer system text. Same ids on a ChatML tokenizer."""
    from appo.models import load_model

    tok = load_model("smollm2-135m").tokenizer
    messages = [{"role": "system", "content": ORIGINAL_CODE_SEARCH_PROMPT},
                {"role": "user", "content": "Who wrote Hamlet?"}]
    raw = render_prompt_ids(messages, tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    at = raw.index(im_end)
    original = raw[:at] + tok.encode(ORIGINAL_ADDON, add_special_tokens=False) + raw[at:]
    assert render_prompt_ids(apply_stage_prompt(messages), tok) == original
