"""LoRA (`model.lora_rank` > 0, appo.models.lora) on tiny-test: only the adapter trains, the
reward rises, resume equals an uninterrupted run, the merged checkpoint is the adapted
model, rollouts sample from it, and the KL reference is the base model (adapter off)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_trainer_rl import make_toy, toy_config

from appo.algos.kl import KL_ESTIMATORS
from appo.errors import AppoError
from appo.models import load_model
from appo.trainer.batch import TrainBatch, pad_right
from appo.trainer.loop import RLTrainer
from logp_check import rollout_logp_errors

LORA = ("model.lora_rank=8", "model.lora_alpha=16")


@pytest.fixture
def toy(tmp_path) -> dict[str, Path]:
    return make_toy(tmp_path)


def _base_params() -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in load_model("tiny-test").model.named_parameters()}


def test_only_adapter_parameters_change(toy):
    cfg = toy_config(toy, "rollout.strategy=grpo", "trainer.total_steps=2", *LORA)
    trainer = RLTrainer(cfg, progress=False)
    adapter = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
               if p.requires_grad}
    assert adapter and all("lora_" in n for n in adapter)
    optimized = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert len(optimized) == len(adapter)  # optimizer states for the adapter only
    trainer.fit()
    base = _base_params()
    for name, p in trainer.model.named_parameters():
        if name in adapter:
            continue
        # PEFT keeps an adapted layer's weight under `<layer>.base_layer.weight`
        assert torch.equal(p, base[name.replace(".base_layer", "")]), name
    moved = [n for n, p in trainer.model.named_parameters()
             if n in adapter and not torch.equal(p, adapter[n])]
    assert any("lora_B" in n for n in moved)  # B starts at 0: it must move for any change
    ckpt = Path(cfg.trainer.default_local_dir) / "global_step_2"
    assert (ckpt / "adapter_model.safetensors").is_file()
    assert json.loads((ckpt / "adapter_config.json").read_text())["r"] == 8
    assert not (ckpt / "model.safetensors").exists()
    assert "time/lora_merge" in trainer.logger.path.read_text()


def test_reward_rises_with_lora(toy):
    # tiny-test's tied embeddings are initialised with std 0.02, so with the LM head and the
    # final norm frozen a logit can move by at most |RMSNorm(h)| |e| ~ 8 * 0.16: no adapter
    # can reach a peaked distribution (measured: the reward stays at ~0.23 for 10 steps at
    # lr 2e-2 to 1e-1). Embeddings 8x larger give the head a usable logit range.
    lm = load_model("tiny-test")
    with torch.no_grad():
        lm.model.get_input_embeddings().weight.mul_(8.0)
    cfg = toy_config(toy, "rollout.strategy=grpo", "rollout.n=8", "trainer.total_steps=10",
                     "actor.optim.lr=2e-2", "data.max_response_length=12", *LORA)
    history = RLTrainer(cfg, lm=lm, progress=False).fit()
    rewards = [h["reward/mean"] for h in history]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.3, rewards  # measured: about 0.3 -> 0.98


def test_lora_resume_equals_uninterrupted(toy, tmp_path):
    from resume_check import straight_and_resumed

    runs = straight_and_resumed(toy, tmp_path, "rollout.strategy=arpo", "trainer.save_freq=2",
                                *LORA)
    assert [h["step"] for h in runs.rest] == [3]
    runs.assert_same_metrics(["reward/mean", "actor/pg_loss", "actor/grad_norm",
                              "rollout/tokens_decoded"])
    a = load_file(str(runs.a / "global_step_3" / "adapter_model.safetensors"))
    b = load_file(str(runs.b / "global_step_3" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_checkpoint_of_the_other_kind(toy, tmp_path):
    run = f"trainer.default_local_dir={tmp_path / 'r'}"
    RLTrainer(toy_config(toy, "rollout.strategy=grpo", "trainer.total_steps=1", run,
                         *LORA), progress=False).fit()
    with pytest.raises(AppoError, match="LoRA adapter"):
        RLTrainer(toy_config(toy, "rollout.strategy=grpo", "trainer.total_steps=2", run,
                             "trainer.resume=true"), progress=False)




def test_merged_checkpoint_is_the_adapted_model_and_rollouts_sample_from_it(toy, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = toy_config(toy, "rollout.strategy=grpo", "trainer.total_steps=2",
                     "trainer.save_freq=1", "model.lora_save_merged=true",
                     f"trainer.rollout_data_dir={tmp_path / 'dump'}", *LORA)
    trainer = RLTrainer(cfg, progress=False)
    trainer.fit()
    run = Path(cfg.trainer.default_local_dir)
    # Plain transformers, no appo, no PEFT: base parameter names only.
    merged = AutoModelForCausalLM.from_pretrained(run / "global_step_2" / "merged")
    names = load_file(str(run / "global_step_2" / "merged" / "model.safetensors")).keys()
    assert not [n for n in names if "lora_" in n or n.startswith("base_model.")]
    ids = torch.tensor([list(range(5, 60))])
    with torch.no_grad():
        want = trainer.model(ids).logits
        got = merged(ids).logits
        with trainer.lora.disabled():
            base = trainer.model(ids).logits
    # float32: W + BA merged vs x W^T + (x A^T) B^T differ by rounding only
    assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
    assert (base - want).abs().max() > 1e-3  # the adapter did change the model
    # The adapter checkpoint itself as a model spec: its base (tiny-test, named in
    # adapter_config.json) with the adapter merged by PEFT.
    with torch.no_grad():
        from_adapter = load_model(str(run / "global_step_2")).model(ids).logits
    assert torch.allclose(from_adapter, want, atol=1e-5)
    # Step 2's rollouts came from the policy after step 1 (the hf engine's merged weights,
    # re-merged after the update): their log-probs are the step-1 merged model's.
    step1 = AutoModelForCausalLM.from_pretrained(run / "global_step_1" / "merged")
    dump = tmp_path / "dump" / "step_00002.jsonl"
    errors = rollout_logp_errors(step1, dump)
    assert len(errors) > 20 and max(errors) < 1e-4, max(errors)
    assert max(rollout_logp_errors(load_model("tiny-test").model, dump)) > 1e-3


def _fixed_batch(tok) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    rows, prompt_lens, masks = [], [], []
    for i in range(4):
        prompt = tok.encode(f"<|im_start|>user\nq{i}<|im_end|>\n<|im_start|>assistant\n")
        resp = torch.randint(0, 250, (4 + 3 * i,), generator=g).tolist()
        rows.append(prompt + resp)
        prompt_lens.append(len(prompt))
        masks.append([1] * len(resp))
    n = len(rows)
    return TrainBatch(
        uids=[f"u{i // 2}" for i in range(n)], traj_ids=[f"t{i}" for i in range(n)],
        parent_ids=[None] * n, splits=[None] * n, input_ids=pad_right(rows, tok.pad_token_id,
                                                                       torch.long),
        lengths=torch.tensor([len(r) for r in rows]), prompt_lens=torch.tensor(prompt_lens),
        loss_mask=pad_right(masks, 0, torch.float32), rewards=torch.zeros(n),
        advantages=pad_right(masks, 0, torch.float32))


def test_kl_against_disabled_adapter_equals_kl_against_a_frozen_copy(toy):
    cfg = toy_config(toy, "rollout.strategy=grpo", "trainer.total_steps=2",
                     "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", *LORA)
    trainer = RLTrainer(cfg, progress=False)
    assert trainer.ref_model is None  # no second copy of the weights
    history = trainer.fit()
    assert all(h["actor/kl"] >= 0 for h in history) and history[-1]["actor/kl"] > 0
    batch = _fixed_batch(trainer.tokenizer)
    ref = trainer.reference_logprobs(batch)
    frozen = load_model("tiny-test").model.eval().requires_grad_(False)  # the base weights
    ref_copy = trainer._logprobs(frozen, batch)
    assert torch.equal(ref, ref_copy)
    logp = trainer._logprobs(trainer.model, batch)
    mask = batch.loss_mask.bool()
    kl = KL_ESTIMATORS["low_var_kl"](logp, ref)[mask]  # per-token estimates [N]
    kl_copy = KL_ESTIMATORS["low_var_kl"](logp, ref_copy)[mask]
    assert torch.equal(kl, kl_copy) and float(kl.mean()) > 0
    # and the adapter is back on after the reference pass
    assert not torch.equal(trainer._logprobs(trainer.model, batch), ref)


def test_sft_trains_the_adapter_only_and_saves_adapter_and_merged(tmp_path):
    from types import SimpleNamespace

    from test_trainer_sft import _examples
    from transformers import AutoModelForCausalLM

    from appo.config import SFTConfig
    from appo.models.lora import apply_lora
    from appo.trainer.sft import evaluate_loss, train_sft

    lm = load_model("tiny-test")
    base = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    lora = apply_lora(lm.model, SimpleNamespace(lora_rank=8, lora_alpha=16.0, lora_dropout=0.0,
                                                target_modules=["q_proj", "v_proj", "down_proj"]))
    assert len(lora.layers) == 3 * 2  # three module kinds x two layers
    train = _examples(lm.tokenizer)
    pad = lm.tokenizer.pad_token_id
    before = evaluate_loss(lm.model, train, pad)
    params = SFTConfig(epochs=10, batch_size=4, lr=1e-2, warmup_ratio=0.0,
                       output_dir=str(tmp_path))
    res = train_sft(lm.model, lm.tokenizer, train, params, seed=0, val=train, progress=False,
                    lora=lora, save_merged=True)
    assert res.eval_loss < 0.9 * before
    for name, p in lm.model.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base[name.replace(".base_layer", "")]), name
    assert (res.checkpoint / "adapter_model.safetensors").is_file()
    merged = AutoModelForCausalLM.from_pretrained(res.checkpoint / "merged")
    assert abs(evaluate_loss(merged, train, pad) - res.eval_loss) < 1e-5


def test_tiny_demo_with_lora(tmp_path, monkeypatch):
    from appo.cli import main

    monkeypatch.chdir(tmp_path)
    rc = main([
        "demo", "model.path=tiny-test", "model.lora_rank=4", "model.lora_save_merged=true",
        "sft.max_steps=2", "sft.max_length=4096", "trainer.total_steps=1",
        "data.max_prompt_length=2048", "data.max_response_length=16",
        "eval.max_response_length=16", "data.val_files=[synth:arith?split=eval&levels=1&n=2]",
        "rollout.n=4", "rollout.initial_rollouts=2", "data.train_batch_size=2",
    ])
    assert rc == 0
    report = tmp_path / "runs" / "demo"
    summary = json.loads((report / "summary.json").read_text())
    assert [s["stage"] for s in summary["stages"]] == ["base", "sft", "rl"]
    for stage, step in (("sft", 2), ("rl", 1)):
        ckpt = report / stage / f"global_step_{step}"
        assert (ckpt / "adapter_config.json").is_file(), stage
        assert (ckpt / "merged" / "config.json").is_file(), stage


@pytest.mark.parametrize("overrides, message", [
    # refused when the config loads (appo.config_ranges), before apply_lora
    (["model.lora_rank=-1"], r"'model\.lora_rank': -1 \(must be >= 0"),
    (["model.lora_rank=4", "model.target_modules=[nope]"],
     "model.target_modules: 'nope' matches no module of the model"),
    (["model.lora_rank=4", "model.target_modules=[]"], "model.target_modules must be"),
    (["model.lora_rank=4", "model.lora_dropout=1.5"],
     r"'model\.lora_dropout': 1\.5 \(must be in \[0, 1\)"),
])
def test_bad_lora_keys_are_one_clear_error(overrides, message):
    from appo.config import load_config
    from appo.models.lora import apply_lora

    with pytest.raises(AppoError, match=message):
        apply_lora(load_model("tiny-test").model, load_config(overrides=overrides).model)


def test_target_modules_from_a_dotted_list_override():
    from appo.config import load_config
    from appo.models.lora import apply_lora

    cfg = load_config(overrides=["model.lora_rank=2", "model.target_modules=[q_proj,v_proj]"])
    lora = apply_lora(load_model("tiny-test").model, cfg.model)
    assert sorted({name.rsplit(".", 1)[1] for name in lora.layers}) == ["q_proj", "v_proj"]
    # The keys a resume checks against (no gather under FSDP) are the saved file's keys:
    # A and B of the 2 layers x 2 projections, nothing else.
    keys = lora.adapter_keys()
    assert keys == set(lora.adapter_state()) and len(keys) == 2 * 2 * 2


def test_engines_with_their_own_weights_get_the_merged_model_with_base_names(toy):
    # What the vllm engine and openai servers receive (`sync_weights(model)`, which hands
    # over `model.state_dict()`), checked on the hf engine given a recording sync_weights.
    cfg = toy_config(toy, "rollout.strategy=grpo", "trainer.total_steps=2", *LORA)
    trainer = RLTrainer(cfg, progress=False)
    synced: list[dict[str, torch.Tensor]] = []
    trainer.engine.sync_weights = lambda model: synced.append(
        {k: v.detach().clone() for k, v in model.state_dict().items()})
    trainer.fit()
    trainer.sync_rollout_weights()  # after the last update, as the next rollout would
    assert len(synced) == 3  # before step 1's rollout, after each of the two updates
    plain = load_model("tiny-test").model
    assert list(synced[-1]) == list(plain.state_dict())  # base names, nothing else
    plain.load_state_dict(synced[-1])
    ids = torch.tensor([list(range(5, 40))])
    with torch.no_grad():
        want = trainer.model(ids).logits
        assert torch.allclose(plain(ids).logits, want, atol=1e-5)
    assert not torch.equal(synced[0]["model.layers.0.mlp.down_proj.weight"],
                           synced[-1]["model.layers.0.mlp.down_proj.weight"])
