"""actor.max_memory_gb / activation_memory_gb: the update's token budget from memory
(appo.trainer.memory)."""

from __future__ import annotations

import pytest
import torch
from test_trainer_rl import make_toy, toy_config

from appo.errors import AppoError
from appo.models import load_model
from appo.trainer import memory
from appo.trainer.loop import RLTrainer


@pytest.fixture
def toy(tmp_path):
    return make_toy(tmp_path)


def _ids(rows: int, tokens: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(seed))


def test_probe_extrapolates_to_other_shapes():
    """The probe (2 rows x 64 / 128 tokens) gives bytes per token; a forward of another shape
    must save about per_token x tokens (+ the probe's fixed cost). If something saved grew
    faster than the tokens (an attention matrix, T^2), the 4 x 300 forward would be far off."""
    model = load_model("tiny-test").model
    vocab = model.get_input_embeddings().weight.shape[0]
    per_token = memory.activation_bytes_per_token(model)
    fixed = memory.saved_bytes(model, _ids(2, 64, vocab), torch.full((2,), 64)) - per_token * 128
    for rows, tokens in ((1, 200), (4, 300), (3, 97)):
        saved = memory.saved_bytes(model, _ids(rows, tokens, vocab), torch.full((rows,), tokens))
        predicted = per_token * rows * tokens + fixed
        assert abs(saved - predicted) <= 0.05 * saved, (rows, tokens, saved, predicted)


def test_saved_bytes_exclude_parameters():
    model = load_model("tiny-test").model
    vocab = model.get_input_embeddings().weight.shape[0]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    one = memory.saved_bytes(model, _ids(1, 8, vocab), torch.full((1,), 8))
    # 8 tokens of a 2-layer, 64-wide model save a few KB; the weights alone are ~0.4 MB.
    assert 0 < one < params / 4


def test_counting_saved_bytes_frees_the_graph():
    """The probe's graph dies with it. Its pack hook once returned the tensor itself, a
    cycle through the C++ graph that gc cannot break: every probe kept all its activations
    for the rest of the run (~500 MB on SmolLM2). A forward hook holds weak references to
    layer outputs (which autograd saves for the next layer); all must be dead afterwards."""
    import gc
    import weakref

    model = load_model("tiny-test").model.train()
    refs = []
    hooks = [layer.register_forward_hook(
        lambda _m, _i, out: refs.append(weakref.ref(out[0] if isinstance(out, tuple) else out)))
        for layer in model.model.layers]
    vocab = model.get_input_embeddings().weight.shape[0]
    assert memory.saved_bytes(model, _ids(2, 16, vocab), torch.full((2,), 16)) > 0
    for h in hooks:
        h.remove()
    gc.collect()
    assert len(refs) == 2 and all(r() is None for r in refs)


def test_trainer_sets_the_mmap_threshold(toy, monkeypatch):
    """`trainer.mmap_threshold_kb` and its scope reach glibc's mallopt (null by default:
    glibc's own dynamic threshold; the demo sets 128)."""
    calls, real = [], memory.set_mmap_threshold
    monkeypatch.setattr(memory, "set_mmap_threshold",
                        lambda kb, scope="process": calls.append((kb, scope)) or True)
    RLTrainer(toy_config(toy)).tools.close()
    RLTrainer(toy_config(toy, "trainer.mmap_threshold_kb=128",
                         "trainer.overwrite=true")).tools.close()
    RLTrainer(toy_config(toy, "trainer.mmap_threshold_kb=64", "trainer.overwrite=true",
                         "trainer.mmap_threshold_scope=except_forward")).tools.close()
    assert calls == [(None, "process"), (128, "process"), (64, "except_forward")]
    if memory._libc() is not None:  # glibc accepts the setting
        assert real(128) is True
    assert real(None) is False


class _RecordingLibc:
    """glibc's mallopt / malloc_trim, recorded instead of applied."""

    def __init__(self):
        self.threshold: int | None = None
        self.calls: list[int] = []

    def mallopt(self, param: int, value: int) -> int:
        assert param == memory.M_MMAP_THRESHOLD
        self.threshold = value
        self.calls.append(value)
        return 1

    def malloc_trim(self, pad: int) -> int:
        return 1


