"""The critic of adv_estimator=gae: update invariants, values, checkpoint resume, learning."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from appo.config import load_config
from appo.models import load_model
from appo.trainer.batch import TrainBatch, pad_right
from appo.trainer.critic import Critic, ValueModel
from appo.trainer.loop import RLTrainer

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_rl import make_toy, toy_config  # noqa: E402

SYSTEM = "<|im_start|>system\nYou are a careful assistant. Be brief.<|im_end|>\n"


def fixed_critic_rows(tok, n: int = 8, branch_row: bool = False,
                      branches: bool = False) -> TrainBatch:
    """`n` rows in groups of two sharing a long prompt, tool spans in odd rows, fixed values
    and rewards; optionally an APPO branch row (all-zero mask) with extreme targets, and
    `branches`: ARPO-style branch rows (trained tokens) that repeat their parent's response
    up to a branch point, so the rows form a trie deeper than the shared prompt."""
    g = torch.Generator().manual_seed(0)
    ids, prompt_lens, masks, values, rewards, uids = [], [], [], [], [], []
    for i in range(n):
        prompt = tok.encode(f"{SYSTEM}<|im_start|>user\nq{i // 2}<|im_end|>\n"
                            "<|im_start|>assistant\n")
        resp = torch.randint(0, 250, (4 + 3 * i,), generator=g).tolist()
        mask = [1] * len(resp)
        if i % 2:
            mask[1:3] = [0, 0]
        ids.append(prompt + resp)
        prompt_lens.append(len(prompt))
        masks.append(mask)
        values.append(torch.randn(len(resp), generator=g).tolist())
        rewards.append(float(i % 3) / 2)
        uids.append(f"u{i // 2}")
    for parent in range(n - 2, n) if branches else ():  # the two longest rows
        cut = prompt_lens[parent] + len(masks[parent]) // 2
        tail = torch.randint(0, 250, (5,), generator=g).tolist()
        ids.append(ids[parent][:cut] + tail)
        prompt_lens.append(prompt_lens[parent])
        masks.append(masks[parent][: cut - prompt_lens[parent]] + [1] * len(tail))
        values.append(torch.randn(len(masks[-1]), generator=g).tolist())
        rewards.append(1.0)
        uids.append(uids[parent])
    if branch_row:
        ids.append(ids[0] + [5, 6, 7])
        prompt_lens.append(prompt_lens[0])
        masks.append([0] * (len(masks[0]) + 3))
        values.append([-50.0] * (len(masks[0]) + 3))
        rewards.append(100.0)
        uids.append("u0")
    m = len(ids)
    return TrainBatch(
        uids=uids, traj_ids=[f"t{i}" for i in range(m)], parent_ids=[None] * m,
        splits=[None] * m, input_ids=pad_right(ids, tok.pad_token_id, torch.long),
        lengths=torch.tensor([len(r) for r in ids]), prompt_lens=torch.tensor(prompt_lens),
        loss_mask=pad_right(masks, 0, torch.float32), rewards=torch.tensor(rewards),
        values=pad_right(values, 0.0, torch.float32))


def make_critic(*overrides: str, fsdp: bool = False) -> tuple[Critic, object]:
    cfg = load_config(overrides=["model.path=tiny-test", "algorithm.adv_estimator=gae",
                                 "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                                 "critic.optim.lr=1e-3", *overrides])
    lm = load_model("tiny-test")
    torch.manual_seed(0)  # the value head's initialisation
    return Critic.from_config(cfg, lm, total_steps=3, fsdp=fsdp), lm.tokenizer


def with_sgd(critic: Critic, lr: float = 0.1) -> Critic:
    """`critic` updated by plain SGD (constant `lr`) in place of AdamW, the gradients of each
    optimizer step recorded (after clipping) in `critic.step_grads`, for comparing updates
    whose sums run in different orders (micro-batch splits, forwards, ranks). Those agree to
    float32 rounding, and so do SGD's weights (a step of lr times the gradient); AdamW's
    first steps move an entry by ~lr whatever its gradient's size, so the rounding of a
    near-zero gradient becomes a full-lr step either way (issue 44: a comparison at
    atol=1e-6 after one AdamW step failed on an AVX-512 machine and passed on another)."""
    critic.optimizer = torch.optim.SGD(critic.params, lr=lr)
    critic.scheduler = torch.optim.lr_scheduler.LambdaLR(critic.optimizer, lambda _: 1.0)
    critic.step_grads = []
    critic.optimizer.register_step_pre_hook(lambda *_: critic.step_grads.append(
        [None if p.grad is None else p.grad.detach().clone() for p in critic.params]))
    return critic


def assert_same_grads(a: list[list[torch.Tensor | None]], b: list[list[torch.Tensor | None]],
                      rel: float = 2e-5) -> None:
    """Recorded step gradients (`with_sgd`) equal to float32 rounding: step for step, each
    entry within `rel` of its tensor's largest entry (measured on a Zen 3: 1.3e-6 at most)."""
    assert len(a) == len(b) > 0
    for step, (ga, gb) in enumerate(zip(a, b, strict=True)):
        assert len(ga) == len(gb)
        for k, (x, y) in enumerate(zip(ga, gb, strict=True)):
            assert (x is None) == (y is None), (step, k)
            if x is not None:
                err = float((x - y).abs().max())
                assert err <= rel * float(x.abs().max()), (step, k, err, float(x.abs().max()))


