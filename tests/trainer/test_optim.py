"""appo.trainer.optim: the fused AdamW is the same optimizer as torch's default loop, and
the config keys pick it."""

import torch

from appo.trainer.optim import adamw, fused_by_default


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2)]
    params = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in shapes]
    grads = [[torch.randn(s, generator=g, dtype=dtype) for s in shapes] for _ in range(4)]
    return params, grads


def _run(fused: bool, dtype=torch.float64):
    params, grads = _params(dtype)
    opt = adamw(params, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), fused=fused)
    for step in grads:
        for p, gr in zip(params, step, strict=True):
            p.grad = gr.clone()
        opt.step()
    return params, opt


def test_fused_and_loop_adamw_agree_in_float64():
    fused, opt_f = _run(True)
    loop, opt_l = _run(False)
    assert opt_f.defaults["fused"] is True and not opt_l.defaults["fused"]
    start, _ = _params(torch.float64)
    for a, b, a0 in zip(fused, loop, start, strict=True):
        assert (a - a0).abs().max() > 1e-2  # the steps moved the weights
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # the moments too: a resume from either one continues the other
    for pa, pb in zip(fused, loop, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt_f.state[pa][key], opt_l.state[pb][key],
                                       rtol=1e-12, atol=1e-16)


def test_fused_is_the_cpu_default_and_config_keys_force_it():
    params, _ = _params(torch.float32)
    assert fused_by_default(params)
    assert adamw(params, lr=1e-3).defaults["fused"] is True
    assert not adamw(params, lr=1e-3, fused=False).defaults["fused"]
    from appo.config import load_config

    cfg = load_config(None, ["actor.optim.fused=false", "sft.fused=true"])
    assert cfg.actor.optim.fused is False and cfg.sft.fused is True
    assert load_config(None, []).critic.optim.fused is None


def test_a_fused_step_bumps_the_version_counters_as_the_loop_does():
    # The hf engine repacks its weight copies when a parameter's version changes: a fused
    # step that did not bump it left the engine decoding with the weights before SFT.
    for fused in (True, False):
        params, grads = _params(torch.float32)
        opt = adamw(params, lr=1e-3, fused=fused)
        for p, g in zip(params, grads[0], strict=True):
            p.grad = g
        before = [p._version for p in params]
        opt.step()
        assert all(p._version > v for p, v in zip(params, before, strict=True))

