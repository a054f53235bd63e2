"""torch's DistributedDataParallel is what sums gradients under `trainer.parallel=ddp`.

In one process, over a real one-rank gloo group (no launch): the wrapper is torch's DDP;
each optimizer step runs its micro-batches but the last under `no_sync()` and its all-reduces
(a recording comm hook) run in the last one's backward only; a rank with no micro-batch in a
mini-batch runs one empty synced pass; the update through DDP equals the plain one bit for
bit (one rank: DDP's x1 scale and /1 average are exact); the critic's untied LM head, which no
forward uses, is left out of DDP (otherwise its next step raises). The two-process equality
with one process: test_trainer_rl / test_trainer_critic / test_trainer_lora_parallel.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from appo.config import ActorConfig, load_config
from appo.models import load_model
from appo.trainer.distributed import DataParallel, GradSync
from appo.trainer.update import update_policy

sys.path.insert(0, str(Path(__file__).parent))
from test_trainer_critic import fixed_critic_rows, with_sgd  # noqa: E402
from test_trainer_rl import _batch, _fixed_lists, _fixed_rows  # noqa: E402


@pytest.fixture
def one_rank_group():
    """A real gloo process group of one rank in this process, taken down after the test."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DataParallel()
    finally:
        dist.destroy_process_group()


class Recorder:
    """Records, in order, each DDP forward (synced or under no_sync) and each bucket that
    DDP's reducer all-reduces (a comm hook doing what the default one does)."""

    def __init__(self, sync: GradSync):
        self.events: list[str] = []
        inner_no_sync = sync.ddp.no_sync

        @contextmanager
        def no_sync():
            self.events.append("no_sync")
            with inner_no_sync():
                yield

        sync.ddp.no_sync = no_sync
        sync.ddp.register_forward_pre_hook(lambda *_: self.events.append("forward"))

        def hook(_state, bucket):
            self.events.append("all_reduce")
            buf = bucket.buffer()
            buf.div_(dist.get_world_size())
            return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

        sync.ddp.register_comm_hook(None, hook)

    def steps(self) -> list[list[str]]:
        """Events grouped by DDP forward ('no_sync' joins the forward after it), the
        all-reduces of a backward after its forward."""
        out: list[list[str]] = []
        pending = False
        for e in self.events:
            if e == "no_sync":
                pending = True
            elif e == "forward":
                out.append(["no_sync"] if pending else ["sync"])
                pending = False
            else:
                out[-1].append(e)
        return out


def _actor(**kw) -> ActorConfig:
    # grads_in_place off in the plain run too, so both sum in the same order.
    return ActorConfig(**{"ppo_mini_batch_size": 2, "ppo_max_token_len_per_device": 64,
                          "grads_in_place": False, **kw})


def test_ddp_syncs_once_per_optimizer_step_and_equals_the_plain_update(one_rank_group):
    dp = one_rank_group
    plain, wrapped = load_model("tiny-test"), load_model("tiny-test")
    rows = _fixed_rows(plain.tokenizer, n=8)  # 4 groups: 2 mini-batches of 2 groups
    sync = GradSync(wrapped.model)
    assert type(sync.ddp) is torch.nn.parallel.DistributedDataParallel
    assert sync.ddp.module.model is wrapped.model  # the policy itself, not a copy
    rec = Recorder(sync)
    results = []
    for lm, ddp in ((plain, None), (wrapped, sync)):
        opt = torch.optim.SGD(lm.model.parameters(), lr=0.1)
        results.append(update_policy(lm.model, opt, rows, _actor(ppo_epochs=2),
                                     max_response_length=384, dp=dp, ddp=ddp))
    passes = rec.steps()
    synced = [p for p in passes if p[0] == "sync"]
    # One synced pass per optimizer step (2 epochs x 2 mini-batches), each all-reducing in its
    # backward; no all-reduce in any pass under no_sync.
    assert len(synced) == results[1]["actor/optimizer_steps"] == 4
    assert all(len(p) > 1 and set(p[1:]) == {"all_reduce"} for p in synced)
    assert all(p == ["no_sync"] for p in passes if p[0] == "no_sync")
    # Every step's micro-batches: all but the last under no_sync (the 64-token budget gives
    # several), the last synced.
    runs, current = [], 0
    for p in passes:
        current += 1
        if p[0] == "sync":
            runs.append(current)
            current = 0
    assert current == 0 and max(runs) > 1
    assert results[0]["actor/grad_norm"] == results[1]["actor/grad_norm"]
    start = load_model("tiny-test").model
    for (name, a), b in zip(plain.model.named_parameters(), wrapped.model.parameters(),
                            strict=True):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, b) for a, b in zip(plain.model.parameters(),
                                                     start.parameters(), strict=True))


