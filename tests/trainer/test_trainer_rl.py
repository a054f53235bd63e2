"""RL trainer on tiny-test: every strategy x loss runs, learning, resume, update invariants."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from appo.config import ActorConfig, load_config
from appo.models import load_model
from appo.trainer.batch import TrainBatch, compute_advantages, pad_right
from appo.trainer.loop import RLTrainer
from appo.trainer.update import update_policy

REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # Trivially learnable: the share of lowercase ASCII letters in the reply. A random
    # byte-level model starts near 26/269 and gradient ascent can raise it quickly.
    text = solution_str or ""
    return sum(c.islower() and c.isascii() for c in text) / max(len(text), 1)
'''


@pytest.fixture
def toy(tmp_path) -> dict[str, Path]:
    return make_toy(tmp_path)


def make_toy(tmp_path: Path) -> dict[str, Path]:
    """A 16-prompt JSONL dataset and a learnable reward file under `tmp_path`."""
    data = tmp_path / "toy.jsonl"
    with data.open("w") as f:
        for i in range(16):
            row = {"prompt": [{"role": "system", "content": "Be brief."},
                              {"role": "user", "content": f"q{i}?"}],
                   "answer": "7", "data_source": "toy", "ability": "math"}
            f.write(json.dumps(row) + "\n")
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    return {"data": data, "reward": reward, "dir": tmp_path}


def toy_config(toy, *overrides: str):
    return load_config(overrides=[
        "model.path=tiny-test",
        f"data.train_files=[{toy['data']}]",
        "data.val_files=[]",
        "data.train_batch_size=2",
        "data.max_response_length=16",
        f"custom_reward_function.path={toy['reward']}",
        "rollout.n=4",
        "rollout.initial_rollouts=2",
        "actor.ppo_mini_batch_size=2",
        "actor.optim.lr=1e-2",
        f"trainer.default_local_dir={toy['dir'] / 'run'}",
        "trainer.logger=[jsonl]",
        *overrides,
    ])


COMBOS = [
    (strategy, loss)
    for strategy in ("grpo", "arpo", "aepo", "appo")
    for loss in ("vanilla", "entropy_balanced", "future_kl")
]


@pytest.mark.parametrize("strategy, loss", COMBOS)
def test_two_steps_every_strategy_and_loss(toy, strategy, loss):
    extra = ["algorithm.adv_estimator=appo"] if strategy == "appo" else []
    if loss == "entropy_balanced":
        extra.append("actor.entropy_balanced_advantage=true")
    cfg = toy_config(toy, f"rollout.strategy={strategy}", f"actor.policy_loss={loss}",
                     "trainer.total_steps=2", *extra)
    before = [p.detach().clone() for p in load_model("tiny-test").model.parameters()]
    trainer = RLTrainer(cfg, progress=False)
    history = trainer.fit()
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert h["rollout/trajectories"] == 2 * 4  # every prompt filled to exactly n
        assert all(torch.isfinite(torch.tensor(v)) for v in h.values())
    changed = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(),
                                                           strict=True))
    assert changed
    assert (Path(cfg.trainer.default_local_dir) / "global_step_2" / "config.json").is_file()


def test_freeze_embeddings_keeps_the_tied_embeddings(toy):
    cfg = toy_config(toy, "rollout.strategy=grpo", "trainer.total_steps=1",
                     "actor.freeze_embeddings=true")
    trainer = RLTrainer(cfg, progress=False)
    emb = trainer.model.get_input_embeddings().weight.detach().clone()
    others = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
              if "embed" not in n}
    trainer.fit()
    assert torch.equal(trainer.model.get_input_embeddings().weight, emb)
    assert trainer.model.get_output_embeddings().weight is trainer.model.get_input_embeddings().weight
    params = dict(trainer.model.named_parameters())
    assert any(not torch.equal(params[n], p) for n, p in others.items())


def test_the_trainer_builds_its_adamw_from_actor_optim_fused(toy):
    # CPU: torch's fused AdamW unless the key says otherwise (appo.trainer.optim).
    assert RLTrainer(toy_config(toy), progress=False).optimizer.defaults["fused"] is True
    off = RLTrainer(toy_config(toy, "actor.optim.fused=false", "trainer.overwrite=true"),
                    progress=False)
    assert not off.optimizer.defaults["fused"]


def test_later_mini_batches_are_scored_against_the_behaviour_policy(toy):
    # Two prompts, one per mini-batch: the second optimizer step sees a policy the first one
    # moved, so its ratio must use log-probs computed before the update (verl's
    # old_log_prob). The detached current log-probs would give ratio 1 and ppo_kl exactly 0.
    cfg = toy_config(toy, "rollout.strategy=grpo", "actor.ppo_mini_batch_size=1",
                     "trainer.total_steps=1")
    [h] = RLTrainer(cfg, progress=False).fit()
    assert h["actor/optimizer_steps"] == 2
    assert "time/old_logp" in h
    assert h["actor/ppo_kl"] != 0.0


def test_reward_rises_on_learnable_behaviour(toy):
    cfg = toy_config(toy, "rollout.strategy=grpo", "rollout.n=8", "trainer.total_steps=10",
                     "actor.optim.lr=1e-2", "data.max_response_length=12")
    history = RLTrainer(cfg, progress=False).fit()
    rewards = [h["reward/mean"] for h in history]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards  # measured: about 0.27 -> 0.51


def test_resume_equals_uninterrupted(toy, tmp_path):
    from resume_check import straight_and_resumed

    runs = straight_and_resumed(toy, tmp_path, "rollout.strategy=arpo", "trainer.save_freq=2",
                                steps=4, resume_at=2)
    assert [h["step"] for h in runs.rest] == [3, 4]
    runs.assert_same_metrics(["reward/mean", "actor/pg_loss", "actor/grad_norm",
                              "rollout/tokens_decoded"])
    a_model = load_model(str(runs.a / "global_step_4")).model
    b_model = load_model(str(runs.b / "global_step_4")).model
    for pa, pb in zip(a_model.parameters(), b_model.parameters(), strict=True):
        assert torch.equal(pa, pb)


def _batch(input_ids, prompt_lens, loss_mask, advantages, uids, pad_id) -> TrainBatch:
    n = len(input_ids)
    return TrainBatch(
        uids=list(uids), traj_ids=[f"t{i}" for i in range(n)], parent_ids=[None] * n,
        splits=[None] * n, input_ids=pad_right(input_ids, pad_id, torch.long),
        lengths=torch.tensor([len(r) for r in input_ids]), prompt_lens=torch.tensor(prompt_lens),
        loss_mask=pad_right(loss_mask, 0, torch.float32), rewards=torch.zeros(n),
        advantages=pad_right(advantages, 0, torch.float32))


def _fixed_lists(tok, n=6) -> dict[str, list]:
    rows = {"input_ids": [], "prompt_lens": [], "loss_mask": [], "advantages": [], "uids": []}
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        prompt = tok.encode(f"<|im_start|>user\nq{i}<|im_end|>\n<|im_start|>assistant\n")
        resp = torch.randint(0, 250, (5 + 3 * i,), generator=g).tolist()
        mask = [1] * len(resp)
        if i % 2:
            mask[1:3] = [0, 0]  # a forced tool-result span
        rows["input_ids"].append(prompt + resp)
        rows["prompt_lens"].append(len(prompt))
        rows["loss_mask"].append(mask)
        rows["advantages"].append([1.0 if i % 3 else -0.5] * len(resp))
        rows["uids"].append(f"u{i // 2}")
    return rows


def _fixed_rows(tok, n=6) -> TrainBatch:
    return _batch(**_fixed_lists(tok, n), pad_id=tok.pad_token_id)


def test_token_budget_does_not_change_the_update():
    """Micro-batching by token budget is a memory knob only: same gradient, same step."""
    lm_a, lm_b = load_model("tiny-test"), load_model("tiny-test")
    rows = _fixed_rows(lm_a.tokenizer)
    results = []
    for lm, budget in ((lm_a, 100_000), (lm_b, 64)):
        opt = torch.optim.SGD(lm.model.parameters(), lr=0.1)
        actor = ActorConfig(ppo_mini_batch_size=16, ppo_max_token_len_per_device=budget)
        results.append(update_policy(lm.model, opt, rows, actor, max_response_length=384))
    assert results[1]["actor/padding_frac"] <= results[0]["actor/padding_frac"] + 1e-9
    assert results[0]["actor/grad_norm"] == pytest.approx(results[1]["actor/grad_norm"], rel=1e-5)
    for pa, pb in zip(lm_a.model.parameters(), lm_b.model.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6)


def test_rows_without_trainable_tokens_never_enter_the_loss():
    lm_a, lm_b = load_model("tiny-test"), load_model("tiny-test")
    pad = lm_a.tokenizer.pad_token_id
    rows = _fixed_lists(lm_a.tokenizer)
    with_branch = _fixed_lists(lm_a.tokenizer)
    # An APPO branch row: all loss_mask 0, huge advantage that would dominate if it leaked.
    with_branch["input_ids"].append(rows["input_ids"][0] + [5, 6, 7])
    with_branch["prompt_lens"].append(rows["prompt_lens"][0])
    with_branch["loss_mask"].append([0] * (len(rows["loss_mask"][0]) + 3))
    with_branch["advantages"].append([100.0] * (len(rows["loss_mask"][0]) + 3))
    with_branch["uids"].append("u0")
    actor = ActorConfig(ppo_mini_batch_size=16, loss_agg_mode="seq-mean-token-mean")
    for lm, r in ((lm_a, rows), (lm_b, with_branch)):
        update_policy(lm.model, torch.optim.SGD(lm.model.parameters(), lr=0.1),
                      _batch(**r, pad_id=pad), actor, max_response_length=384)
    for pa, pb in zip(lm_a.model.parameters(), lm_b.model.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-7)


def test_grpo_advantages_from_trajectories():
    from appo.algos import AdvantageParams
    from appo.rollout import Trajectory

    def traj(uid, tid, reward, mask):
        t = Trajectory(uid=uid, traj_id=tid, prompt_ids=[1], response_ids=[2] * len(mask),
                       loss_mask=mask, logp_rollout=[0.0] * len(mask), entropy=[0.0] * len(mask))
        t.reward = reward
        return t

    trajs = [traj("a", "a0", 1.0, [1, 0, 1]), traj("a", "a1", 0.0, [1, 1]),
             traj("b", "b0", 0.5, [1])]
    batch, _ = compute_advantages(TrainBatch.collate(trajs, 0), "grpo", AdvantageParams())
    adv = [batch.advantages[i, : len(t.response_ids)].tolist() for i, t in enumerate(trajs)]
    # group a: mean 0.5, unbiased std sqrt(0.5) -> +-0.7071; masked tokens get 0;
    # group b has one member: mean 0, std 1 -> 0.5 / (1 + 1e-6).
    assert adv[0] == pytest.approx([0.70710, 0.0, 0.70710], abs=1e-4)
    assert adv[1] == pytest.approx([-0.70710, -0.70710], abs=1e-4)
    assert adv[2] == pytest.approx([0.5 / (1 + 1e-6)], rel=1e-6)


def _accelerate_launch(*args: str, timeout: float = 300):
    from two_procs import accelerate_launch

    return accelerate_launch(*args, timeout=timeout)


@pytest.fixture(scope="module")
def two_process_updates(tmp_path_factory) -> dict[str, dict]:
    """ddp_update_worker.py's update under each layout, from one launch for both (a launch
    pays two interpreter starts and imports before any work)."""
    out = tmp_path_factory.mktemp("two_process_update") / "updates.pt"
    r = _accelerate_launch(str(Path(__file__).parent / "ddp_update_worker.py"), str(out),
                           str(Path(__file__).parent), "ddp,fsdp")
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_process_update_matches_single_process(two_process_updates, mode):
    dist = two_process_updates[mode]
    lm = load_model("tiny-test")
    rows = _fixed_rows(lm.tokenizer, n=8)
    start = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    # SGD as in the worker: the ranks sum in another order than one process, and AdamW's
    # first step would turn the rounding of a near-zero gradient into a step of ~lr.
    opt = torch.optim.SGD(lm.model.parameters(), lr=0.1)
    single = update_policy(lm.model, opt, rows, ActorConfig(ppo_mini_batch_size=4,
                                                             ppo_max_token_len_per_device=64),
                           max_response_length=384)
    assert dist["metrics"]["actor/grad_norm"] == pytest.approx(single["actor/grad_norm"], rel=1e-5)
    assert dist["metrics"]["actor/pg_loss"] == pytest.approx(single["actor/pg_loss"], abs=1e-6)
    params = dict(lm.model.named_parameters())
    assert set(params) <= set(dist["params"])
    assert max(float((p.detach() - start[n]).abs().max()) for n, p in params.items()) > 1e-3
    for name, p in params.items():
        assert torch.allclose(dist["params"][name], p, atol=1e-5), name


@pytest.mark.parametrize("parallel", [pytest.param(p, marks=pytest.mark.slow) for p in ("ddp", "fsdp")])
def test_two_process_training_run_completes(toy, parallel):
    run = toy["dir"] / f"{parallel}_run"
    args = ["-m", "appo.cli", "train", "model.path=tiny-test", f"data.train_files=[{toy['data']}]",
            "data.val_files=[]", "data.train_batch_size=2", "data.max_response_length=16",
            f"custom_reward_function.path={toy['reward']}", "rollout.strategy=arpo",
            "rollout.n=4", "rollout.initial_rollouts=2", "actor.ppo_mini_batch_size=2",
            f"trainer.default_local_dir={run}", "trainer.logger=[jsonl]",
            f"trainer.parallel={parallel}", "trainer.save_freq=2"]
    r = _accelerate_launch(*args, "trainer.total_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["rollout/trajectories"] == 8 for row in rows)  # gathered from both ranks
    assert (run / "global_step_2" / "config.json").is_file()
    # The checkpoint is a plain Hugging Face directory whatever the layout (FSDP gathers it).
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(run / "global_step_2")
    if parallel == "fsdp":  # resume from the gathered model and optimizer states
        r = _accelerate_launch(*args, "trainer.total_steps=3", "trainer.resume=true")
        assert r.returncode == 0, r.stderr[-3000:]
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [1, 2, 3]
