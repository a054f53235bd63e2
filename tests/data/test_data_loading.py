"""RL / eval data loading: the original parquet, eval JSONL, HF dataset dirs, specs, errors."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from appo.config import CHOICES, load_config
from appo.data import (
    TEMPLATES,
    load_rl_data,
    load_sft_data,
    parse_spec,
    read_rows,
    render_system_prompt,
    repair_latex_escapes,
    rl_data_from_config,
)
from appo.data.templates import ORIGINAL_CODE_SEARCH_PROMPT
from appo.errors import AppoError


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- the original RL parquet ------------------------------------------------------------

def test_train_10k_loads_fast_with_5000_math_and_5000_qa(shared_data):
    path = shared_data / "arpo/rl/train_10k.parquet"
    start = time.perf_counter()
    data = load_rl_data(str(path), template="code_search")
    seconds = time.perf_counter() - start
    assert seconds < 5.0, f"loading took {seconds:.2f} s"
    assert len(data.examples) == data.stats.rows == 10000
    assert data.stats.per_ability == {"math": 5000, "qa": 5000}
    assert data.stats.per_source == {"DR_grpo_mix": 10000}
    ex = data.examples[0]
    assert [m["role"] for m in ex.prompt] == ["system", "user"]
    assert isinstance(ex.ground_truth, str) and ex.extra_info["split"] == "train"


def test_parquet_system_prompt_repaired(shared_data):
    raw = pq.read_table(shared_data / "arpo/rl/valid.parquet").to_pylist()
    assert "\x08oxed" in raw[0]["prompt"][0]["content"]  # the known defect is there
    data = load_rl_data(str(shared_data / "arpo/rl/valid.parquet"))
    assert data.stats.per_ability == {"math": 100, "qa": 80}
    for ex in data.examples:
        assert "\x08" not in ex.prompt[0]["content"]
        assert ex.prompt[0]["content"] == ORIGINAL_CODE_SEARCH_PROMPT
    # the template renders the same text for code_search with both tools
    assert render_system_prompt("code_search", ["python", "search"]) == ORIGINAL_CODE_SEARCH_PROMPT


def test_repair_only_broken_latex_commands():
    assert repair_latex_escapes("form \x0crac{m}{n} and \x08oxed{1}") == "form \\frac{m}{n} and \\boxed{1}"
    # "\x0c" standing for a PDF "fi" ligature is genuine data: left alone
    assert repair_latex_escapes("the \x0crst \x0cnd") == "the \x0crst \x0cnd"


def test_system_prompt_replaced_on_request(shared_data):
    path = str(shared_data / "arpo/rl/valid.parquet")
    data = load_rl_data(path, template="math", tools=["python"], system_prompt="template")
    assert data.examples[0].prompt[0]["content"] == render_system_prompt("math", ["python"])


# --- eval JSONL -------------------------------------------------------------------------

def test_eval_jsonl_sets(shared_data):
    expected = {"gsm8k": (1319, "math", "18"), "math500": (500, "math", None),
                "aime24": (30, "math", None), "hotpotqa": (200, "qa", ["Frank Lowy"]),
                "2wiki": (200, "qa", None)}
    for name, (rows, ability, first_gold) in expected.items():
        data = load_rl_data(str(shared_data / f"arpo/eval/{name}/test.jsonl"), template="math")
        assert data.stats.rows == rows and data.stats.per_source == {name: rows}
        assert data.stats.per_ability == {ability: rows}
        ex = data.examples[0]
        assert ex.prompt[0]["content"] == render_system_prompt("math")
        if first_gold is not None:
            assert ex.ground_truth == first_gold  # gsm8k: the number after '####'
    aime = load_rl_data(str(shared_data / "arpo/eval/aime24/test.jsonl")).examples[0]
    assert "problem" in aime.extra_info and "solution" in aime.extra_info  # nothing dropped


def test_question_rows_answers_and_options(tmp_path):
    path = _jsonl(tmp_path / "mine.jsonl", [
        {"problem": "1+1?", "answer": 2},
        {"question": "Capital of France?", "answer": ["Paris", "paris"], "id": 7},
        {"question": "Half?", "answer": 0.5},
    ])
    data = load_rl_data(str(path), template="search", tools=["search"])
    a, b, c = data.examples
    assert (a.ground_truth, a.ability, a.data_source) == ("2", "math", "mine")
    assert (b.ground_truth, b.ability, b.extra_info["id"]) == (["Paris", "paris"], "qa", 7)
    assert c.ground_truth == "0.5"
    assert "<search>" in a.prompt[0]["content"] and "<python>" not in a.prompt[0]["content"]
    opts = load_rl_data(f"{path}?n=2&data_source=bench&ability=qa")
    assert len(opts.examples) == 2 and opts.stats.per_source == {"bench": 2}
    assert opts.stats.per_ability == {"qa": 2}


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"question": "q"}], "no answer column"),
        ([{"answer": "a", "text": "q"}], "no prompt column"),
        ([{"question": 5, "answer": "a"}], "column 'question' must be a string"),
        ([{"question": "q", "answer": {"x": 1}}], "column 'answer' must be a string, number or"),
        ([{"question": "q", "answer": []}], "column 'answer' must be a string, number or"),
        ([{"prompt": [{"role": "robot", "content": "x"}], "answer": "a"}], "prompt[0] must be"),
        ([{"prompt": [], "answer": "a"}], "must be a non-empty list"),
        ([{"question": "q", "answer": "a", "extra_info": [1]}], "'extra_info' must be a mapping"),
    ],
)
def test_bad_rows_name_the_problem(tmp_path, rows, message):
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(AppoError, match="bad.jsonl row 0") as err:
        load_rl_data(str(path))
    assert message in str(err.value)


def test_bad_files_name_the_problem(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(AppoError, match="no rows"):
        load_rl_data(str(tmp_path / "empty.jsonl"))
    (tmp_path / "broken.jsonl").write_text('{"question": "q", "answer": "a"}\n{"question": \n')
    with pytest.raises(AppoError, match="broken.jsonl:2: not valid JSON"):
        load_rl_data(str(tmp_path / "broken.jsonl"))
    with pytest.raises(AppoError, match="data file not found"):
        load_rl_data(str(tmp_path / "missing.parquet"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(AppoError, match="unsupported data file type"):
        load_rl_data(str(tmp_path / "x.csv"))
    pq.write_table(pa.table({"data_source": ["s"], "prompt": [[{"role": "user", "content": "q"}]]}),
                   tmp_path / "noanswer.parquet")
    with pytest.raises(AppoError, match="noanswer.parquet row 0: no answer column"):
        load_rl_data(str(tmp_path / "noanswer.parquet"))
    pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}).slice(0, 0), tmp_path / "e.parquet")
    with pytest.raises(AppoError, match="no rows"):
        load_rl_data(str(tmp_path / "e.parquet"))


def test_overlong_prompts_skip_or_fail(tmp_path):
    from appo.models import load_model

    tok = load_model("tiny-test").tokenizer
    path = _jsonl(tmp_path / "len.jsonl", [{"question": "x" * n, "answer": "1"} for n in (5, 400)])
    text = tok.apply_chat_template(
        [{"role": "system", "content": render_system_prompt("math")},
         {"role": "user", "content": "x" * 5}], tokenize=False, add_generation_prompt=True)
    base = len(tok(text, add_special_tokens=False)["input_ids"])
    limit = base + 10  # the 5-char question fits, the 400-char one (byte tokens) does not
    data = load_rl_data(str(path), tokenizer=tok, max_prompt_length=limit)
    assert len(data.examples) == 1 and data.stats.skipped_overlong == 1
    assert data.stats.longest == base + 395
    with pytest.raises(AppoError, match=r"row 1 has \d+ tokens, more than data.max_prompt_length"):
        load_rl_data(str(path), tokenizer=tok, max_prompt_length=limit, overlong="fail")


# --- Hugging Face dataset directories ---------------------------------------------------

def _save_like_datasets(directory, rows):
    """What `datasets.Dataset.save_to_disk` writes: an Arrow stream + state.json."""
    directory.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(directory / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    (directory / "state.json").write_text(json.dumps(
        {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": None}))
    (directory / "dataset_info.json").write_text("{}")


def test_hf_dataset_dirs(tmp_path):
    _save_like_datasets(tmp_path / "ds", [{"question": "q1", "answer": "1"},
                                          {"question": "q2", "answer": "2"}])
    assert len(load_rl_data(str(tmp_path / "ds")).examples) == 2
    root = tmp_path / "dd"
    _save_like_datasets(root / "train", [{"question": "t", "answer": "1"}])
    _save_like_datasets(root / "test", [{"question": "u", "answer": "2"}, {"question": "v", "answer": "3"}])
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    assert [e.question for e in load_rl_data(str(root)).examples] == ["t"]
    assert len(load_rl_data(f"{root}?split=test").examples) == 2
    with pytest.raises(AppoError, match="splits train, test"):
        load_rl_data(f"{root}?split=dev")
    snap = tmp_path / "snap" / "data"
    snap.mkdir(parents=True)
    _jsonl(snap / "train-00000.jsonl", [{"question": "a", "answer": "1"}])
    _jsonl(snap / "test-00000.jsonl", [{"question": "b", "answer": "1"}])
    assert [e.question for e in load_rl_data(str(tmp_path / "snap")).examples] == ["a"]
    assert [e.question for e in load_rl_data(f"{tmp_path / 'snap'}?split=test").examples] == ["b"]


FIXTURES = Path(__file__).parent / "fixtures"


def test_directories_written_by_the_datasets_package():
    # Written by `datasets` 5.2 `save_to_disk` (a DatasetDict and a Dataset), see README there.
    root = FIXTURES / "hf_dataset_dict"
    train = load_rl_data(str(root)).examples
    assert [(e.question, e.ground_truth, e.data_source) for e in train] == [
        ("What is 12 * 12?", "144", "hf_demo"), ("What is 7 + 8?", "15", "hf_demo")]
    assert [e.ground_truth for e in load_rl_data(f"{root}?split=test").examples] == ["Paris"]
    from appo.models import load_model

    sft = load_sft_data(str(FIXTURES / "hf_sft_dataset"), load_model("tiny-test").tokenizer)
    assert len(sft.examples) == 1 and sum(sft.examples[0].loss_mask) > 0


# --- specs, templates, config -----------------------------------------------------------

def test_spec_grammar(tmp_path):
    s = parse_spec("synth:arith?split=eval&levels=2,3&n=200&seed=1")
    assert (s.kind, s.target, s.options) == ("synth", "arith", {"split": "eval", "levels": "2,3",
                                                                 "n": "200", "seed": "1"})
    assert parse_spec("synth:lookup").options == {}
    f = parse_spec("data/x.jsonl?n=5&ability=qa")
    assert (f.kind, f.target, f.options) == ("file", "data/x.jsonl", {"n": "5", "ability": "qa"})
    weird = tmp_path / "a?b.jsonl"  # an existing path is never split at '?'
    _jsonl(weird, [{"question": "q", "answer": "1"}])
    assert parse_spec(str(weird)).target == str(weird)
    with pytest.raises(AppoError, match="unknown option"):
        parse_spec("x.jsonl?limit=3")
    with pytest.raises(AppoError, match="bad option"):
        parse_spec("synth:arith?levels")
    with pytest.raises(AppoError, match="not an integer"):
        load_rl_data("synth:arith?n=lots")
    with pytest.raises(AppoError, match="unknown synthetic task 'algebra'"):
        load_rl_data("synth:algebra")
    with pytest.raises(AppoError, match=r"unknown option\(s\) hops"):
        load_rl_data("synth:arith?hops=2")
    assert read_rows(_jsonl(tmp_path / "r.jsonl", [{"a": 1}])) == [{"a": 1}]


def test_template_registry_matches_config_choices():
    assert tuple(TEMPLATES) == CHOICES["data.template"]


@pytest.mark.parametrize(
    "template, tools, present, absent",
    [
        ("math", None, ["<python>"], ["<search>"]),
        ("math", ["python"], ["<python>"], ["<search>"]),
        ("math", [], ["<think>", "<answer>", "\\boxed{"], ["<python>", "<search>", "<result>"]),
        ("search", None, ["<search>"], ["<python>"]),
        ("code_search", ["python"], ["<python>"], ["<search>", "wikipedia"]),
        ("code_search", None, ["<python>", "<search>", "wikipedia"], []),
        ("math", ["python", "calculator"], ["<python>", "<calculator>"], ["<search>"]),
    ],
)
def test_tool_tags_follow_configured_tools(template, tools, present, absent):
    text = render_system_prompt(template, tools)
    assert "\x08" not in text
    for tag in present:
        assert tag in text
    for tag in absent:
        assert tag not in text


def test_unknown_template():
    with pytest.raises(AppoError, match="unknown prompt template 'chat'"):
        render_system_prompt("chat")


def test_rl_data_from_default_config():
    cfg = load_config()
    train = rl_data_from_config(cfg, "train")
    val = rl_data_from_config(cfg, "val")
    assert len(train.examples) == 1000 and len(val.examples) == 200
    assert train.stats.per_source == {"synth_arith": 1000}
    ex = train.examples[0]
    assert ex.ability == "math" and ex.prompt[0]["content"] == render_system_prompt("math", ["python"])
    assert not {e.question for e in train.examples} & {e.question for e in val.examples}


def test_native_call_prompts_declare_the_tools_to_the_template():
    # tools.format=hermes: the system prompt names the tools without teaching tags, and the
    # prompt ids carry the tool schemas the chat template lists (tiny-test's Qwen-style one).
    from appo.data.rl import rl_data_from_config
    from appo.models.tiny import build_tiny_tokenizer
    from appo.tools.formats import CALL_FORMATS

    assert tuple(CALL_FORMATS) == CHOICES["tools.format"]
    tok = build_tiny_tokenizer()
    cfg = load_config(overrides=["tools.format=hermes", "data.train_files=[synth:arith?n=2]",
                                 "data.max_prompt_length=4096"])
    [ex, _] = rl_data_from_config(cfg, "train", tok).examples
    system = ex.prompt[0]["content"]
    assert "provided tools (python)" in system and "<python>" not in system
    assert "<answer>" in system and "\\boxed{" in system
    text = tok.decode(ex.prompt_ids)
    assert '"name": "python"' in text and '"required": ["code"]' in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = load_config(overrides=["data.train_files=[synth:arith?n=2]",
                                   "data.max_prompt_length=4096"])
    tags = rl_data_from_config(plain, "train", tok).examples[0]
    assert "<python>" in tags.prompt[0]["content"] and "<tools>" not in tok.decode(tags.prompt_ids)
