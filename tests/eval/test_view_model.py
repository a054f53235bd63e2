"""`appo view` reads a dump with the model that wrote it (issue 42): trainer dumps and
`appo rollout -o` record it in each line's `extra["model"]`, an eval's trajectories in its
output directory's `eval.json`. Without `--model` the recorded one's tokenizer is used; a
different `--model` is refused in one line (`--force-model` overrides); a dump that records
neither its model nor its token text asks for `--model` instead of guessing one.
"""

from __future__ import annotations

import html
import json
import re

import pytest

import appo.eval.commands as eval_commands
from appo.cli import main
from appo.models.tiny import build_tiny_tokenizer
from appo.rollout.records import Segment, Trajectory, model_record, write_jsonl

TOK = build_tiny_tokenizer()
TEXT = "<think>pick seven</think> <answer>\\boxed{7}</answer>"


def trajectory(token_text: bool = False) -> Trajectory:
    ids = TOK.encode(TEXT, add_special_tokens=False)
    extra = {"token_text": [TOK.decode([i]) for i in ids]} if token_text else {}
    return Trajectory(uid="q0", traj_id="t0", prompt_ids=TOK.encode("q?"), response_ids=ids,
                      loss_mask=[1] * len(ids), logp_rollout=[-0.5] * len(ids),
                      entropy=[0.1] * len(ids), segments=[Segment(0, len(ids), True, 0.1)],
                      finish_reason="eos", reward=1.0, extra=extra)


@pytest.fixture
def loaded(monkeypatch) -> list[str]:
    """The model specs whose tokenizer `appo view` loads (the tiny one, whatever asked)."""
    specs: list[str] = []

    def spy(spec):
        specs.append(spec)
        return TOK

    monkeypatch.setattr(eval_commands, "load_tokenizer", spy)
    return specs


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_a_dump_records_its_model_and_view_uses_it(tmp_path, loaded, capsys):
    dump = tmp_path / "step_00001.jsonl"
    write_jsonl([trajectory()], dump, model="tiny-test")
    assert json.loads(dump.read_text())["extra"]["model"] == "tiny-test"
    page = tmp_path / "page.html"
    assert main(["view", str(dump), "-o", str(page)]) == 0
    assert loaded == ["tiny-test"]
    shown = html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))
    assert "pick seven" in shown  # the ids rendered through the recorded model's tokenizer
    # The same model given: fine; a local path is recorded absolute and compared so.
    assert main(["view", str(dump), "-o", str(page), "--model", "tiny-test"]) == 0
    (tmp_path / "local-model").mkdir()
    assert model_record(tmp_path / "local-model") == str((tmp_path / "local-model").resolve())


def test_another_model_is_refused_unless_forced(tmp_path, loaded, capsys):
    dump = tmp_path / "dump.jsonl"
    write_jsonl([trajectory()], dump, model="my-org/my-model")
    page = tmp_path / "page.html"
    assert main(["view", str(dump), "-o", str(page), "--model", "tiny-test"]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == ("error: --model tiny-test is not the model that wrote the dump "
                    "(my-org/my-model), whose tokenizer renders its tokens: drop --model, or "
                    "add --force-model to read it with this one anyway"), line
    assert loaded == [] and not page.exists()
    assert main(["view", str(dump), "-o", str(page), "--model", "tiny-test",
                 "--force-model"]) == 0
    assert loaded == ["tiny-test"] and page.is_file()


def test_no_record_and_no_token_text_asks_for_the_model(tmp_path, loaded, capsys):
    dump = tmp_path / "old.jsonl"
    write_jsonl([trajectory()], dump)  # as dumps were written before the record
    page = tmp_path / "page.html"
    assert main(["view", str(dump), "-o", str(page)]) == 2
    line = one_line(capsys.readouterr().err)
    assert line == ("error: the dump holds no token text and does not record the model that "
                    "wrote it: give --model (that model, whose tokenizer reads its ids)"), line
    assert loaded == [] and not page.exists()  # no default model loaded behind the user's back
    assert main(["view", str(dump), "-o", str(page), "--model", "tiny-test"]) == 0
    assert loaded == ["tiny-test"]
    # Token text in the dump: no tokenizer needed, none loaded.
    with_text = tmp_path / "with_text.jsonl"
    write_jsonl([trajectory(token_text=True)], with_text)
    assert main(["view", str(with_text), "-o", str(page)]) == 0
    assert loaded == ["tiny-test"]


def test_dumps_of_two_models_are_refused(tmp_path, loaded, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl([trajectory()], a, model="tiny-test")
    write_jsonl([trajectory()], b, model="other-model")
    assert main(["view", str(a), str(b), "-o", str(tmp_path / "p.html")]) == 2
    assert one_line(capsys.readouterr().err) == (
        "error: the dumps were written by different models (other-model, tiny-test): view "
        "them one model at a time")


def test_an_eval_output_records_its_model_beside_the_trajectories(tmp_path, loaded, capsys):
    """An eval's trajectories carry token text; the model is in `<out>/eval.json`."""
    out = tmp_path / "ev"
    (out / "arith").mkdir(parents=True)
    (out / "eval.json").write_text(json.dumps({"model.path": "my-org/evaluated"}))
    dump = out / "arith" / "trajectories.jsonl"
    write_jsonl([trajectory(token_text=True)], dump)
    page = tmp_path / "page.html"
    assert main(["view", str(dump), "-o", str(page)]) == 0 and loaded == []
    assert main(["view", str(out), "-o", str(page), "--model", "tiny-test"]) == 2
    assert "(my-org/evaluated)" in one_line(capsys.readouterr().err)



def test_appo_rollout_records_its_model(tmp_path, loaded):
    from cli_runner import run_cli

    out = tmp_path / "rollout.jsonl"
    r = run_cli("rollout", "--model", "tiny-test", "--no-tools", "rollout.n=2",
                "data.max_response_length=8", "data.max_prompt_length=4096", "hi",
                "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and {row["extra"]["model"] for row in rows} == {"tiny-test"}
    assert main(["view", str(out), "-o", str(tmp_path / "page.html")]) == 0
    assert loaded == ["tiny-test"]