def test_critic_update_ignores_token_budget_and_branch_rows():
    """Micro-batching is a memory knob, and rows without a trained token never enter."""
    results = []
    for budget, branch in ((100_000, False), (48, False), (100_000, True)):
        critic, tok = make_critic(f"critic.ppo_max_token_len_per_device={budget}")
        with_sgd(critic)  # the gradients are the point; SGD keeps the weights comparable
        results.append((critic, critic.update(fixed_critic_rows(tok, branch_row=branch))))
    (ref, m_ref), *others = results
    assert m_ref["critic/vf_loss"] > 0
    assert len(ref.step_grads) == 2  # two mini-batches of two prompt groups
    start = make_critic()[0].model.parameters()
    assert max(float((a.detach() - b.detach()).abs().max()) for a, b in
               zip(ref.model.parameters(), start, strict=True)) > 1e-3  # the steps moved
    for critic, m in others:
        assert m["critic/grad_norm"] == pytest.approx(m_ref["critic/grad_norm"], rel=1e-5)
        assert m["critic/vf_loss"] == pytest.approx(m_ref["critic/vf_loss"], rel=1e-5)
        assert_same_grads(ref.step_grads, critic.step_grads)
        for pa, pb in zip(ref.model.parameters(), critic.model.parameters(), strict=True):
            assert torch.allclose(pa, pb, atol=1e-6)


def test_values_shared_prefix_equal_the_plain_forward_and_move_with_training():
    from appo.trainer.distributed import DataParallel

    critic, tok = make_critic()
    rows = fixed_critic_rows(tok)
    own = list(range(len(rows)))
    shared = critic.values(rows, own, DataParallel())
    critic.share_prefix = False
    plain = critic.values(rows, own, DataParallel())
    assert torch.allclose(shared, plain, atol=1e-5)
    real = torch.arange(shared.shape[1])[None, :] < rows.response_lens[:, None]
    assert torch.equal(shared[~real], torch.zeros(int((~real).sum())))
    # A few updates on fixed targets bring the values towards the returns: the loss falls.
    losses = [critic.update(rows)["critic/vf_loss"] for _ in range(5)]
    assert losses[-1] < losses[0], losses