@pytest.mark.parametrize("scope", ["process", "except_forward"])
def test_mmap_threshold_scope_in_the_update(toy, monkeypatch, scope):
    """Scope `except_forward`: every forward of the update runs with the heap's 32 MB and
    everything else (rollout, backward passes, optimizer) with the small threshold; scope
    `process`: the small threshold throughout, set once."""
    libc = _RecordingLibc()
    monkeypatch.setattr(memory, "_libc", lambda: libc)
    at_backward: list[int | None] = []
    real_backward = torch.autograd.backward

    def recording_backward(*args, **kwargs):
        at_backward.append(libc.threshold)
        return real_backward(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "backward", recording_backward)
    trainer = RLTrainer(toy_config(toy, "trainer.mmap_threshold_kb=64",
                                   f"trainer.mmap_threshold_scope={scope}",
                                   "actor.ppo_max_token_len_per_device=40"))
    at_forward: list[int | None] = []
    trainer.model.register_forward_pre_hook(
        lambda *_: at_forward.append(libc.threshold) if torch.is_grad_enabled() else None)
    start = list(libc.calls)
    trainer.step = 1
    trainer.train_step()
    trainer.tools.close()
    small, heap = 64 * 1024, memory.HEAP_MMAP_THRESHOLD
    assert start == [small] and len(at_backward) >= 2  # several micro-batches (40 tokens)
    assert set(at_backward) == {small} and libc.threshold == small
    if scope == "process":
        assert libc.calls == [small] and set(at_forward) == {small}
    else:
        assert set(at_forward) == {heap}
        assert libc.calls == [small] + [heap, small] * len(at_backward)


def test_pending_optimizer_bytes_by_hand():
    """Before the first step: one gradient and two AdamW moments per trainable float32
    element (4 bytes each); after it, all three exist and nothing is pending."""
    model = load_model("tiny-test").model
    model.get_input_embeddings().requires_grad_(False)  # tied head: frozen too
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    assert memory.pending_optimizer_bytes(model, opt) == 3 * 4 * trainable
    vocab = model.get_input_embeddings().weight.shape[0]
    out = model(input_ids=_ids(1, 8, vocab)).logits.sum()
    out.backward()
    opt.step()
    assert memory.pending_optimizer_bytes(model, opt) == 0


def test_budget_moves_with_the_target(monkeypatch):
    """With the resident size pinned, one more GB of target buys (1 - MARGIN) GiB of
    activations: Δtokens = 0.7 * 2^30 / per_token (to rounding)."""
    model = load_model("tiny-test").model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monkeypatch.setattr(memory, "rss_bytes", lambda: 1 * memory.GIB)
    t2, info = memory.token_budget(2.0, model, opt)
    t3, _ = memory.token_budget(3.0, model, opt)
    per_token = info["mb_per_token"] * 2**20
    assert abs((t3 - t2) - (1 - memory.MARGIN) * memory.GIB / per_token) <= 1
    # Below what the process already holds: no room at all.
    with pytest.raises(AppoError, match="actor.max_memory_gb=0.9 leaves no room"):
        memory.token_budget(0.9, model, opt)


def test_trainer_derives_the_budget_and_trains(toy, capsys):
    cfg = toy_config(toy, "actor.max_memory_gb=64", "trainer.total_steps=1")
    trainer = RLTrainer(cfg, progress=False)
    budget = trainer.cfg.actor.ppo_max_token_len_per_device
    assert budget != 4096 and budget > 10_000  # 64 GB for a 2-layer model: a large budget
    assert f"micro-batches of up to {budget} tokens" in capsys.readouterr().out
    metrics = trainer.train_step()
    assert metrics["time/update"] > 0
    trainer.tools.close()


