"""The command line's common surface: `appo --version`, `--model` on every command that
runs a model from a config (train and sft as generate, rollout and eval), and examples at
the end of every sub-command's `--help` that the parser accepts."""

from __future__ import annotations

import importlib.metadata
import shlex
from types import SimpleNamespace

import pytest

import appo
from appo.cli import build_parser, main, sub_commands, version
from appo.cli_examples import EXAMPLES
from appo.commands import config_from_args


def test_version(capsys):
    try:
        expected = importlib.metadata.version("appo")
    except importlib.metadata.PackageNotFoundError:
        expected = appo.__version__
    assert version() == expected
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"appo {expected}\n"


def test_version_falls_back_to_the_package(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert version() == appo.__version__


def _leaf_commands() -> dict:
    commands = sub_commands(build_parser())
    return {words: p for words, p in commands.items()
            if not any(other.startswith(words + " ") for other in commands)}


def test_every_command_has_examples_in_its_help():
    leaves = _leaf_commands()
    assert len(leaves) > 20
    assert sorted(set(leaves) - set(EXAMPLES)) == []  # a new command needs an example
    assert sorted(set(EXAMPLES) - set(leaves)) == []  # an example of a command that is gone
    for words, parser in leaves.items():
        text = parser.format_help()
        assert "\nexamples:\n" in text, words
        for line in EXAMPLES[words]:
            assert f"\n  {line}\n" in text + "\n", (words, line)  # kept as written


@pytest.mark.parametrize("words", sorted(EXAMPLES))
def test_examples_parse(words):
    for line in EXAMPLES[words]:
        argv = shlex.split(line)
        assert argv[0] == "appo"
        assert " ".join(argv[1:1 + len(words.split())]) == words
        args = build_parser().parse_args(argv[1:])  # a usage error would exit here
        assert callable(args.handler)


@pytest.mark.parametrize("command", ["train", "sft", "generate", "rollout", "eval"])
def test_model_option_everywhere(command):
    parser = sub_commands(build_parser())[command]
    assert "--model" in parser._option_string_actions
    assert "-m" in parser._option_string_actions


@pytest.mark.parametrize("command", ["train", "sft"])
def test_model_option_sets_model_path(command):
    parser = build_parser()
    args = parser.parse_args([command, "rollout.n=4", "--model", "tiny-test"])
    cfg = config_from_args(args)
    assert cfg.model.path == "tiny-test"
    assert cfg.rollout.n == 4
    args = parser.parse_args([command, "-m", "tiny-test", "model.path=smollm2-135m"])
    assert config_from_args(args).model.path == "smollm2-135m"  # an override still wins
    assert config_from_args(parser.parse_args([command])).model.path == "smollm2-135m"


def test_train_handler_runs_the_given_model(monkeypatch):
    import appo.trainer.loop as loop

    seen = []

    class FakeTrainer:
        def __init__(self, cfg):
            seen.append(cfg)
            self.step, self.dp = 0, SimpleNamespace(is_main=False)

        def fit(self):
            return []

    monkeypatch.setattr(loop, "RLTrainer", FakeTrainer)
    assert main(["train", "--model", "tiny-test", "trainer.total_steps=1"]) == 0
    assert [c.model.path for c in seen] == ["tiny-test"]


def test_model_option_without_a_value_is_one_line(capsys):
    assert main(["sft", "--model"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--model" in err