def test_critic_with_the_tree_forward_equals_the_plain_forward(monkeypatch):
    """actor.tree_forward gives the critic's values and update the tree-shared forward (each
    shared prefix, branch points included, computed once): same values, same update."""
    from appo.trainer import forward
    from appo.trainer.distributed import DataParallel
    from appo.trainer.forward import plan_shared_microbatches

    tree_calls = []
    real_tree = forward.tree_hidden_states
    monkeypatch.setattr(forward, "tree_hidden_states",
                        lambda *a, **k: tree_calls.append(1) or real_tree(*a, **k))

    tree, tok = make_critic("actor.tree_forward=true")
    plain, _ = make_critic("actor.share_prefix_forward=false")
    with_sgd(tree), with_sgd(plain)  # the gradients are the point (see with_sgd)
    assert tree.tree and not plain.share_prefix
    rows = fixed_critic_rows(tok, branches=True)
    # The tree does share more than the common prompt here (the branches' parent tokens).
    args = (rows.input_ids, rows.lengths, 100_000, rows.uids, True)
    assert (plan_shared_microbatches(*args, tree=True).padded_tokens
            < plan_shared_microbatches(*args).padded_tokens)
    own = list(range(len(rows)))
    values = tree.values(rows, own, DataParallel())
    assert torch.allclose(values, plain.values(rows, own, DataParallel()), atol=1e-5)
    assert len(tree_calls) == 1  # one micro-batch, through the tree forward
    m_tree, m_plain = tree.update(rows), plain.update(rows)
    assert len(tree_calls) > 1
    assert m_tree["critic/vf_loss"] == pytest.approx(m_plain["critic/vf_loss"], rel=1e-5)
    assert m_tree["critic/grad_norm"] == pytest.approx(m_plain["critic/grad_norm"], rel=1e-5)
    assert_same_grads(plain.step_grads, tree.step_grads)
    for pa, pb in zip(tree.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.allclose(pa, pb, atol=1e-6)


def test_value_model_head_is_scalar_on_final_hidden_states():
    lm = load_model("tiny-test")
    model = ValueModel(lm.model)
    assert model.value_head.out_features == 1
    assert model.value_head.in_features == lm.model.config.hidden_size


@pytest.fixture
def toy(tmp_path):
    return make_toy(tmp_path)


def _critic_params(trainer: RLTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.critic.model.parameters()]


def test_resume_equals_uninterrupted_with_the_critic(toy, tmp_path):
    from resume_check import straight_and_resumed

    runs = straight_and_resumed(toy, tmp_path, "rollout.strategy=arpo",
                                "algorithm.adv_estimator=gae", "critic.optim.lr=1e-3")
    straight, resumed = runs.straight, runs.resumed
    assert (runs.b / "global_step_2" / "critic" / "model.safetensors").is_file()
    assert [h["step"] for h in runs.rest] == [3]
    runs.assert_same_metrics(["reward/mean", "actor/pg_loss", "critic/vf_loss",
                              "critic/grad_norm", "adv/values_mean"])
    for pa, pb in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    for pa, pb in zip(_critic_params(straight), _critic_params(resumed), strict=True):
        assert torch.equal(pa, pb)
    a_state = straight.critic.optimizer.state_dict()["state"]
    b_state = resumed.critic.optimizer.state_dict()["state"]
    assert a_state.keys() == b_state.keys()
    for key in a_state:
        assert torch.equal(a_state[key]["exp_avg_sq"], b_state[key]["exp_avg_sq"])


def test_gae_with_appo_branch_rows_trains_the_critic(toy):
    cfg = toy_config(toy, "rollout.strategy=appo", "algorithm.adv_estimator=gae",
                     "trainer.total_steps=1", "critic.optim.lr=1e-3")
    trainer = RLTrainer(cfg, progress=False)
    before = _critic_params(trainer)
    [h] = trainer.fit()
    assert h["critic/vf_loss"] > 0 and h["critic/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, _critic_params(trainer),
                                                     strict=True))


def test_reward_rises_with_gae_on_learnable_behaviour(toy):
    cfg = toy_config(toy, "rollout.strategy=grpo", "rollout.n=8", "trainer.total_steps=10",
                     "actor.optim.lr=1e-2", "data.max_response_length=12",
                     "algorithm.adv_estimator=gae", "critic.optim.lr=1e-3")
    history = RLTrainer(cfg, progress=False).fit()
    rewards = [h["reward/mean"] for h in history]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards  # measured: about 0.23 -> 0.41
    vf = [h["critic/vf_loss"] for h in history]
    assert sum(vf[-3:]) < sum(vf[:3]), vf  # the critic fits the returns (0.53 -> 0.12)


def test_two_process_critic_matches_single_process(tmp_path):
    from test_trainer_rl import _accelerate_launch

    from appo.trainer.distributed import DataParallel

    out = tmp_path / "critic.pt"
    r = _accelerate_launch(str(Path(__file__).parent / "ddp_critic_worker.py"), str(out),
                           str(Path(__file__).parent))
    assert r.returncode == 0, r.stderr[-3000:]
    dist = torch.load(out)
    critic, tok = make_critic("critic.ppo_max_token_len_per_device=48", "critic.ppo_epochs=2")
    with_sgd(critic)  # as the worker's
    rows = fixed_critic_rows(tok, n=8, branch_row=True)
    values = critic.values(rows, list(range(len(rows))), DataParallel())
    assert torch.allclose(dist["values"], values, atol=1e-5)
    single = critic.update(rows)
    assert len(critic.step_grads) == 4  # 2 epochs x 2 mini-batches
    assert single["critic/vf_loss"] == pytest.approx(
        dist["metrics"]["critic/vf_loss"], rel=1e-5)
    assert dist["metrics"]["critic/grad_norm"] == pytest.approx(single["critic/grad_norm"],
                                                                rel=1e-5)
    for name, p in critic.model.named_parameters():
        assert torch.allclose(dist["params"][name], p, atol=1e-5), name