def test_activation_share_caps_the_token_budget(toy, capsys):
    """Default on CPU: `actor.activation_memory_gb` caps the budget at
    g * 2^30 * (1 - MARGIN) / per_token tokens; a budget already below the cap, or null,
    leaves it alone. tiny-test saves a few KB per token, so 1e-3 GB caps 4096 well below."""
    trainer = RLTrainer(toy_config(toy, "actor.activation_memory_gb=0.001"), progress=False)
    # Measured on the trainer's model (lean MLP and SDPA's GQA applied: fewer saved bytes).
    per_token = memory.activation_bytes_per_token(trainer.model)
    expected = int(1e-3 * memory.GIB * (1 - memory.MARGIN) // per_token)
    assert 64 < expected < 4096
    # Independent of the probe's extrapolation: one row of `expected` tokens saves at most
    # the share (the cap keeps 1 - MARGIN of it), one of twice as many more than it.
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    for tokens, fits in ((expected, True), (2 * expected, False)):
        saved = memory.saved_bytes(trainer.model, _ids(1, tokens, vocab), torch.full((1,), tokens))
        assert (saved <= 1e-3 * memory.GIB) == fits, (tokens, saved)
    assert trainer.cfg.actor.ppo_max_token_len_per_device == expected
    assert f"micro-batches of up to {expected} tokens instead of 4096" in capsys.readouterr().out
    trainer.tools.close()
    for over in ("actor.activation_memory_gb=null", f"actor.ppo_max_token_len_per_device={expected // 2}"):
        trainer = RLTrainer(toy_config(toy, "actor.activation_memory_gb=0.001", over,
                                       "trainer.overwrite=true"),
                            progress=False)
        want = 4096 if "null" in over else expected // 2
        assert trainer.cfg.actor.ppo_max_token_len_per_device == want, over
        trainer.tools.close()


def test_probe_leaves_the_global_random_stream_alone():
    model = load_model("tiny-test").model
    torch.manual_seed(3)
    before = torch.rand(4)
    torch.manual_seed(3)
    memory.activation_bytes_per_token(model)
    assert torch.equal(torch.rand(4), before)


def test_bad_target_is_one_line(toy):
    with pytest.raises(AppoError, match="actor.max_memory_gb.*must be > 0"):
        toy_config(toy, "actor.max_memory_gb=0")
    with pytest.raises(AppoError, match="actor.activation_memory_gb.*must be > 0"):
        toy_config(toy, "actor.activation_memory_gb=-1")
    cfg = toy_config(toy, "actor.max_memory_gb=0.01")
    with pytest.raises(AppoError, match="leaves no room for the update"):
        RLTrainer(cfg, progress=False)


def _loss_and_grads_of_both(plain, lean):
    """(ids, lengths, [(loss, {name: grad}) for plain, lean]) of one float64 forward +
    backward of 3 rows of different lengths through `final_hidden_states`."""
    from appo.trainer.forward import final_hidden_states

    vocab = plain.get_input_embeddings().weight.shape[0]
    ids, lengths = _ids(3, 40, vocab), torch.tensor([40, 33, 17])
    results = []
    for model in (plain, lean):
        hidden = final_hidden_states(model, ids, lengths)
        loss = (hidden.sin() * torch.linspace(-1, 1, hidden.shape[-1],
                                              dtype=torch.float64)).sum()
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                        if p.requires_grad}))
    return ids, lengths, results


def test_lean_mlp_same_values_and_gradients_fewer_saved_bytes():
    """float64: the lean SwiGLU path gives the module path's loss and every gradient (to
    rounding), and saves exactly two `[tokens, I]` tensors less per layer: silu(gate) and
    the product, 2 x 128 (intermediate) x 8 bytes x 2 layers = 4096 bytes per token."""
    import copy

    plain = load_model("tiny-test").model.to(torch.float64).train()
    lean = copy.deepcopy(plain)
    assert memory.lean_mlp_activations(lean) == 2
    ids, _, results = _loss_and_grads_of_both(plain, lean)
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-12, atol=0)
    assert results[0][1].keys() == results[1][1].keys()
    for name, grad in results[0][1].items():
        assert torch.allclose(grad, results[1][1][name], rtol=1e-10, atol=1e-12), name
    saved = [memory.saved_bytes(m, ids, torch.full((3,), 40)) for m in (plain, lean)]
    assert saved[0] - saved[1] == 3 * 40 * 4096


