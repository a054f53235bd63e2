"""Checkpoints resume in any layout and world size: the optimizer states are saved keyed by
parameter name (torch's state-dict API) whatever the layout that wrote them, so a run saved
by two FSDP processes resumes in one process (and the reverse), bit for bit in what it
loads. Older positional optimizer states still resume in the layout that wrote them."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from test_trainer_rl import _accelerate_launch, make_toy, toy_config

from appo.trainer.checkpoint import STATE_FILE
from appo.trainer.fsdp import full_optimizer_state, keyed_by_name, load_optimizer_state


class Tied(torch.nn.Module):
    """Two layers whose output weight is the embedding's (one parameter, two names)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.mid(self.embed(ids))))


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (4, 5), generator=g)
    opt.zero_grad()
    model(ids).logsumexp(-1).mean().backward()
    opt.step()


def _trained() -> tuple[Tied, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for seed in range(2):
        _step(model, opt, seed)
    return model, opt


def _through_a_file(state: dict) -> dict:
    """As a checkpoint hands it over: a copy (on one process the gathered state's tensors
    are the optimizer's own, which a second optimizer must not share)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_name_keyed_optimizer_state_round_trip_continues_bit_for_bit():
    model, opt = _trained()
    saved = _through_a_file(full_optimizer_state(model, opt))
    assert keyed_by_name(saved) and not keyed_by_name(opt.state_dict())
    assert set(saved["state"]) == {"embed.weight", "mid.weight", "mid.bias"}  # tied: once
    fresh = Tied()
    fresh.load_state_dict(model.state_dict())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_optimizer_state(fresh, fresh_opt, saved)
    for (p, q) in zip(model.parameters(), fresh.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key
    _step(model, opt, 7)  # the same process and order: the next step is the same bit for bit
    _step(fresh, fresh_opt, 7)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)


def test_positional_optimizer_state_still_loads():
    model, opt = _trained()
    fresh = Tied()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_optimizer_state(fresh, fresh_opt, _through_a_file(opt.state_dict()))
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], fresh_opt.state[q]["exp_avg"])


GAE = ["rollout.strategy=arpo", "algorithm.adv_estimator=gae", "critic.optim.lr=1e-3"]


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict[str, Path]:
    return make_toy(tmp_path_factory.mktemp("toy"))


@pytest.fixture(scope="module")
def fsdp_runs(toy) -> Path:
    """Two FSDP processes (policy and critic sharded), 2 steps saved at each: `whole/` with
    whole-state checkpoints, `sharded/` with sharded ones (layouts_worker.py, one launch)."""
    here = Path(__file__).parent
    r = _accelerate_launch(str(here / "layouts_worker.py"), str(toy["dir"]), str(here),
                           timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return toy["dir"]


def _resume_in_one_process(toy, out: Path, *extra: str):
    from appo.trainer.loop import RLTrainer

    trainer = RLTrainer(toy_config(toy, *GAE, "trainer.total_steps=3", "trainer.resume=true",
                                   f"trainer.default_local_dir={out}", *extra), progress=False)
    assert trainer.step == 2 and not trainer.fsdp
    return trainer


def _assert_loaded(trainer, weights: dict, policy_optim: dict, critic_optim: dict) -> None:
    """The resumed trainer holds exactly `weights` and the saved optimizer states."""
    named = trainer.model.state_dict()  # tied weights under both names, as saved
    assert set(weights) <= set(named) and weights
    for name, value in weights.items():
        assert torch.equal(named[name], value), name
    for module, optimizer, saved in ((trainer.model, trainer.optimizer, policy_optim),
                                     (trainer.critic.model, trainer.critic.optimizer,
                                      critic_optim)):
        loaded = full_optimizer_state(module, optimizer)["state"]
        assert loaded.keys() == saved["state"].keys() and loaded
        for name, st in saved["state"].items():
            for key, value in st.items():
                assert torch.equal(loaded[name][key], value), (name, key)


def _train_on(trainer, out: Path) -> None:
    trainer.fit()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert (out / "global_step_3" / "model.safetensors").is_file()


@pytest.mark.slow
def test_two_fsdp_processes_resume_in_one(toy, fsdp_runs):
    """Whole states saved by two FSDP processes resume in one: the weights and optimizer
    states it loads are the saved ones exactly, and it trains on."""
    from safetensors.torch import load_file

    out = fsdp_runs / "whole"
    ckpt = out / "global_step_2"
    saved = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
    assert saved["extra"]["parallel"] == "fsdp" and keyed_by_name(saved["optimizer"])
    critic = torch.load(ckpt / "critic" / "state.pt", map_location="cpu", weights_only=False)
    trainer = _resume_in_one_process(toy, out)
    _assert_loaded(trainer, load_file(str(ckpt / "model.safetensors")), saved["optimizer"],
                   critic["optimizer"])
    _train_on(trainer, out)


def _read_shards(ckpt: Path, tmp_path: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt / "shards"), str(tmp_path / "all.pt"))
    return torch.load(tmp_path / "all.pt", weights_only=False)


def test_sharded_checkpoints_resume_in_one_process_and_export(toy, fsdp_runs, tmp_path):
    """Sharded checkpoints of two FSDP processes: step 1 holds shards and no whole model,
    the run's last (step 2) the whole model too (equal to its shards); `appo export` turns
    step 1 into a directory transformers loads, equal to its shards; one process resumes
    step 2 with exactly the saved states and trains on."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from appo.cli import main

    out = fsdp_runs / "sharded"
    first, last = out / "global_step_1", out / "global_step_2"
    assert (first / "shards").is_dir() and not any(first.glob("*.safetensors"))
    assert (first / "config.json").is_file() and not (first / "critic").exists()
    shards = _read_shards(last, tmp_path)
    whole = load_file(str(last / "model.safetensors"))
    for name, value in whole.items():
        assert torch.equal(shards["model"][name], value), name

    exported = tmp_path / "hf"
    assert main(["export", str(first), str(exported)]) == 0
    model = AutoModelForCausalLM.from_pretrained(exported)
    step1 = _read_shards(first, tmp_path)["model"]
    for name, p in model.state_dict().items():
        if name in step1:
            assert torch.equal(p, step1[name]), name
    assert not all(torch.equal(step1[n], whole[n]) for n in whole)  # step 2 moved them
    assert main(["export", str(first), str(exported)]) == 2  # not into a full directory

    saved = torch.load(last / STATE_FILE, map_location="cpu", weights_only=False)
    assert saved["extra"]["sharded"] and saved["optimizer"] is None
    trainer = _resume_in_one_process(toy, out, "trainer.sharded_checkpoint=true")
    _assert_loaded(trainer, whole, shards["optimizer"], shards["critic.optimizer"])
    _train_on(trainer, out)