def test_critic_from_another_model_spec_and_bad_inputs(tmp_path):
    from appo.errors import AppoError

    critic, _ = make_critic("critic.model.path=tiny-test")
    assert isinstance(critic.model.value_head, torch.nn.Linear)
    with pytest.raises(AppoError):
        make_critic(f"critic.model.path={tmp_path / 'no-such-model'}")
    with pytest.raises(AppoError, match="algorithm.lam"):
        load_config(overrides=["algorithm.lam=1.5"])
    with pytest.raises(AppoError, match="critic.cliprange_value"):
        load_config(overrides=["critic.cliprange_value=0"])


def test_two_process_gae_training_run_completes(toy):
    import json

    from test_trainer_rl import _accelerate_launch

    run = toy["dir"] / "ddp_gae"
    r = _accelerate_launch(
        "-m", "appo.cli", "train", "model.path=tiny-test", f"data.train_files=[{toy['data']}]",
        "data.val_files=[]", "data.train_batch_size=2", "data.max_response_length=16",
        f"custom_reward_function.path={toy['reward']}", "rollout.strategy=arpo", "rollout.n=4",
        "rollout.initial_rollouts=2", "actor.ppo_mini_batch_size=2",
        "algorithm.adv_estimator=gae", f"trainer.default_local_dir={run}",
        "trainer.logger=[jsonl]", "trainer.parallel=ddp", "trainer.total_steps=2")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["critic/vf_loss"] > 0 for row in rows)
    assert (run / "global_step_2" / "critic" / "model.safetensors").is_file()


def test_two_process_fsdp_actor_and_critic_match_single_process(tmp_path):
    """Under trainer.parallel=fsdp both the policy and the critic are sharded: one update of
    each equals the single-process one (as the DDP test), and the critic's checkpoint part
    (whole states gathered) loads into a fresh sharded critic that then updates identically."""
    from safetensors.torch import load_file
    from test_trainer_rl import _accelerate_launch, _fixed_rows

    from appo.config import ActorConfig
    from appo.trainer.distributed import DataParallel
    from appo.trainer.update import update_policy

    out = tmp_path / "fsdp_critic.pt"
    r = _accelerate_launch(str(Path(__file__).parent / "fsdp_critic_worker.py"), str(out),
                           str(Path(__file__).parent), str(tmp_path / "critic_part"))
    assert r.returncode == 0, r.stderr[-3000:]
    dist = torch.load(out)
    # The actor (as test_two_process_update_matches_single_process), under SGD as there.
    lm = load_model("tiny-test")
    opt = torch.optim.SGD(lm.model.parameters(), lr=0.1)
    single = update_policy(lm.model, opt, _fixed_rows(lm.tokenizer, n=8),
                           ActorConfig(ppo_mini_batch_size=4, ppo_max_token_len_per_device=64),
                           max_response_length=384)
    assert dist["actor_metrics"]["actor/grad_norm"] == pytest.approx(single["actor/grad_norm"],
                                                                     rel=1e-5)
    for name, p in lm.model.named_parameters():
        assert torch.allclose(dist["actor_params"][name], p, atol=1e-5), name
    # The critic: values, loss, grad norm and parameters (SGD, as the worker's).
    critic, tok = make_critic("critic.ppo_max_token_len_per_device=48", "critic.ppo_epochs=2")
    with_sgd(critic)
    rows = fixed_critic_rows(tok, n=8, branch_row=True)
    values = critic.values(rows, list(range(len(rows))), DataParallel())
    assert torch.allclose(dist["values"], values, atol=1e-5)
    m = critic.update(rows)
    assert dist["metrics"]["critic/vf_loss"] == pytest.approx(m["critic/vf_loss"], rel=1e-5)
    assert dist["metrics"]["critic/grad_norm"] == pytest.approx(m["critic/grad_norm"], rel=1e-5)
    for name, p in critic.model.named_parameters():
        assert torch.allclose(dist["params"][name], p, atol=1e-5), name
    # The round trip (a critic with its AdamW): the saved file holds the updated weights
    # (tied ones once), the loaded critic equals the saved one, and its next update equals
    # the original's bit for bit.
    saved = load_file(str(tmp_path / "critic_part" / "model.safetensors"))
    assert "backbone.lm_head.weight" not in saved  # tied to the embeddings
    assert dist["trained_params"].keys() == dist["params"].keys()
    assert not torch.equal(dist["trained_params"]["value_head.weight"],
                           make_critic()[0].model.value_head.weight)  # it was updated
    for name, t in dist["trained_params"].items():
        assert torch.equal(dist["loaded_params"][name], t), name
        if name in saved:
            assert torch.equal(saved[name], t), name
    (m_a, p_a), (m_b, p_b) = dist["after"], dist["after_loaded"]
    assert m_a == m_b
    for name, t in p_a.items():
        assert torch.equal(p_b[name], t), name
    assert not torch.equal(p_a["value_head.weight"], dist["trained_params"]["value_head.weight"])


