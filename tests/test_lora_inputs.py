"""LoRA inputs (issue 41, class 5): a LoRA checkpoint as `model.path` trains on (in full, or
under a new adapter), and every adapter/config mismatch or impossible setting is one line.

The checkpoint is made the way appo saves one (`LoraPolicy.save`: `adapter_config.json` +
`adapter_model.safetensors`, no `config.json`), with B set non-zero so that merging changes
the weights."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from appo.errors import AppoError
from appo.models import load_model
from appo.models.lora import apply_lora
from cli_runner import run_cli
from test_bad_inputs import one_line_error

sys.path.insert(0, str(Path(__file__).parent / "trainer"))
from test_trainer_rl import make_toy, toy_config  # noqa: E402


def _lora_cfg(**kw):
    base = dict(lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, target_modules="all-linear",
                path="tiny-test")
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> Path:
    """A saved tiny-test adapter (rank 4, all-linear) whose B is not zero."""
    out = tmp_path_factory.mktemp("lora") / "adapter"
    torch.manual_seed(0)
    lora = apply_lora(load_model("tiny-test").model, _lora_cfg())
    with torch.no_grad():
        for name, p in lora.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    lora.save(out)
    assert not (out / "config.json").exists() and (out / "adapter_config.json").is_file()
    return out


def _with_base(adapter: Path, dest: Path, base: str) -> Path:
    shutil.copytree(adapter, dest)
    cfg = json.loads((dest / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = base
    (dest / "adapter_config.json").write_text(json.dumps(cfg))
    return dest


def test_the_lora_checkpoint_trains_on_in_full_for_two_steps_and_its_weights_move(
        adapter, tmp_path):
    from appo.trainer.loop import RLTrainer

    merged = {n: p.detach().clone() for n, p in load_model(str(adapter)).model.named_parameters()}
    plain = dict(load_model("tiny-test").model.named_parameters())
    assert any(not torch.equal(merged[n], plain[n]) for n in merged)  # the adapter is merged in
    toy = make_toy(tmp_path)
    cfg = toy_config(toy, "rollout.strategy=grpo", "trainer.total_steps=2",
                     f"model.path={adapter}")
    trainer = RLTrainer(cfg, progress=False)
    params = dict(trainer.model.named_parameters())
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert set(params) == set(merged) and {id(p) for p in params.values()} == optimized
    history = trainer.fit()
    assert [h["step"] for h in history] == [1, 2]
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, merged[n])]
    # every adapted projection of both layers moves, as do the other weights
    assert any("q_proj" in n for n in moved) and any("down_proj" in n for n in moved), moved
    ckpt = Path(cfg.trainer.default_local_dir) / "global_step_2"
    assert (ckpt / "config.json").is_file() and not (ckpt / "adapter_config.json").exists()


def test_a_new_adapter_on_the_lora_checkpoint_trains_from_the_merged_weights(adapter, tmp_path):
    from appo.trainer.loop import RLTrainer

    merged = dict(load_model(str(adapter)).model.named_parameters())
    toy = make_toy(tmp_path)
    cfg = toy_config(toy, "rollout.strategy=grpo", "trainer.total_steps=1",
                     f"model.path={adapter}", "model.lora_rank=2", "model.lora_alpha=4")
    trainer = RLTrainer(cfg, progress=False)
    base = {n.replace(".base_layer", ""): p for n, p in trainer.model.named_parameters()
            if "lora_" not in n}
    assert all(torch.equal(base[n], merged[n]) for n in merged)  # the adapter's base: merged
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
              if p.requires_grad}
    assert before and all("lora_" in n for n in before)
    trainer.fit()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters()
               if n in before)
    saved = json.loads((Path(cfg.trainer.default_local_dir) / "global_step_1"
                        / "adapter_config.json").read_text())
    assert saved["r"] == 2 and saved["base_model_name_or_path"] == str(adapter.resolve())


def test_sft_from_the_lora_checkpoint_trains_every_weight(adapter, tmp_path):
    sys.path.insert(0, str(Path(__file__).parent / "trainer"))
    from test_trainer_sft import _examples

    from appo.config import SFTConfig
    from appo.trainer.sft import train_sft

    lm = load_model(str(adapter))
    assert all(p.requires_grad for p in lm.model.parameters())
    start = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    params = SFTConfig(max_steps=2, batch_size=2, lr=1e-2, warmup_ratio=0.0,
                       output_dir=str(tmp_path / "sft"))
    res = train_sft(lm.model, lm.tokenizer, _examples(lm.tokenizer), params, seed=0,
                    progress=False)
    assert res.steps == 2
    moved = [n for n, p in lm.model.named_parameters() if not torch.equal(p, start[n])]
    assert any("q_proj" in n for n in moved) and any("embed_tokens" in n for n in moved)


def test_resume_with_another_rank_names_both_values(adapter, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    toy = make_toy(tmp_path)
    args = [f"data.train_files=[{toy['data']}]", "data.val_files=[]", "data.train_batch_size=2",
            "data.max_response_length=8", "rollout.strategy=grpo", "rollout.n=2",
            "actor.ppo_mini_batch_size=2", "trainer.logger=[jsonl]", "tools.enabled=[]",
            f"custom_reward_function.path={toy['reward']}", "model.path=tiny-test",
            "trainer.default_local_dir=run", "model.lora_alpha=8"]
    r = run_cli("train", *args, "trainer.total_steps=1", "model.lora_rank=4")
    assert r.returncode == 0, r.stderr[-2000:]
    before = sorted(p.name for p in Path("run").iterdir())
    r = run_cli("train", *args, "trainer.total_steps=2", "model.lora_rank=2",
                "trainer.resume=true")
    line = one_line_error(r, "model.lora_rank=4", "model.lora_rank=2", "global_step_1")
    assert "RuntimeError" not in line
    assert sorted(p.name for p in Path("run").iterdir()) == before


@pytest.mark.parametrize("overrides, names", [
    # the output layer: the trainer reads its weight directly, an adapter gets no gradient
    (dict(target_modules=["lm_head"]), ["model.target_modules", "lm_head", "output layer"]),
    # tiny-test ties its input embeddings to the output layer
    (dict(target_modules=["embed_tokens"]), ["embed_tokens", "output layer"]),
    # PEFT adapts q_proj and ignores the name it cannot find
    (dict(target_modules=["q_proj", "bogus"]),
     ["model.target_modules", "'bogus'", "q_proj", "v_proj", "down_proj"]),
    # the layers are 64 wide: rank 100000 would be an 819 MB adapter that adds nothing
    (dict(lora_rank=100000), ["model.lora_rank=100000", "64 x 64", "<= 64"]),
    (dict(lora_rank=65, target_modules=["down_proj"]), ["model.lora_rank=65", "down_proj"]),
])
def test_impossible_adapters_are_one_line_and_leave_the_model_alone(overrides, names):
    model = load_model("tiny-test").model
    with pytest.raises(AppoError) as e:
        apply_lora(model, _lora_cfg(**overrides))
    message = str(e.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message
    assert not any("lora_" in n for n, _ in model.named_parameters())  # nothing injected


def test_the_largest_useful_rank_is_accepted():
    lora = apply_lora(load_model("tiny-test").model, _lora_cfg(lora_rank=64,
                                                              target_modules=["q_proj"]))
    assert len(lora.layers) == 2


def test_an_adapter_whose_base_is_itself_is_one_line(adapter, tmp_path):
    own = _with_base(adapter, tmp_path / "own", str(tmp_path / "own"))
    with pytest.raises(AppoError, match=r"own/adapter_config\.json names a base model that "
                                        r"leads back to the adapter itself"):
        load_model(str(own))
    # two adapters naming each other: the loop is named, no RecursionError
    a = _with_base(adapter, tmp_path / "a", str(tmp_path / "b"))
    _with_base(adapter, tmp_path / "b", str(a))
    with pytest.raises(AppoError, match="leads back to the adapter itself") as e:
        load_model(str(a))
    assert str(tmp_path / "a") in str(e.value) and str(tmp_path / "b") in str(e.value)


def test_an_adapter_on_an_adapter_loads_through_the_chain(adapter, tmp_path):
    inner = _with_base(adapter, tmp_path / "inner", "tiny-test")
    outer = _with_base(adapter, tmp_path / "outer", str(inner))
    once = dict(load_model(str(inner)).model.named_parameters())
    twice = dict(load_model(str(outer)).model.named_parameters())
    assert any(not torch.equal(once[n], twice[n]) for n in once)


def test_a_missing_base_names_the_adapter_config_it_came_from(adapter, tmp_path):
    gone = _with_base(adapter, tmp_path / "gone", str(tmp_path / "deleted-base"))
    with pytest.raises(AppoError) as e:
        load_model(str(gone))
    assert str(gone / "adapter_config.json") in str(e.value)
    assert str(tmp_path / "deleted-base") in str(e.value) and "not found" in str(e.value)
