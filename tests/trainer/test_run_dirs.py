"""Issue 24, part A: nothing lost. Run directory policy, atomic and verified checkpoints,
a full disk, metrics rows on resume, a changed config on resume.

Each test here failed on the code before the fix (the defect it names in the issue)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from test_trainer_rl import toy, toy_config  # noqa: F401 - the fixture is used by name

from appo.cli import main
from appo.errors import AppoError
from appo.trainer.checkpoint import latest_checkpoint, save_checkpoint
from appo.trainer.loop import RLTrainer


def _train(toy, *overrides: str) -> RLTrainer:  # noqa: F811
    trainer = RLTrainer(toy_config(toy, "trainer.save_freq=1", *overrides), progress=False)
    trainer.fit()
    return trainer


def _steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


# --------------------------------------------------------------- 1. run directory policy
def test_new_run_into_a_used_directory_refuses_and_touches_nothing(toy, capsys):  # noqa: F811
    _train(toy, "trainer.total_steps=2")
    run = toy["dir"] / "run"
    before = _snapshot(run)
    capsys.readouterr()
    rc = main(["train", "model.path=tiny-test", f"data.train_files=[{toy['data']}]",
               f"custom_reward_function.path={toy['reward']}",
               f"trainer.default_local_dir={run}", "trainer.total_steps=1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    assert "not empty" in err and "trainer.resume=true" in err and "trainer.overwrite=true" in err
    assert _snapshot(run) == before


def test_overwrite_replaces_the_old_run(toy, capsys):  # noqa: F811
    _train(toy, "trainer.total_steps=3")
    run = toy["dir"] / "run"
    _train(toy, "trainer.total_steps=1", "trainer.overwrite=true")
    assert "removed the previous run" in capsys.readouterr().out
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_1"]
    assert _steps(run) == [1]
    assert latest_checkpoint(run) == run / "global_step_1"


def test_overwrite_never_empties_a_directory_that_holds_no_run(tmp_path):
    from appo.trainer.rundir import prepare_run_dir

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(AppoError, match="holds no appo run"):
        prepare_run_dir(str(tmp_path), "appo", "trainer.default_local_dir", overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_default_run_directory_is_unique_per_run(tmp_path, monkeypatch):
    from appo.config import load_config
    from appo.trainer.rundir import prepare_run_dir

    monkeypatch.chdir(tmp_path)
    assert load_config().trainer.default_local_dir is None
    a = prepare_run_dir(None, "appo", "trainer.default_local_dir")
    b = prepare_run_dir(None, "appo", "trainer.default_local_dir")
    assert a != b and a.parent == b.parent == Path("runs")
    assert a.name.startswith("appo-") and b.name.startswith(a.name)
    with pytest.raises(AppoError, match="trainer.resume=true needs trainer.default_local_dir"):
        prepare_run_dir(None, "appo", "trainer.default_local_dir", resume=True)


def test_sft_refuses_a_used_output_dir(tmp_path, capsys):
    out = tmp_path / "sft"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    rc = main(["sft", "model.path=tiny-test", f"sft.output_dir={out}", "sft.max_steps=1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "sft.output_dir" in err, err
    assert (out / "metrics.jsonl").read_text() == '{"step": 1}\n'


# --------------------------------------------------------------- 2. atomic rewrite
def _tiny():
    from appo.models import load_model

    lm = load_model("tiny-test")
    return lm.model, lm.tokenizer


def test_rewriting_a_checkpoint_keeps_the_old_one_until_the_new_is_in(tmp_path, monkeypatch):
    model, tok = _tiny()
    first = save_checkpoint(tmp_path, 2, model, tok)
    real_replace = os.replace

    def crash_on_swap(src, dst):
        if Path(src).name.startswith(".tmp_global_step"):
            raise OSError(errno.EIO, "Input/output error")  # the crash between the renames
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_swap)
    with pytest.raises(AppoError):
        save_checkpoint(tmp_path, 2, model, tok)
    monkeypatch.setattr(os, "replace", real_replace)
    assert latest_checkpoint(tmp_path) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_2", "latest"]


def test_a_kill_between_the_renames_is_recovered_at_the_next_start(toy, capsys):  # noqa: F811
    _train(toy, "trainer.total_steps=2")
    run = toy["dir"] / "run"
    # What a SIGKILL right after "rename the old aside" leaves: no global_step_2 at all.
    os.replace(run / "global_step_2", run / ".old_global_step_2_4242")
    trainer = RLTrainer(toy_config(toy, "trainer.total_steps=2", "trainer.resume=true"),
                        progress=False)
    assert trainer.step == 2
    assert "restored global_step_2" in capsys.readouterr().out


# --------------------------------------------------------------- 3. verified resume
@pytest.mark.parametrize("victim", ["model.safetensors", "trainer_state.pt"])
def test_resume_skips_a_truncated_checkpoint_and_says_so(toy, capsys, victim):  # noqa: F811
    _train(toy, "trainer.total_steps=2")
    run = toy["dir"] / "run"
    f = run / "global_step_2" / victim
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    capsys.readouterr()
    trainer = RLTrainer(toy_config(toy, "trainer.total_steps=3", "trainer.resume=true"),
                        progress=False)
    assert trainer.step == 1
    out = capsys.readouterr()
    assert f"global_step_2: {victim} truncated" in out.err
    assert "resumed from" in out.out and "global_step_1 at step 1" in out.out


def test_no_valid_checkpoint_is_one_line(toy, capsys):  # noqa: F811
    _train(toy, "trainer.total_steps=1")
    run = toy["dir"] / "run"
    f = run / "global_step_1" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    capsys.readouterr()
    rc = main(["train", "model.path=tiny-test", f"data.train_files=[{toy['data']}]",
               f"custom_reward_function.path={toy['reward']}", "trainer.resume=true",
               f"trainer.default_local_dir={run}", "trainer.total_steps=2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("error: no valid checkpoint in") and "truncated" in err[-1]
    assert "unexpected" not in "\n".join(err)


# --------------------------------------------------------------- 4. a full disk
@pytest.mark.parametrize("failure", [
    OSError(errno.ENOSPC, "No space left on device"),
    # What torch.save raised on a full tmpfs here (no errno in it).
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 81984 vs 81872"),
    RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed "
                 "writing file data/0: file write failed"),
])
def test_a_full_disk_during_save_is_one_line_and_leaves_no_temp(tmp_path, monkeypatch, failure):
    model, tok = _tiny()
    good = save_checkpoint(tmp_path, 1, model, tok)

    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(torch, "save", full)
    # torch hides the errno: appo then looks at the free space.
    monkeypatch.setattr("shutil.disk_usage", lambda p: type("U", (), {"free": 1024})())
    with pytest.raises(AppoError) as info:
        save_checkpoint(tmp_path, 2, model, tok)
    msg = str(info.value)
    assert msg == f"could not save checkpoint {tmp_path / 'global_step_2'}: no space left on device"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1", "latest"]
    assert latest_checkpoint(tmp_path) == good


def test_a_killed_model_conversion_leaves_no_temp_dir(tmp_path, monkeypatch):
    from appo.models import loader

    monkeypatch.setenv("APPO_CACHE", str(tmp_path))
    out = loader.converted_dir("tiny-gguf")
    stale = [out.parent / "tiny-gguf.tmp4242", out.parent / ".tmp_tiny-gguf_4243"]
    for d in stale:  # what a kill during an earlier conversion left behind
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * 1000)
    monkeypatch.setattr(loader, "_load_gguf", lambda gguf, dtype: _tiny())
    assert loader.convert_gguf(tmp_path / "fake.gguf", out)
    assert (out / "config.json").is_file()
    assert not any(d.exists() for d in stale)


# --------------------------------------------------------------- 5. metrics on resume
def test_resume_writes_each_step_once(toy, monkeypatch):  # noqa: F811
    run = toy["dir"] / "run"
    real_save = RLTrainer.save

    def killed_at_step_3(self):
        if self.step == 3:
            raise KeyboardInterrupt  # metrics of step 3 are written, its checkpoint is not
        return real_save(self)

    monkeypatch.setattr(RLTrainer, "save", killed_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        _train(toy, "trainer.total_steps=4")
    assert _steps(run) == [1, 2, 3]
    monkeypatch.setattr(RLTrainer, "save", real_save)
    _train(toy, "trainer.total_steps=4", "trainer.resume=true")
    assert _steps(run) == [1, 2, 3, 4]


# --------------------------------------------------------------- 6. changed config on resume
def test_resume_with_a_changed_config_warns_per_key(toy, capsys):  # noqa: F811
    _train(toy, "trainer.total_steps=1")
    capsys.readouterr()
    RLTrainer(toy_config(toy, "trainer.total_steps=2", "trainer.resume=true", "rollout.n=8",
                         "actor.optim.lr=0.02", "trainer.save_freq=1"), progress=False)
    err = capsys.readouterr().err
    warnings = [x for x in err.splitlines() if "changed config" in x]
    assert warnings == ["appo: warning: resuming with a changed config: actor.optim.lr 0.01 -> 0.02",
                        "appo: warning: resuming with a changed config: rollout.n 4 -> 8"]
