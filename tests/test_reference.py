"""The generated references (docs/reference/config.md, cli.md) match the code, the config
reference covers every key `appo config show` prints, and `appo config explain` prints the
same entry as the page."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from appo.cli import build_parser, main
from appo.config_ranges import RANGES
from appo.config_schema import CHOICES, LIST_CHOICES
from appo.reference import cli_doc, config_doc

REPO = Path(__file__).resolve().parents[1]
REGENERATE = "PYTHONPATH=src python -m appo.cli reference --out docs/reference"


@pytest.mark.parametrize("name", ["config.md", "cli.md"])
def test_reference_page_is_up_to_date(name):
    from appo.reference.commands import render

    page = REPO / "docs" / "reference" / name
    assert page.is_file(), f"docs/reference/{name} is missing; write it with: {REGENERATE}"
    assert page.read_text(encoding="utf-8") == render(name), (
        f"docs/reference/{name} differs from the code; regenerate it with: {REGENERATE}")


def _leaves(node, prefix=""):
    if isinstance(node, dict) and node:
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix.rstrip(".")


def _documented(key: str, keys: dict) -> bool:
    """`key` itself, its `<name>` pattern, or an entry of a documented mapping key."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head in keys and (i == len(parts) or keys[head].type.startswith("dict")):
            return True
    pattern = ".".join(config_doc.ANY_NAME if i == 2 else p for i, p in enumerate(parts))
    return pattern in keys


def test_config_reference_covers_every_key_config_show_prints(capsys):
    assert main(["config", "show"]) == 0
    shown = list(_leaves(yaml.safe_load(capsys.readouterr().out)))
    keys = config_doc.all_keys()
    assert len(shown) > 100
    assert [k for k in shown if not _documented(k, keys)] == []


def test_coverage_check_finds_an_undocumented_key():
    keys = config_doc.all_keys()
    assert _documented("tools.tool_instances.search.class_path", keys)
    assert _documented("eval.tool_call_limits.python", keys)
    assert not _documented("actor.no_such_key", keys)
    assert not _documented("actor.optim.lr.extra", keys)


def test_every_key_has_a_meaning_type_and_default():
    keys = config_doc.all_keys()
    assert [k for k, d in keys.items() if not (d.meaning and d.type and d.default)] == []


def test_choices_and_ranges_are_shown():
    keys = config_doc.all_keys()
    for key, choices in {**CHOICES, **LIST_CHOICES}.items():
        assert all(c in keys[key].allowed for c in choices), key
    for key, rng in RANGES.items():
        if "*" not in key:
            assert keys[key].allowed.startswith(rng.describe()), key
    assert keys["actor.optim.betas"].allowed == "each entry " + RANGES["actor.optim.betas.*"].describe()


def test_verl_names():
    assert config_doc.verl_name("actor.ppo_max_token_len_per_device") == \
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    assert config_doc.verl_name("critic.ppo_max_token_len_per_device") == \
        "critic.ppo_max_token_len_per_gpu"
    assert config_doc.verl_name("rollout.n") == "actor_rollout_ref.rollout.n"
    assert config_doc.verl_name("tools.call_limit") == "actor_rollout_ref.rollout.tools.call_limit"
    assert config_doc.verl_name("data.train_batch_size") == "data.train_batch_size"
    assert config_doc.verl_name("sft.lr") == ""


SOURCE = '''
@dataclass
class Thing:
    """A section.

    Two lines."""

    # about a
    # continued
    a: int = 1
    b: str = "x"  # about b

    c: bool = False
    # about d
    d: float = 0.5  # and more
'''


def test_comments_are_read_from_the_source():
    comments, docs = config_doc._module_comments(SOURCE)
    assert docs == {"Thing": "A section. Two lines."}
    assert comments == {("Thing", "a"): "about a continued", ("Thing", "b"): "about b",
                        ("Thing", "c"): "", ("Thing", "d"): "about d and more"}


def test_config_explain_prints_the_entry(capsys):
    assert main(["config", "explain", "actor.clip_ratio_high"]) == 0
    out = capsys.readouterr().out
    assert out == config_doc.entry_text(config_doc.all_keys()["actor.clip_ratio_high"])
    assert out.startswith("actor.clip_ratio_high: float = 0.2\n")
    assert "actor_rollout_ref.actor.clip_ratio_high" in out


def test_config_explain_a_group_and_a_tool_entry(capsys):
    assert main(["config", "explain", "actor.optim", "tools.tool_instances.search.params"]) == 0
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ") and line] \
        == ["actor.optim.lr", "actor.optim.weight_decay", "actor.optim.betas",
            "actor.optim.lr_warmup_steps_ratio", "actor.optim.lr_scheduler",
            "tools.tool_instances.<name>.params"]


def test_config_explain_near_miss_is_one_line(capsys):
    assert main(["config", "explain", "actor.clip_ratio_hig"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert "\n" not in err
    assert err.startswith("error: no config key 'actor.clip_ratio_hig'; nearest: ")
    assert "actor.clip_ratio_high" in err


def test_config_show_still_works(capsys):
    assert main(["config", "show", "rollout.n"]) == 0
    assert capsys.readouterr().out == "rollout.n: 16\n"


def test_cli_help_is_rendered_at_a_fixed_width(monkeypatch):
    parser = build_parser()
    monkeypatch.setenv("COLUMNS", "40")
    narrow = cli_doc.render_markdown(parser)
    monkeypatch.setenv("COLUMNS", "300")
    assert cli_doc.render_markdown(build_parser()) == narrow
    assert "## `appo train`" in narrow and "## `appo search cache stats`" in narrow
