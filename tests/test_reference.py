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
            "actor.optim.fused", "actor.optim.lr_warmup_steps_ratio", "actor.optim.lr_scheduler",
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


# --- metrics: every key a training writes is listed in docs/metrics.md ---------------------

METRICS_PAGE = REPO / "docs" / "metrics.md"


def undocumented_metrics(keys, page_text: str) -> list[str]:
    """The keys that the page does not list; a `<phase>`-style placeholder in a listed key
    matches one path segment's worth of name (`memory/<phase>_peak_gb`)."""
    import re

    listed = set(re.findall(r"`([a-z_]+/[^`\s]+|step)`", page_text))
    patterns = [re.compile("^" + re.sub(r"<[a-z_]+>", "[A-Za-z0-9_.@-]+",
                                        re.escape(k).replace(r"\<", "<").replace(r"\>", ">"))
                           + "$") for k in listed if "<" in k]
    return sorted(k for k in set(keys) if k not in listed and not any(p.match(k) for p in patterns))


def test_undocumented_metric_check_matches_placeholders():
    page = "| `memory/<phase>_peak_gb` | x |\n| `reward/mean` | y |\n"
    assert undocumented_metrics(["step", "reward/mean", "memory/update_peak_gb"], page) == ["step"]
    assert undocumented_metrics(["memory/update_peak", "reward/std"], page) == [
        "memory/update_peak", "reward/std"]


def test_metrics_page_lists_the_keys_only_cuda_writes():
    # time/<phase> and memory/<phase>_peak_gb come from the step timer (trainer/loop.py);
    # memory/ appears on CUDA only, so the CPU run below cannot check it.
    text = METRICS_PAGE.read_text(encoding="utf-8")
    assert undocumented_metrics(["memory/rollout_peak_gb", "memory/update_peak_gb"], text) == []


REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    text = solution_str or ""
    return sum(c.islower() and c.isascii() for c in text) / max(len(text), 1)
'''


def test_metrics_page_covers_a_one_step_training(tmp_path):
    """One tiny-test step with the conditional metrics switched on (appo strategy and
    estimator, future_kl loss, KL and entropy terms, AEPO's advantage, validation)."""
    import json

    from appo.config import load_config
    from appo.trainer.loop import RLTrainer

    data = tmp_path / "toy.jsonl"
    data.write_text("".join(json.dumps({
        "prompt": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": f"q{i}?"}], "answer": "7",
        "data_source": "toy"}) + "\n" for i in range(4)))
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    run = tmp_path / "run"
    cfg = load_config(overrides=[
        "model.path=tiny-test", f"data.train_files=[{data}]", f"data.val_files=[{data}]",
        "data.train_batch_size=2", "data.max_response_length=16", "eval.max_response_length=16",
        f"custom_reward_function.path={reward}", "rollout.n=4", "rollout.initial_rollouts=2",
        "rollout.strategy=appo", "algorithm.adv_estimator=appo", "actor.policy_loss=future_kl",
        "actor.use_kl_loss=true", "actor.kl_loss_coef=0.01", "actor.entropy_coeff=0.01",
        "actor.entropy_balanced_advantage=true", "actor.ppo_mini_batch_size=2",
        "trainer.total_steps=1", "trainer.val_before_train=true", "trainer.test_freq=1",
        f"trainer.default_local_dir={run}", "trainer.logger=[jsonl]"])
    RLTrainer(cfg, progress=False).fit()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1]
    keys = {k for row in rows for k in row}
    for expected in ("val/pass@1", "actor/kl", "actor/future_kl", "adv/branch_frac",
                     "actor/entropy_adv_factor_mean"):  # the switches above took effect
        assert expected in keys
    assert undocumented_metrics(keys, METRICS_PAGE.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("asked, first, appo_key", [
    ("actor_rollout_ref.actor.clip_ratio_high", "is appo's actor.clip_ratio_high",
     "actor.clip_ratio_high"),
    ("actor.ppo_max_token_len_per_gpu", "is appo's actor.ppo_max_token_len_per_device",
     "actor.ppo_max_token_len_per_device"),
    ("actor_rollout_ref.rollout.tools.call_limit", "is appo's tools.call_limit",
     "tools.call_limit"),
    ("actor.use_dynamic_bsz", "is accepted and has no effect", None),
    ("actor.ppo_micro_batch_size_per_gpu", "is verl's, not appo's", None),
])
def test_config_explain_reads_verl_names(capsys, asked, first, appo_key):
    assert main(["config", "explain", asked]) == 0
    out = capsys.readouterr().out
    head, _, rest = out.partition("\n")
    assert head.startswith(asked) and first in head
    keys = config_doc.all_keys()
    assert rest == ("\n" + config_doc.entry_text(keys[appo_key]) if appo_key else "")


def test_config_explain_mapping_entry_and_unknown_verl_name(capsys):
    assert main(["config", "explain", "eval.tool_call_limits.python"]) == 0
    assert capsys.readouterr().out == config_doc.entry_text(
        config_doc.all_keys()["eval.tool_call_limits"])
    assert main(["config", "explain", "actor_rollout_ref.actor.clip_ratio_hig"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith("error: actor_rollout_ref.actor.clip_ratio_hig (verl's name")
    assert "actor.clip_ratio_high" in err


def test_config_show_comments_keep_the_data(capsys):
    assert main(["config", "show"]) == 0
    plain = capsys.readouterr().out
    assert main(["config", "show", "--comments"]) == 0
    commented = capsys.readouterr().out
    assert yaml.safe_load(commented) == yaml.safe_load(plain)
    lines = commented.splitlines()
    keys = config_doc.all_keys()
    # each documented key's line comes right after the last line of its meaning
    at = lines.index("  clip_ratio_high: 0.2")
    assert lines[at - 1].strip() == "# " + keys["actor.clip_ratio_high"].meaning
    assert lines[lines.index("  max_steps: null") - 1].lstrip().startswith("#")
    assert sum(line.lstrip().startswith("#") for line in lines) > len(keys)


def test_comments_never_land_inside_a_folded_string():
    from appo.config import load_config, to_yaml

    cfg = load_config()
    # a leading space makes to_yaml fold the string over lines in single quotes; one of
    # them reads like a key (`max_workers:`), one level below result_template
    cfg.rollout.result_template = " it is\nmax_workers: fake\n{text}\n"
    text = to_yaml(cfg)
    assert "\n    max_workers: fake\n" in text
    annotated = config_doc.annotate_yaml(text)
    assert yaml.safe_load(annotated) == yaml.safe_load(text)
    assert yaml.safe_load(annotated)["rollout"]["result_template"] == cfg.rollout.result_template


def test_table_cells_escape_pipes_and_tags_outside_code():
    assert config_doc._md("a | b <result> `x <y> | z`") == "a \\| b &lt;result> `x <y> \\| z`"