def test_lean_mlp_with_lora_same_values_and_gradients_fewer_saved_bytes():
    """A LoRA adapter on every linear (PEFT, what `model.lora_rank` builds): the lean path
    computes down_proj's LoRA term itself. float64: the loss and every adapter gradient equal
    PEFT's module path (to rounding; B is set non-zero so A's gradient is not trivially 0);
    saved bytes lower by silu(gate) and the product h, whose second copy PEFT's lora_A
    input was: 2 x 128 (intermediate) x 8 bytes x 2 layers = 4096 bytes per token, while the
    `[tokens, r]` lora_A(h) is saved either way. With dropout on, the module's own path."""
    import copy

    from omegaconf import OmegaConf

    from appo.models.lora import apply_lora

    cfg = OmegaConf.create({"lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0,
                            "target_modules": "all-linear", "path": ""})
    torch.manual_seed(0)
    plain = apply_lora(load_model("tiny-test").model.to(torch.float64), cfg).model.train()
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    lean = copy.deepcopy(plain)
    assert memory.lean_mlp_activations(lean) == 2
    ids, _, results = _loss_and_grads_of_both(plain, lean)
    assert torch.allclose(results[0][0], results[1][0], rtol=1e-12, atol=0)
    assert results[0][1].keys() == results[1][1].keys()
    assert any("mlp.down_proj.lora_A" in n for n in results[0][1])
    for name, grad in results[0][1].items():
        assert grad.abs().sum() > 0, name
        assert torch.allclose(grad, results[1][1][name], rtol=1e-10, atol=1e-12), name
    saved = [memory.saved_bytes(m, ids, torch.full((3,), 40)) for m in (plain, lean)]
    assert saved[0] - saved[1] == 3 * 40 * 4096
    # lora_dropout > 0: PEFT's dropout must run, so the module's own path.
    mlp = lean.model.layers[0].mlp
    mlp.down_proj.lora_dropout["default"] = torch.nn.Dropout(0.1)
    out = mlp(torch.randn(2, 5, 64, dtype=torch.float64))
    assert "SwiGLU" not in type(out.grad_fn).__name__


def test_lean_mlp_leaves_no_grad_and_wrapped_projections_alone():
    model = load_model("tiny-test").model
    memory.lean_mlp_activations(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, 64)
    with torch.no_grad():  # the module's own path: no custom Function in the graph anyway
        ref = type(mlp).forward(mlp, x)
        assert torch.equal(mlp(x), ref)
    mlp.down_proj = torch.nn.Sequential(mlp.down_proj)  # e.g. a LoRA wrapper: not plain
    out = mlp(x.requires_grad_())
    assert out.grad_fn is not None and "SwiGLU" not in type(out.grad_fn).__name__


def test_evaluation_runs_in_chunks_of_val_batch_size(toy):
    """16 held-out prompts with data.val_batch_size=5: four rollouts of 5, 5, 5, 1 prompts
    (one chunk's KV cache at a time), distinct uids, every example answered once and each
    trajectory paired with the example it answers."""
    cfg = toy_config(toy, f"data.val_files=[{toy['data']}]", "data.val_batch_size=5",
                     "eval.max_response_length=4")
    trainer = RLTrainer(cfg, progress=False)
    sizes, real = [], trainer.rollout

    def spy(examples, tag, seed, **kw):
        sizes.append(len(examples))
        return real(examples, tag, seed, **kw)

    trainer.rollout = spy
    ev = trainer.evaluate(trainer.val_data, "val", 3, n=1)
    trainer.tools.close()
    assert sizes == [5, 5, 5, 1]
    assert len({t.uid for t in ev.trajectories}) == 16
    assert sorted(id(e) for e in ev.examples) == sorted(id(e) for e in trainer.val_data)
    for t, ex in zip(ev.trajectories, ev.examples, strict=True):
        assert t.prompt_ids == trainer._prompt_ids(ex)


def test_sdpa_gqa_same_forward_gradients_to_rounding_fewer_saved_bytes(tmp_path):
    """`actor.sdpa_gqa`: tiny-test has 4 query heads over 2 key/value heads. Under a mask
    (padded rows; the shared-prefix forward's 4D mask) transformers expands K/V to 4 heads;
    SDPA's `enable_gqa` reads the 2 heads as they are. The forward is bitwise the same
    (float32, both forwards); gradients differ only by summation order (SDPA sums the group's
    key/value gradients inside its kernel), checked in float64. Only the switched model
    changes: the original, and a checkpoint's config, stay on transformers' `sdpa`."""
    import copy

    from appo.models.sdpa_gqa import GQA_SDPA, use_sdpa_gqa
    from appo.trainer.forward import final_hidden_states

    base = load_model("tiny-test").model.train()
    gqa = copy.deepcopy(base)
    assert use_sdpa_gqa(gqa) and gqa.config._attn_implementation == GQA_SDPA
    assert base.config._attn_implementation == "sdpa"
    vocab = base.get_input_embeddings().weight.shape[0]
    ids, lengths = _ids(4, 40, vocab), torch.tensor([40, 33, 27, 38])
    ids[:, :20] = ids[0, :20]  # a 20-token common prefix: the shared-prefix forward runs
    for share in (False, True):
        with torch.no_grad():
            a, b = (final_hidden_states(m, ids, lengths, share_prefix=share) for m in (base, gqa))
        assert torch.equal(a, b), share
    weights = torch.linspace(-1, 1, 64, dtype=torch.float64)
    real = (torch.arange(40)[None] < lengths[:, None])[..., None]
    for share in (False, True):
        grads = []
        for model in (base, gqa):
            model.to(torch.float64).zero_grad()
            hidden = final_hidden_states(model, ids, lengths, share_prefix=share)
            (hidden.sin() * weights * real).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for g0, g1 in zip(*grads, strict=True):
            assert torch.allclose(g0, g1, rtol=1e-10, atol=1e-12)
    # Saved for the backward: per layer, the expanded keys and values (2 x 4 heads x 16)
    # against the 2 heads' own, which autograd keeps anyway: 2 x 2 x 16 x 8 bytes (float64)
    # per token and layer less, x 2 layers x 160 padded tokens.
    saved = [memory.saved_bytes(m, ids, lengths) for m in (base, gqa)]
    assert saved[0] - saved[1] == 2 * 2 * 16 * 8 * 2 * 160
    gqa.save_pretrained(tmp_path)
    assert GQA_SDPA not in (tmp_path / "config.json").read_text()