def test_a_mini_batch_without_rows_here_still_syncs_once(one_rank_group):
    """Group u1 has no trained token: its mini-batch has no micro-batch on this rank, which
    then runs one empty synced pass (other ranks would be waiting in their all-reduces)."""
    lm = load_model("tiny-test")
    lists = _fixed_lists(lm.tokenizer, n=6)
    for i in (2, 3):  # group u1
        lists["loss_mask"][i] = [0] * len(lists["loss_mask"][i])
    rows = _batch(**lists, pad_id=lm.tokenizer.pad_token_id)
    sync = GradSync(lm.model)
    rec = Recorder(sync)
    before = {n: p.detach().clone() for n, p in lm.model.named_parameters()}
    out = update_policy(lm.model, torch.optim.SGD(lm.model.parameters(), lr=0.1), rows,
                        _actor(ppo_mini_batch_size=1), max_response_length=384,
                        dp=one_rank_group, ddp=sync)
    synced = [p for p in rec.steps() if p[0] == "sync"]
    assert len(synced) == out["actor/optimizer_steps"] == 3
    assert all("all_reduce" in p for p in synced)
    assert any(not torch.equal(p, before[n]) for n, p in lm.model.named_parameters())


def test_several_processes_without_a_wrapper_are_refused():
    from appo.errors import AppoError

    dp = DataParallel.__new__(DataParallel)
    dp.enabled, dp.rank, dp.world = True, 0, 2
    lm = load_model("tiny-test")
    with pytest.raises(AppoError, match="DistributedDataParallel"):
        update_policy(lm.model, torch.optim.SGD(lm.model.parameters(), lr=0.1),
                      _fixed_rows(lm.tokenizer), _actor(), max_response_length=384, dp=dp)


def test_gradient_checkpointing_under_ddp_equals_the_plain_update(one_rank_group):
    """Checkpointed blocks (non-reentrant, as the trainer enables them) under DDP."""
    plain, wrapped = load_model("tiny-test"), load_model("tiny-test")
    rows = _fixed_rows(plain.tokenizer, n=4)
    for lm in (plain, wrapped):
        lm.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    sync = GradSync(wrapped.model)
    for lm, ddp in ((plain, None), (wrapped, sync)):
        update_policy(lm.model, torch.optim.SGD(lm.model.parameters(), lr=0.1), rows,
                      _actor(ppo_epochs=2), max_response_length=384, dp=one_rank_group,
                      ddp=ddp)
    for a, b in zip(plain.model.parameters(), wrapped.model.parameters(), strict=True):
        assert torch.equal(a, b)


def _untied_critic():
    from transformers import LlamaForCausalLM

    from appo.models.tiny import tiny_config
    from appo.trainer.critic import Critic, ValueModel

    lm = load_model("tiny-test")
    config = tiny_config(lm.model.config.vocab_size)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    backbone = LlamaForCausalLM(config)
    cfg = load_config(overrides=["model.path=tiny-test", "algorithm.adv_estimator=gae",
                                 "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
                                 "critic.ppo_max_token_len_per_device=48"])
    return Critic(ValueModel(backbone), cfg, total_steps=3), lm.tokenizer


def test_the_critic_syncs_through_ddp_without_its_unused_head(one_rank_group):
    critic, tok = _untied_critic()
    head = critic.model.backbone.get_output_embeddings().weight
    assert critic.model.unused_parameters() == [head]
    assert type(critic.sync.ddp) is torch.nn.parallel.DistributedDataParallel
    rec = Recorder(critic.sync)
    with_sgd(critic)
    rows = fixed_critic_rows(tok, n=8, branch_row=True)
    for _ in range(2):  # DDP raises at a step after one whose parameters were not all reduced
        critic.update(rows, one_rank_group)
    assert len([p for p in rec.steps() if p[0] == "sync"]) == len(critic.step_grads) == 4
    assert head.grad is None


def test_the_head_left_out_is_what_keeps_the_critic_running(one_rank_group):
    """Without the ignore list (the head registered with DDP) the same updates fail: the
    test above would catch a critic that stopped leaving it out."""
    critic, tok = _untied_critic()
    critic.sync = GradSync(critic.model)
    with_sgd(critic)
    rows = fixed_critic_rows(tok, n=8, branch_row=True)
    with pytest.raises(RuntimeError, match="reduction"):
        for _ in range(2):
            critic.update(rows, one_rank_group)
