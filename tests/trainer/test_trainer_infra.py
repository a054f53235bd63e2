"""Padding, checkpoints and metrics sinks."""

from __future__ import annotations

import json
import math

import torch

from appo.models import load_model
from appo.trainer.batch import pad_right
from appo.trainer.checkpoint import (
    latest_checkpoint,
    load_trainer_state,
    save_checkpoint,
    set_rng_state,
)
from appo.trainer.metrics import MetricsLogger, plot_metrics, read_metrics


def test_pad_right():
    t = pad_right([[1, 2, 3], [4]], 0, torch.long)
    assert t.tolist() == [[1, 2, 3], [4, 0, 0]]


def test_checkpoint_round_trip(tmp_path):
    lm = load_model("tiny-test")
    opt = torch.optim.AdamW(lm.model.parameters(), lr=1e-3)
    lm.model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    torch.manual_seed(5)
    path = save_checkpoint(tmp_path, 3, lm.model, lm.tokenizer, opt, extra={"cursor": 7})
    expected = torch.rand(3)
    assert latest_checkpoint(tmp_path) == path
    reloaded = load_model(str(path))  # plain HF directory, loadable by the normal loader
    for a, b in zip(lm.model.state_dict().values(), reloaded.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    state = load_trainer_state(path)
    assert state["step"] == 3 and state["extra"] == {"cursor": 7}
    set_rng_state(state["rng"])
    assert torch.equal(torch.rand(3), expected)
    opt2 = torch.optim.AdamW(reloaded.model.parameters(), lr=1e-3)
    opt2.load_state_dict(state["optimizer"])
    assert opt2.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    assert not list(tmp_path.glob(".tmp*"))


def test_metrics_jsonl_and_plots(tmp_path, capsys):
    log = MetricsLogger(tmp_path, ["console", "jsonl"])
    log.log(1, {"reward/mean": 0.25, "loss": 1.5, "note": "x"})
    log.log(2, {"reward/mean": 0.5, "loss": float("nan")})
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    # A NaN is kept (null in the file, NaN when read back), never dropped (issue 41).
    assert math.isnan(rows[1].pop("loss"))
    assert rows == [{"step": 1, "reward/mean": 0.25, "loss": 1.5}, {"step": 2, "reward/mean": 0.5}]
    assert '"loss": null' in (tmp_path / "metrics.jsonl").read_text().splitlines()[1]
    err = capsys.readouterr().err
    assert "step 1:" in err and "loss=nan" in err
    files = plot_metrics(tmp_path / "metrics.jsonl", ["reward/mean", "absent"], tmp_path / "plots")
    assert [f.name for f in files] == ["reward_mean.png"]
    assert files[0].stat().st_size > 1000
    json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