def test_sdpa_gqa_leaves_models_without_key_value_groups_alone():
    from transformers import LlamaConfig, LlamaForCausalLM

    from appo.models.sdpa_gqa import use_sdpa_gqa

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    assert not use_sdpa_gqa(model) and model.config._attn_implementation == "sdpa"


def test_critic_follows_the_capped_budget_and_resume_does_not_flag_it(toy):
    """gae: the critic (no budget of its own) gets the actor's capped budget. The saved
    config holds the derived budget, a new run's config the key's own value: not a change
    to report on resume while a memory option derives it."""
    from appo.trainer.checkpoint import config_changes

    trainer = RLTrainer(toy_config(toy, "actor.activation_memory_gb=0.001",
                                   "algorithm.adv_estimator=gae"), progress=False)
    assert trainer.critic.max_tokens == trainer.cfg.actor.ppo_max_token_len_per_device < 4096
    trainer.tools.close()
    saved = {"actor": {"activation_memory_gb": 1.25, "ppo_max_token_len_per_device": 962}}
    new = {"actor": {"activation_memory_gb": 1.25, "ppo_max_token_len_per_device": 4096}}
    assert config_changes(saved, new) == []
    for cfg in (saved, new):
        cfg["actor"]["activation_memory_gb"] = None
    assert config_changes(saved, new) == ["actor.ppo_max_token_len_per_device 962 -> 4096"]


def test_under_fsdp_the_cap_is_skipped_and_a_target_refused():
    """The probe cannot run on a sharded model: the budget stays as given, and a memory
    target is one clear line (the trainer passes fsdp=True after sharding)."""
    from appo.config_schema import ActorConfig
    from appo.trainer.distributed import DataParallel

    model = load_model("tiny-test").model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    actor = ActorConfig(ppo_max_token_len_per_device=4096, activation_memory_gb=1e-6)
    assert memory.apply_memory_target(actor, model, opt, DataParallel(), fsdp=True) == 4096
    assert memory.apply_memory_target(actor, model, opt, DataParallel()) < 4096  # off FSDP
    actor = ActorConfig(max_memory_gb=3.0)
    with pytest.raises(AppoError, match="max_memory_gb is not supported with trainer.paral"):
        memory.apply_memory_target(actor, model, opt, DataParallel(), fsdp=True)


def test_gradients_allocated_before_the_first_micro_batch_change_no_value(monkeypatch):
    """`update_policy` allocates the gradients (zeros) before its first micro-batch, so they
    do not land between freed activations (`zero_grads_first`, a heap-layout matter). One
    mini-batch of several (7) micro-batches: the weights after the update equal bit for bit
    those of the old path, where the first backward allocated them (0 + g == g)."""
    from test_trainer_rl import _fixed_rows

    from appo.config import ActorConfig
    from appo.trainer import update

    def run():
        lm = load_model("tiny-test")
        opt = torch.optim.AdamW(lm.model.parameters(), lr=1e-3)
        m = update.update_policy(lm.model, opt, _fixed_rows(lm.tokenizer, n=8),
                                 ActorConfig(ppo_mini_batch_size=4,
                                             ppo_max_token_len_per_device=64),
                                 max_response_length=384)
        return m, {n: p.detach().clone() for n, p in lm.model.named_parameters()}

    new_metrics, new = run()
    monkeypatch.setattr(update, "zero_grads_first",
                        lambda params: [setattr(p, "grad", None) for p in params])
    old_metrics, old = run()
    assert new_metrics["actor/grad_norm"] == old_metrics["actor/grad_norm"]
    initial = load_model("tiny-test").model.state_dict()
    assert any(not torch.equal(new[n], initial[n]) for n in new)  # the update moved weights
    for name in new:
        assert torch.equal(new[name], old[name]), name


