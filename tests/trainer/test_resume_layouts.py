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


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict[str, Path]:
    return make_toy(tmp_path_factory.mktemp("toy"))


GAE = ["rollout.strategy=arpo", "algorithm.adv_estimator=gae", "critic.optim.lr=1e-3"]


def test_two_fsdp_processes_resume_in_one(toy, tmp_path):
    """Two FSDP processes (policy and critic sharded) save at step 2; one process resumes:
    the weights and optimizer states it loads are the saved ones exactly, and it trains on."""
    from safetensors.torch import load_file

    from appo.trainer.loop import RLTrainer

    out = tmp_path / "run"
    r = _accelerate_launch(
        "-m", "appo.cli", "train", "model.path=tiny-test", f"data.train_files=[{toy['data']}]",
        "data.val_files=[]", "data.train_batch_size=2", "data.max_response_length=16",
        f"custom_reward_function.path={toy['reward']}", "rollout.n=4",
        "rollout.initial_rollouts=2", "actor.ppo_mini_batch_size=2", "actor.optim.lr=1e-2",
        *GAE, "trainer.parallel=fsdp", "trainer.total_steps=2",
        f"trainer.default_local_dir={out}", "trainer.logger=[jsonl]")
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = out / "global_step_2"
    saved = torch.load(ckpt / STATE_FILE, map_location="cpu", weights_only=False)
    assert saved["extra"]["parallel"] == "fsdp" and keyed_by_name(saved["optimizer"])

    trainer = RLTrainer(toy_config(toy, *GAE, "trainer.total_steps=3", "trainer.resume=true",
                                   f"trainer.default_local_dir={out}"), progress=False)
    assert trainer.step == 2 and not trainer.fsdp
    weights = load_file(str(ckpt / "model.safetensors"))
    for name, p in trainer.model.named_parameters():
        if name in weights:
            assert torch.equal(p, weights[name]), name
    loaded = full_optimizer_state(trainer.model, trainer.optimizer)
    assert loaded["state"].keys() == saved["optimizer"]["state"].keys()
    for name, st in saved["optimizer"]["state"].items():
        for key, value in st.items():
            assert torch.equal(loaded["state"][name][key], value), (name, key)
    critic_saved = torch.load(ckpt / "critic" / "state.pt", map_location="cpu",
                              weights_only=False)["optimizer"]
    critic_loaded = full_optimizer_state(trainer.critic.model, trainer.critic.optimizer)
    for name, st in critic_saved["state"].items():
        assert torch.equal(critic_loaded["state"][name]["exp_avg"], st["exp_avg"]), name
    trainer.fit()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert (out / "global_step_3" / "model.safetensors").is_file()