@pytest.mark.slow
def test_two_process_fsdp_gae_resume_equals_uninterrupted(toy, tmp_path):
    """The trainer under FSDP with the critic: 2 steps + resume to 3 equals 3 straight (the
    checkpoint holds gathered whole states of both; resume loads them into the shards).
    Two launches: the straight and the 2-step run in one, the resume in a fresh one."""
    import json

    from safetensors.torch import load_file
    from two_procs import launch_runs

    def args(out, *extra):
        return ["train", "model.path=tiny-test",
                f"data.train_files=[{toy['data']}]", "data.val_files=[]",
                "data.train_batch_size=2", "data.max_response_length=16",
                f"custom_reward_function.path={toy['reward']}", "rollout.strategy=arpo",
                "rollout.n=4", "rollout.initial_rollouts=2", "actor.ppo_mini_batch_size=2",
                "algorithm.adv_estimator=gae", "critic.optim.lr=1e-3", "trainer.parallel=fsdp",
                f"trainer.default_local_dir={out}", "trainer.logger=[jsonl]", *extra]

    def metrics(out):
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    a, b = tmp_path / "a", tmp_path / "b"
    launch_runs([args(a, "trainer.total_steps=3"), args(b, "trainer.total_steps=2")], tmp_path)
    assert [row["step"] for row in metrics(b)] == [1, 2]  # stopped at 2, before the resume
    launch_runs([args(b, "trainer.total_steps=3", "trainer.resume=true")], tmp_path)
    straight, resumed = metrics(a), metrics(b)
    assert [row["step"] for row in resumed] == [1, 2, 3]
    for k in ["reward/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss",
              "critic/grad_norm", "adv/values_mean"]:
        assert straight[-1][k] == resumed[-1][k], (k, straight[-1][k], resumed[-1][k])
    for f in ["model.safetensors", "critic/model.safetensors"]:
        a, b = (load_file(str(tmp_path / d / "global_step_3" / f)) for d in "ab")
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (f, name)


def test_critic_runs_its_linears_through_onednn_when_asked(monkeypatch):
    """`actor.cpu_matmul=onednn` covers the critic: its values and its update's forward and
    backward go through `_OneDNNLinear`, with the values and step gradients of MKL's run to
    float32 rounding; outside its calls the modules are plain again."""
    from appo.trainer import cpu_linear
    from appo.trainer.cpu_linear import _OneDNNLinear
    from appo.trainer.distributed import DataParallel

    if not cpu_linear.available():
        pytest.skip("torch built without oneDNN")
    calls = []
    real = _OneDNNLinear.apply
    monkeypatch.setattr(_OneDNNLinear, "apply",
                        staticmethod(lambda *a: calls.append(1) or real(*a)))
    runs = {}
    for choice in ("torch", "onednn"):
        critic, tok = make_critic(f"actor.cpu_matmul={choice}")
        assert critic.onednn == (choice == "onednn")
        with_sgd(critic)
        rows = fixed_critic_rows(tok)
        before = len(calls)
        values = critic.values(rows, list(range(len(rows))), DataParallel())
        after_values = len(calls)
        critic.update(rows)
        runs[choice] = (values, critic.step_grads, after_values - before, len(calls) - after_values)
        assert not any("forward" in m.__dict__ for m in critic.model.modules()
                       if type(m) is torch.nn.Linear)
    assert runs["torch"][2:] == (0, 0)
    assert runs["onednn"][2] > 0 and runs["onednn"][3] > 0
    assert torch.allclose(runs["onednn"][0], runs["torch"][0], atol=1e-5)
    assert_same_grads(runs["torch"][1], runs["onednn"][1])