def _vocab_sized_outputs(run):
    """Shapes `[V, D]` of tensors that ops (not in-place ones) create while `run()` runs:
    the gradient temporaries `actor.grads_in_place` removes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    created = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func._schema.name
            if not name.endswith("_") and not name.startswith("aten::copy"):
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                        created.append((name, tuple(t.shape)))
            return out

    with Record():
        result = run()
    return result, created


@pytest.mark.parametrize("tied", [True, False])
def test_grads_in_place_same_gradients_no_vocab_sized_temporary(tied):
    """`actor.grads_in_place` (the LM head adds its weight gradient into `.grad`, the
    embedding hands back sparse rows): the gradients equal autograd's usual ones to
    rounding (float64, summed in another order), over a mini-batch of several micro-batches
    and with the head tied to the embeddings or not; and while the update runs no op
    creates a `[V, D]` tensor, which the usual path does (the control: the embedding's dense
    gradient and, tied, the head's held until the end of the backward)."""
    from test_trainer_rl import _fixed_rows

    from appo.config import ActorConfig
    from appo.trainer import update

    def run(in_place):
        lm = load_model("tiny-test")
        model = lm.model.double()
        if not tied:
            model.config.tie_word_embeddings = False
            head = model.get_output_embeddings()
            head.weight = torch.nn.Parameter(head.weight.detach().clone() * 1.5)
        assert (model.get_output_embeddings().weight is
                model.get_input_embeddings().weight) == tied
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the gradients stay to compare
        actor = ActorConfig(ppo_mini_batch_size=4, ppo_max_token_len_per_device=64,
                            grads_in_place=in_place)
        rows = _fixed_rows(lm.tokenizer, n=8)
        update.zero_grads_first(list(model.parameters()))  # allocated, as after a first step
        metrics, created = _vocab_sized_outputs(
            lambda: update.update_policy(model, opt, rows, actor, max_response_length=384))
        shape = tuple(model.get_input_embeddings().weight.shape)
        assert not model.get_input_embeddings().sparse  # restored after the update
        return ({n: p.grad.clone() for n, p in model.named_parameters()}, metrics,
                [c for c in created if c[1] == shape])

    usual, usual_metrics, usual_vd = run(False)
    lean, lean_metrics, lean_vd = run(True)
    assert usual_vd, "control: the usual backward creates [V, D] gradients"
    assert lean_vd == [], lean_vd
    assert lean_metrics["actor/grad_norm"] == pytest.approx(usual_metrics["actor/grad_norm"],
                                                            rel=1e-12)
    assert usual.keys() == lean.keys()
    for name in usual:
        assert usual[name].layout == lean[name].layout == torch.strided
        torch.testing.assert_close(lean[name], usual[name], rtol=1e-12, atol=1e-15, msg=name)
    assert any(g.abs().sum() > 0 for g in usual.values())


def test_update_heap_trimmed_before_the_next_rollout(toy, monkeypatch):
    """Each RL step hands freed memory back twice: after the rollout (its KV cache) and after
    the update, once the gradients are gone (the activations' heap), so the next rollout
    and an evaluation do not start on top of the update's high-water."""
    from appo.trainer import loop

    trainer = RLTrainer(toy_config(toy))
    events: list[tuple[str, bool]] = []
    real_update = loop.update_policy
    monkeypatch.setattr(loop, "update_policy",
                        lambda *a, **k: events.append(("update", False)) or real_update(*a, **k))
    monkeypatch.setattr(loop, "trim_freed_memory", lambda: events.append(
        ("trim", all(p.grad is None for p in trainer.model.parameters()))))
    trainer.step = 1
    trainer.train_step()
    trainer.tools.close()
    assert events == [("trim", True), ("update", False), ("trim", True)]
