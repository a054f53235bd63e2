"""The catalogue of bad inputs (issue 24, defects 7 and 8): each is one `error: ...` line
naming the problem, a non-zero exit, no traceback, and the user's files left as they were;
or, where appo accepts and adjusts a value, one `warning: ...` line.

Commands run through the real command line in a subprocess (`run_cli`), as a user would
meet them; the tiny random model (`tiny-test`) keeps the ones that load a model fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from appo.tools.executor import ToolCall, ToolExecutor
from appo.tools.search_cache import SearchCache
from appo.tools.search_tool import SearchTool
from cli_runner import run_cli
from toy_files import make_toy_files

TINY_TRAIN = ["model.path=tiny-test", "data.val_files=[]", "data.train_batch_size=2",
              "data.max_response_length=8", "rollout.strategy=grpo", "rollout.n=2",
              "actor.ppo_mini_batch_size=2", "trainer.logger=[jsonl]", "tools.enabled=[]"]


def one_line_error(r: subprocess.CompletedProcess, *names: str) -> str:
    """The command failed with exactly one `error:` line naming every one of `names`."""
    assert r.returncode != 0, r.stdout[-500:]
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    line = lines[0]
    # "unexpected <Exception>" is the CLI's last resort for internal errors, not a message.
    assert line.startswith("error: ") and "unexpected" not in line, line
    for name in names:
        assert name in line, line
    return line


def snapshot(*paths: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in paths}


def assert_intact(before: dict[Path, bytes]) -> None:
    for path, data in before.items():
        assert path.read_bytes() == data, f"{path} was changed"


@pytest.fixture
def files(tmp_path, monkeypatch) -> Path:
    make_toy_files(tmp_path, monkeypatch, reward=False)
    Path("not_utf8.jsonl").write_bytes(b'{"question": "q?", "answer": "1"}\n'
                                       b'{"question": "caf\xe9?", "answer": "2"}\n')
    return tmp_path


# ---------------------------------------------------------------- 7: config and command line
@pytest.mark.parametrize("args, names", [
    (["rollout=3"], ["'rollout' is a section", "rollout.name="]),
    (["actor.optim=2"], ["'actor.optim' is a section"]),
])
def test_a_section_given_a_value(files, args, names):
    one_line_error(run_cli("config", "show", *args), *names)


def test_a_section_given_a_value_in_yaml(files):
    Path("c.yaml").write_text("rollout: 3\n")
    before = snapshot(Path("c.yaml"))
    one_line_error(run_cli("config", "show", "c.yaml"), "'rollout' (in c.yaml) is a section")
    assert_intact(before)


def test_yaml_errors_give_file_line_and_column(files):
    Path("c.yaml").write_text("rollout:\n  n: [1\n  x: 2\n")
    one_line_error(run_cli("config", "show", "c.yaml"), "c.yaml:3:4:", "cannot parse")
    Path("latin1.yaml").write_bytes(b"rollout:\n  result_template: caf\xe9 {text}\n")
    one_line_error(run_cli("config", "show", "latin1.yaml"), "latin1.yaml", "not UTF-8")


@pytest.mark.parametrize("args, names", [
    (["generate", "--model", "tiny-test", "--max-new-tokens", "-4", "hi"],
     ["--max-new-tokens", ">= 1", "-4"]),
    (["generate", "--model", "tiny-test", "--max-new-tokens", "0", "hi"], ["--max-new-tokens"]),
    (["generate", "--model", "tiny-test", "--temperature", "-1", "hi"], ["--temperature", "-1"]),
    (["generate", "--model", "tiny-test", "--top-p", "1.5", "hi"], ["--top-p", "1.5"]),
    (["eval", "--model", "tiny-test", "--k", "0"], ["--k", "0"]),
    (["eval", "--model", "tiny-test", "--batch-size", "-1"], ["--batch-size"]),
    (["tool", "python", "--timeout", "-2", "print(1)"], ["--timeout", "-2"]),
    (["data", "synth", "arith", "--n", "-3", "--out", "x.jsonl"], ["--n", "-3"]),
])
def test_negative_or_zero_numbers_on_the_command_line(files, args, names):
    one_line_error(run_cli(*args), *names)
    assert not Path("x.jsonl").exists()


def test_options_anywhere_among_overrides(files):
    Path("c.yaml").write_text("rollout:\n  n: 3\n")
    r = run_cli("config", "show", "rollout.top_k=5", "--config", "c.yaml", "rollout.seed=9")
    assert r.returncode == 0, r.stderr
    rollout = r.stdout.split("rollout:", 1)[1]
    assert "'n': 3" in rollout and "top_k: 5" in rollout and "seed: 9" in rollout
    # appo train parses the same way: the file's total_steps=0 is reached (and refused).
    Path("t.yaml").write_text("trainer:\n  total_steps: 0\n")
    one_line_error(run_cli("train", "model.path=tiny-test", "--config", "t.yaml",
                           "rollout.n=2"), "trainer.total_steps")


def test_a_closed_stdout_ends_quietly(files):
    """`appo tool python ... | head`: the reader is gone before the result is printed."""
    proc = subprocess.Popen([sys.executable, "-m", "appo.cli", "tool", "python",
                             "print('x' * 200_000)"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # as `head` does once it has its lines
    _, err = proc.communicate(timeout=120)
    assert err == "" and proc.returncode == 141  # 128 + SIGPIPE, as the shell shows it


# ---------------------------------------------------------------- 7: files
def test_non_utf8_data(files):
    before = snapshot(Path("not_utf8.jsonl"))
    one_line_error(run_cli("data", "inspect", "not_utf8.jsonl"), "not_utf8.jsonl:2:18",
                   "not UTF-8", "0xe9")
    one_line_error(run_cli("train", *TINY_TRAIN, "data.train_files=[not_utf8.jsonl]",
                           "trainer.default_local_dir=run"), "not_utf8.jsonl:2:18")
    one_line_error(run_cli("eval", "--model", "tiny-test", "--data", "b=not_utf8.jsonl",
                           "--no-tools", "--out", "ev"), "not_utf8.jsonl:2:18")
    assert_intact(before)


def test_non_utf8_eval_samples(files):
    samples = Path("ev/toy/samples.jsonl")
    samples.parent.mkdir(parents=True)
    samples.write_bytes(b"\xff\xfe\n")
    before = snapshot(samples)
    one_line_error(run_cli("eval", "--model", "tiny-test", "--data", "toy=toy.jsonl",
                           "--no-tools", "--out", "ev", "eval.max_response_length=4"),
                   "samples.jsonl:1:1", "not UTF-8", "move the file away")
    assert_intact(before)


@pytest.mark.parametrize("command", ["train", "eval"])
def test_output_directory_that_is_a_file(files, command):
    Path("afile").write_text("keep me")
    before = snapshot(Path("afile"))
    for out, name in (("afile", "afile (") , ("afile/run", "afile is a file")):
        if command == "train":
            r = run_cli("train", *TINY_TRAIN, "data.train_files=[toy.jsonl]",
                        f"trainer.default_local_dir={out}")
            one_line_error(r, name, "trainer.default_local_dir")
        else:
            r = run_cli("eval", "--model", "tiny-test", "--data", "toy=toy.jsonl", "--no-tools",
                        "--out", out)
            one_line_error(r, name, "eval.out_dir")
    assert_intact(before)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
@pytest.mark.parametrize("command", ["train", "eval"])
def test_read_only_output_directory(files, command):
    Path("ro").mkdir()
    Path("ro").chmod(0o555)
    try:
        if command == "train":
            r = run_cli("train", *TINY_TRAIN, "data.train_files=[toy.jsonl]",
                        "trainer.default_local_dir=ro/run")
        else:
            r = run_cli("eval", "--model", "tiny-test", "--data", "toy=toy.jsonl", "--no-tools",
                        "--out", "ro/run")
        one_line_error(r, "ro/run", "Permission denied")
        assert list(Path("ro").iterdir()) == []
    finally:
        Path("ro").chmod(0o755)


def test_a_run_that_fails_early_leaves_no_empty_directories(files):
    Path("empty.jsonl").write_text(json.dumps({"question": " ", "answer": "1"}) + "\n")
    one_line_error(run_cli("train", *TINY_TRAIN, "data.train_files=[empty.jsonl]",
                           "trainer.default_local_dir=new/parent/run"), "empty prompt")
    assert not Path("new").exists()


def _damaged_cache(path: Path) -> Path:
    """A cache whose file header is intact and whose pages after the first are garbage."""
    cache = SearchCache(path)
    cache.put_many("replay", {}, [(f"query {i}", "Page 1: " + "x" * 500) for i in range(200)])
    cache.close()
    data = bytearray(path.read_bytes())
    data[4096:] = b"Z" * (len(data) - 4096)
    path.write_bytes(bytes(data))
    return path


def test_damaged_search_cache_is_an_error_at_open(files):
    cache = _damaged_cache(files / "c.sqlite")
    before = snapshot(cache)
    one_line_error(run_cli("search", "cache", "stats", "--cache-file", str(cache)),
                   "c.sqlite is damaged", "delete it")
    assert_intact(before)


def test_training_with_a_damaged_search_cache_stops(files):
    """Not left out with a warning (the model would then get `unknown tool` texts)."""
    cache = _damaged_cache(files / "c.sqlite")
    Path("recorded.json").write_text(json.dumps({"q": "Page 1: a"}))
    tools = ["tools.enabled=[search]", "tools.tool_instances.search.class_path="
             "appo.tools.search_tool.SearchTool", "tools.tool_instances.search.params="
             f"{{backend: replay, replay_file: recorded.json, cache_file: {cache}}}"]
    r = run_cli("train", *TINY_TRAIN[:-1], *tools, "data.train_files=[toy.jsonl]",
                "trainer.default_local_dir=run", "trainer.total_steps=1")
    one_line_error(r, "c.sqlite is damaged")


def test_a_cache_damaged_during_a_run_stops_the_rollout(files):
    """A search must not answer the model with an error text because the cache broke."""
    from appo.errors import ToolFatalError  # new with this check; imported here so the
    # rest of the file also runs against older code
    Path("recorded.json").write_text(json.dumps({"q": "Page 1: a"}))
    path = files / "c.sqlite"
    tool = SearchTool(backend="replay", replay_file="recorded.json", cache_file=str(path))
    tool.cache.put_many("replay", {}, [(f"query {i}", "x" * 500) for i in range(200)])
    with ToolExecutor({"search": tool}) as executor:
        assert executor.execute(ToolCall("search", "q")).ok
        tool.cache.close()  # the next call reconnects to the damaged file
        data = bytearray(path.read_bytes())
        data[4096:] = b"Z" * (len(data) - 4096)
        path.write_bytes(bytes(data))
        with pytest.raises(ToolFatalError, match="c.sqlite is damaged"):
            executor.execute(ToolCall("search", "query 7"))


# ---------------------------------------------------------------- 8: silently accepted
def test_initial_rollouts_above_n_is_warned_once(files):
    r = run_cli("config", "show", "rollout.strategy=arpo", "rollout.n=4",
                "rollout.initial_rollouts=6")
    assert r.returncode == 0
    assert r.stderr.strip().splitlines() == [
        "warning: rollout.initial_rollouts=6 is more than rollout.n=4: clamped to 4, which "
        "leaves arpo no budget to branch"]


def test_negative_temperature_is_refused_and_zero_is_greedy(files):
    for key in ("rollout.temperature", "eval.temperature"):
        one_line_error(run_cli("config", "show", f"{key}=-0.5"), key, "-0.5", "0 is greedy")
    assert run_cli("config", "show", "rollout.temperature=0").returncode == 0


@pytest.mark.parametrize("row, names", [
    ({"question": "", "answer": "1"}, ["row 1", "empty prompt", "'question'"]),
    ({"question": "  \n", "answer": "1"}, ["row 1", "empty prompt"]),
    ({"prompt": [{"role": "user", "content": " "}], "answer": "1"},
     ["row 1", "prompt[0] is an empty user message"]),
])
def test_empty_prompts_are_refused_with_the_row(files, row, names):
    data = Path("d.jsonl")
    data.write_text(json.dumps({"question": "fine?", "answer": "1"}) + "\n" + json.dumps(row)
                    + "\n")
    before = snapshot(data)
    one_line_error(run_cli("data", "inspect", "d.jsonl"), "d.jsonl", *names)
    assert_intact(before)


def test_zero_steps_is_refused(files):
    for key in ("trainer.total_steps", "trainer.total_epochs"):
        one_line_error(run_cli("train", *TINY_TRAIN, "data.train_files=[toy.jsonl]",
                               "trainer.default_local_dir=run", f"{key}=0"), key, ">= 1")
    assert not Path("run").exists()


def test_skipped_overlong_prompts_are_counted(files):
    with open("mixed.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"question": f"q{i}?", "answer": "7"}) + "\n")
        for _ in range(2):
            f.write(json.dumps({"question": "long " * 400, "answer": "7"}) + "\n")
    r = run_cli("train", *TINY_TRAIN, "data.train_files=[mixed.jsonl]",
                "data.max_prompt_length=1000", "trainer.default_local_dir=run",
                "trainer.total_steps=1")
    assert r.returncode == 0, r.stderr[-2000:]
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1
    assert ("data.train_files: skipped 2 of 5 prompts longer than "
            "data.max_prompt_length=1000") in warnings[0]

