"""The `vllm` rollout engine on a real vLLM (CPU build here) and the real SmolLM2-135M.

One in-process `vllm.LLM` serves the whole module (start-up ~80 s after the first compile).
Checked: every strategy fills exactly `n` trajectories per prompt with the python tool; the
recorded behaviour log-prob of every sampled token equals a full HF forward of the same ids;
after an optimizer step, `sync_weights` makes vLLM's log-probs equal the updated HF model's,
and without the sync they do not (so the check can fail); the file route of a sync (the
engine core in a child process, under DDP/FSDP) restores the base weights.

Tolerance (LOGP_TOL): both sides compute in float32 but with different kernels (vLLM's CPU
attention and fused qkv / gate-up GEMMs against HF's eager modules), so the logits differ
by accumulated rounding: float32 has a 6e-8 unit roundoff, a 576-wide dot product
accumulates ~sqrt(576) * 6e-8 * |logit| relative error per layer, and 30 layers of
residual updates amplify it; a log-prob is a logit minus a logsumexp, so its error is about
twice a logit's. Measured here: a worst case of 5e-5 over 4 x 64 sampled tokens; the bound
5e-4 keeps a 10x margin over it, while one AdamW step at lr 1e-4 moves log-probs by more
than 1e-2 (asserted below, so a skipped sync fails the check).
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.vllm
LOGP_TOL = 5e-4
N = 4


@pytest.fixture(scope="module")
def cfg():
    from appo.config import load_config

    return load_config(overrides=[
        "model.path=smollm2-135m", "rollout.name=vllm", "rollout.kv_cache_gib=1",
        f"rollout.n={N}", "rollout.initial_rollouts=2", "rollout.beam_size=2",
        "rollout.branch_probability=1.0", "data.max_response_length=160",
        "tools.enabled=[python]", "tools.call_limit=2",
    ])


@pytest.fixture(scope="module")
def lm():
    from appo.models import load_model

    return load_model("smollm2-135m", device="cpu")


@pytest.fixture(scope="module")
def engine(cfg, lm):
    from appo.rollout.vllm_engine import VLLMEngine, start_llm

    threads = torch.get_num_threads()
    llm = start_llm(cfg)
    # vLLM's CPU worker would set this process to one torch thread; start_llm restores it.
    assert torch.get_num_threads() == threads
    return VLLMEngine(llm, lm.tokenizer, seed=0)


SHOT = "<python>\nprint({q})\n</python>\n<result>\n{a}\n</result>\n<answer>\\boxed{{{a}}}</answer>"


def two_shot_ids(tok, question: str) -> list[int]:
    """The question after two worked tool calls: the base SmolLM2 rarely opens a tool call
    on its own (the demo teaches it by SFT); with these it calls python in most rows."""
    messages = []
    for q, a in (("2 + 3", 5), ("4 * 6", 24)):
        messages += [{"role": "user", "content": f"What is {q}?"},
                     {"role": "assistant", "content": SHOT.format(q=q, a=a)}]
    messages.append({"role": "user", "content": question})
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


@pytest.fixture(scope="module")
def prompts(lm):
    from appo.rollout import RolloutPrompt

    return [RolloutPrompt(uid=f"q{i}", prompt_ids=two_shot_ids(lm.tokenizer, q))
            for i, q in enumerate(["What is 17 * 23?", "What is 345 + 678?"])]


def logp_errors(model, trajs) -> list[float]:
    """|logp_rollout - log_softmax(HF logits)| of every sampled (loss_mask or branch) token."""
    errors = []
    for t in trajs:
        ids = t.prompt_ids + t.response_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        ref = torch.log_softmax(logits, -1)
        p = len(t.prompt_ids)
        for k, sampled in enumerate(t.sampled_mask()):
            if sampled:
                errors.append(abs(float(ref[p + k - 1, ids[p + k]]) - t.logp_rollout[k]))
    return errors


@pytest.mark.parametrize("strategy", ["grpo", "arpo", "aepo", "appo"])
def test_every_strategy_fills_n_with_exact_logprobs(strategy, cfg, lm, engine, prompts):
    from appo.rollout import RolloutSettings, rollout
    from appo.rollout.scoring import hf_score_fn
    from appo.tools.registry import build_tools

    settings = RolloutSettings.from_config(cfg)
    engine.reseed(7)
    score_fn = hf_score_fn(lm.model, settings.sampling) if strategy == "appo" else None
    batch = rollout(prompts, engine, build_tools(cfg.tools), settings, strategy=strategy,
                    rng=random.Random(3), score_fn=score_fn)
    per_prompt = {p.uid: 0 for p in prompts}
    for t in batch.trajectories:
        t.check()
        per_prompt[t.uid] += 1
    assert per_prompt == {p.uid: N for p in prompts}
    assert batch.stats.tool_calls > 0  # the tool path ran (SmolLM2 calls python here)
    errors = logp_errors(lm.model, batch.trajectories)
    assert len(errors) > 100 and max(errors) < LOGP_TOL, max(errors)
    if strategy != "grpo":  # branches resend their parent's prefix: vLLM's prefix cache
        assert batch.stats.tokens_reused > 0


def test_sync_after_an_optimizer_step(cfg, lm, engine, prompts):
    """One AdamW step on the HF model; vLLM matches it after `sync_weights`, not before."""
    import copy

    from appo.rollout import RolloutSettings, rollout

    model = copy.deepcopy(lm.model)
    settings = RolloutSettings.from_config(cfg, n=2)

    def sample():
        engine.reseed(11)
        return rollout(prompts[:1], engine, None, settings, strategy="grpo").trajectories

    before = sample()
    assert max(logp_errors(model, before)) < LOGP_TOL
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t = before[0]
    ids = torch.tensor([t.prompt_ids + t.response_ids])
    logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    (-logp.gather(1, ids[0, 1:, None]).mean()).backward()
    opt.step()
    stale = sample()
    assert max(logp_errors(model, stale)) > 10 * LOGP_TOL  # the check can fail
    syncs = engine.weight_syncs
    engine.sync_weights(model)
    assert engine.weight_syncs == syncs + 1
    fresh = sample()
    assert max(logp_errors(model, fresh)) < LOGP_TOL
    # Back to the base weights through the route an engine core in a child process takes
    # (DDP/FSDP): a safetensors file the worker reloads from. A no-op would leave vLLM on
    # the updated weights and fail this check.
    assert engine.in_process
    engine.in_process = False
    try:
        engine.sync_weights(lm.model)
    finally:
        engine.in_process = True
    assert max(logp_errors(lm.model, sample())) < LOGP_TOL


def test_many_long_prompts_in_one_call(engine):
    """15 seeded rows of 290 prompt tokens (4,350) in one call exceed vLLM's per-step token
    budget (4096 on CPU), just: with chunked prefill vLLM 0.32's CPU worker failed on the
    seeded requests ("CPU Generator does not use offset", first seen with 32 rows);
    start_llm turns chunked prefill off on CPU. More rows only cost prefill time."""
    from appo.rollout.sampling import SamplingParams

    n_rows = 15
    assert n_rows * 290 > 4096
    rows = [engine.add_row([100 + (7 * i + 13 * j) % 30000 for j in range(290)])
            for i in range(n_rows)]
    try:
        outs = engine.decode(rows, [2] * n_rows, SamplingParams(temperature=1.0))
        # every row sampled its 2 tokens (or stopped at EOS after 1)
        assert all(len(o.token_ids) == 2 or o.finish == "eos" for o in outs)
        assert all(o.token_ids for o in outs)
    finally:
        engine.release(rows)


def test_auto_builds_the_vllm_engine_where_the_table_says_vllm(cfg, lm, engine, monkeypatch,
                                                               capsys):
    """`rollout.name=auto` with vLLM installed (really imported here) picks the vllm engine
    for a run long enough to repay its start-up, and hf for a single short call. The
    module's running `vllm.LLM` stands in for a second start (`start_llm` patched), so no
    extra 80 s start-up."""
    from omegaconf import OmegaConf

    from appo.rollout import auto, build_engine
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams
    from appo.rollout.vllm_engine import VLLMEngine

    assert auto.vllm_installed() and auto.vllm_import_error() is None
    # A table where vLLM decodes faster (the one measured before issue 43's CPU kernels):
    # with today's the hf engine is faster and a CPU run never picks vLLM.
    monkeypatch.setattr(auto, "CPU_DECODE", ((8, 103.6, 214.9), (32, 175.4, 356.9)))
    monkeypatch.setattr("appo.rollout.vllm_engine.start_llm", lambda _cfg: engine.llm)
    cfg_auto = OmegaConf.merge(cfg, {"rollout": {"name": "auto"}, "model": {"device": "cpu"}})
    long_run = auto.Workload(rows=32, calls=10, max_new_tokens=160)
    assert auto.resolve(cfg_auto, long_run).name == "vllm"
    built = build_engine(cfg_auto, lm, workload=long_run)
    assert isinstance(built, VLLMEngine) and built.llm is engine.llm
    assert capsys.readouterr().err.startswith("appo: rollout.name=auto -> vllm (CPU, 32 rows")
    row = built.add_row(lm.tokenizer.encode("The capital of France is"))
    [out] = built.decode([row], [3], SamplingParams(temperature=1.0))
    assert 1 <= len(out.token_ids) <= 3 and len(out.logps) == len(out.token_ids)
    built.release([row])
    short = build_engine(cfg_auto, lm, workload=auto.Workload(rows=4, calls=1,
                                                              max_new_tokens=64))
    assert isinstance(short, HFEngine)
