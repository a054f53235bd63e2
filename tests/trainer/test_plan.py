"""`appo plan` and the memory plan (appo.trainer.plan, appo.trainer.plan_run): exact bytes
for a hand-counted model, the published configs on 8 x 80 GB, and the plan against what is
measured on CPU (tensor bytes of weights, gradients and AdamW states; the most bytes
autograd holds for the backward during the update's forward, `response_logprobs`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from appo.cli import main
from appo.config import load_config
from appo.errors import AppoError
from appo.models.arch import match_architecture, resolve_architecture, shipped_architectures
from appo.trainer.plan import (
    GIB,
    PlanInputs,
    activation_bytes,
    model_shape,
    plan_memory,
    weight_cast_bytes,
)
from appo.trainer.plan_run import check_plan_fits, plan_for_config
from cli_runner import run_cli

REPO = Path(__file__).resolve().parents[2]
SEVEN_B = str(REPO / "configs" / "arpo_qwen2.5_7b_reasoning.yaml")
GPU_CONFIGS = sorted(p for p in (REPO / "configs").glob("*.yaml")
                     if load_config(str(p), []).rollout.name == "vllm")


def _small_config(tie: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=100, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, tie_word_embeddings=tie)


# Hand count of _small_config: embeddings 100 x 16; per layer q 16x16, k 16x8, v 16x8,
# o 16x16, gate/up 16x32, down 32x16, two norms of 16; final norm 16; untied head 100 x 16.
LAYER = 256 + 128 + 128 + 256 + 3 * 512 + 2 * 16  # 2336
PARAMS = 1600 + 2 * LAYER + 16 + 1600  # 7888
TENSORS = 1 + 2 * 9 + 1 + 1  # 21
# LoRA rank 2 on every linear but the head: r * (in + out) per linear
LORA = 2 * 2 * ((16 + 16) + (16 + 8) + (16 + 8) + (16 + 16) + 3 * (16 + 32))  # 1024


def test_model_shape_counts_by_hand():
    s = model_shape(_small_config())
    assert (s.params, s.tensors, s.layers, s.layer_params) == (PARAMS, TENSORS, 2, LAYER)
    assert (s.head_dim, s.kv_heads, s.root_params, s.head_params) == (4, 2, 3216, 1600)
    tied = model_shape(_small_config(tie=True))
    assert tied.params == PARAMS - 1600 and tied.tensors == TENSORS - 1
    lora = model_shape(_small_config(), lora_rank=2)
    assert (lora.lora_params, lora.lora_tensors) == (LORA, 28)
    assert lora.lora_base_params == 2 * (LAYER - 32)
    only_q = model_shape(_small_config(), lora_rank=2, target_modules=["q_proj"])
    assert only_q.lora_params == 2 * 2 * 32


def test_fsdp_divides_by_world_and_ddp_does_not():
    s = model_shape(_small_config())
    base = PlanInputs(gpus=2, nodes=2, gpu_memory_gb=1.0, device="cpu", autocast=False,
                      master_bytes=4, rollout="openai")
    fsdp = plan_memory(dataclasses.replace(base, parallel="fsdp"), s)
    ddp = plan_memory(dataclasses.replace(base, parallel="ddp"), s)
    steps = 4 * TENSORS  # AdamW's step count, one float32 per tensor
    assert fsdp.term("params").update == PARAMS * 4 // 4
    assert fsdp.term("grads").update == PARAMS * 4 // 4
    assert fsdp.term("optimizer").update == 2 * PARAMS * 4 // 4 + steps
    assert ddp.term("params").update == PARAMS * 4
    assert ddp.term("grads").update == PARAMS * 4
    assert ddp.term("optimizer").update == 2 * PARAMS * 4 + steps
    assert ddp.term("ddp_buckets").update == PARAMS * 4
    assert fsdp.term("grads").rollout == 0  # set to None after each step
    # bfloat16 weights: two bytes for each, AdamW's moments in the weights' dtype
    half = plan_memory(dataclasses.replace(base, parallel="ddp", master_bytes=2), s)
    assert half.term("optimizer").update == 2 * PARAMS * 2 + steps
    # LoRA: only the adapter has gradients and AdamW states
    lora = plan_memory(dataclasses.replace(base, parallel="ddp", lora_rank=2),
                       model_shape(_small_config(), lora_rank=2))
    assert lora.term("grads").update == LORA * 4
    assert lora.term("optimizer").update == 2 * LORA * 4 + 4 * 28
    assert lora.term("params").update == (PARAMS + LORA) * 4


def test_reference_and_vllm_terms():
    s = model_shape(_small_config())
    i = PlanInputs(gpus=4, gpu_memory_gb=1.0, parallel="fsdp", kl_reference=True,
                   gpu_memory_utilization=0.5, tensor_parallel=2)
    plan = plan_memory(i, s)
    assert plan.term("reference").update == PARAMS * 2 // 4  # bfloat16, sharded
    assert plan.term("rollout_weights").rollout == PARAMS * 2 // 2  # per tensor-parallel slice
    assert plan.term("rollout_kv").rollout == int(0.5 * GIB) - PARAMS
    assert plan.term("rollout_kv").update == 0  # released during the update (sleep mode)
    held = plan_memory(dataclasses.replace(i, overlap=True), s)
    assert held.term("rollout_kv").update == held.term("rollout_kv").rollout
    assert held.total("update") > plan.total("update")


def test_a_whole_rollout_copy_is_counted_where_the_trainer_keeps_one():
    """Under FSDP the trainer keeps a whole copy in the compute dtype for the hf engine, APPO's
    scorer or a critic; vLLM by name streams from the shards and keeps none."""
    s = model_shape(_small_config())
    i = PlanInputs(gpus=4, gpu_memory_gb=1.0, parallel="fsdp", rollout_copy=True)
    assert plan_memory(i, s).term("rollout_copy").rollout == PARAMS * 2  # bf16, not sharded
    with pytest.raises(KeyError):
        plan_memory(dataclasses.replace(i, rollout_copy=False), s).term("rollout_copy")
    appo = load_config("configs/appo_qwen3_8b_deepsearch.yaml")
    arpo = load_config("configs/arpo_qwen2.5_7b_reasoning.yaml")
    assert plan_for_config(appo, 8, 80).term("rollout_copy").rollout > 0
    with pytest.raises(KeyError):
        plan_for_config(arpo, 8, 80).term("rollout_copy")


def _plan_cli(capsys, *args: str) -> tuple[int, str]:
    """`appo plan ARGS` in this process (the subprocess costs seconds of imports)."""
    code = main(["plan", *args])
    return code, capsys.readouterr().out


def test_7b_fits_under_fsdp_and_prints_its_table(capsys):
    code, out = _plan_cli(capsys, SEVEN_B, "--gpus", "8", "--gpu-memory-gb", "80")
    assert code == 0, out
    for label in ("parameters (float32, /8)", "gradients", "AdamW states", "vLLM weights",
                  "vLLM KV cache", "activations (11264 tokens, checkpointed)", "logits chunk",
                  "total", "card", "verdict: fits"):
        assert label in out, label
    assert "qwen2.5-7b" in out and "7.62 B parameters" in out


def test_7b_under_ddp_does_not_fit_and_says_why(capsys):
    code, out = _plan_cli(capsys, SEVEN_B, "trainer.parallel=ddp", "--gpus", "8",
                          "--gpu-memory-gb", "80", "--json")
    assert code == 1, out
    plan = json.loads(out)
    assert not plan["fits"] and plan["largest"] == "optimizer"
    assert plan["peak_gb"] > 80
    assert "largest term: AdamW states" in plan["verdict"]
    assert "trainer.parallel=fsdp" in plan["verdict"]


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_every_published_config_fits_on_8_x_80(path):
    plan = plan_for_config(load_config(str(path), []), gpus=8, gpu_memory_gb=80)
    assert plan.fits, plan.verdict()
    assert plan.source.startswith("shipped ")
    assert 0 < plan.term("rollout_kv").rollout  # vLLM has room for its cache


def test_published_configs_are_found():
    assert len(GPU_CONFIGS) == 3


def test_check_plan_fits_refuses_in_one_line():
    cfg = load_config(SEVEN_B, ["trainer.parallel=ddp"])
    with pytest.raises(AppoError) as e:
        check_plan_fits(cfg, gpus=8, gpu_memory_gb=80)
    line = str(e.value)
    assert "\n" not in line and "AdamW states" in line and "trainer.parallel=fsdp" in line
    assert "trainer.skip_memory_plan=true" in line
    skipped = load_config(SEVEN_B, ["trainer.parallel=ddp", "trainer.skip_memory_plan=true"])
    assert not check_plan_fits(skipped, gpus=8, gpu_memory_gb=80).fits
    assert check_plan_fits(load_config(SEVEN_B, []), gpus=8, gpu_memory_gb=80).fits
    # the sharding the trainer resolved wins over trainer.parallel
    with pytest.raises(AppoError):
        check_plan_fits(load_config(SEVEN_B, []), gpus=8, gpu_memory_gb=80, parallel="ddp")


@pytest.mark.parametrize("name,billions", [("qwen2.5-7b", 7.62), ("qwen3-8b", 8.19),
                                           ("qwen3-14b", 14.77), ("llama-3.1-8b", 8.03),
                                           ("smollm2-135m", 0.135)])
def test_shipped_architectures_have_the_published_sizes(name, billions):
    source, config = resolve_architecture("unused", arch=name)
    assert abs(model_shape(config).params / 1e9 - billions) < 0.01 * billions


def test_architecture_from_the_model_path():
    assert set(shipped_architectures()) >= {"qwen2.5-7b", "qwen3-8b", "qwen3-14b",
                                            "llama-3.1-8b"}
    assert match_architecture("/path/to/Qwen3-14B-sft") == "qwen3-14b"
    assert match_architecture("/path/to/Qwen3-8B-sft") == "qwen3-8b"
    assert match_architecture("meta-llama/Llama-3.1-8B-Instruct") == "llama-3.1-8b"
    assert match_architecture("Qwen/Qwen2.5-7B-Instruct") == "qwen2.5-7b"
    assert match_architecture("/models/mistral-7b") is None
    with pytest.raises(AppoError, match="--arch"):
        resolve_architecture("/models/mistral-7b")


def test_arch_option_and_a_local_model_directory(tmp_path, capsys):
    shipped = Path(resolve_architecture("x", arch="qwen3-8b")[0].split()[-1])
    assert shipped.name == "qwen3-8b"
    model_dir = tmp_path / "my-sft"
    model_dir.mkdir()
    _small_config().save_pretrained(model_dir)
    source, config = resolve_architecture(str(model_dir))
    assert source == str(model_dir) and config.hidden_size == 16
    code, out = _plan_cli(capsys, SEVEN_B, f"model.path={model_dir}", "--gpus", "2", "--json")
    assert code == 0, out
    assert json.loads(out)["model"]["params"] == PARAMS
    code, out = _plan_cli(capsys, "--config", SEVEN_B, "--arch", "qwen3-14b", "--gpus", "8")
    assert code == 0 and "qwen3-14b" in out and "14.77 B parameters" in out


def test_plan_cli_in_a_subprocess():
    """The installed entry point: exit status 1 and the verdict when the run does not fit."""
    r = run_cli("plan", SEVEN_B, "trainer.parallel=ddp", "--gpus", "8", subprocess=True)
    assert r.returncode == 1, r.stderr
    assert "verdict: does not fit" in r.stdout and "AdamW states" in r.stdout


# ------------------------------------------------------------------ plan vs measured (CPU)
def _cpu_inputs(cfg, tokens: int, row: int, ckpt: bool, autocast: bool) -> PlanInputs:
    a = cfg.actor
    return PlanInputs(gpus=1, parallel="single", device="cpu", master_bytes=4,
                      autocast=autocast, rollout="openai", token_budget=tokens,
                      sequence_tokens=row, gradient_checkpointing=ckpt,
                      lean_mlp=a.lean_mlp_activations, sdpa_gqa=a.sdpa_gqa)


def _measured_states(model) -> tuple[int, int, int]:
    """Bytes of the weights, of the gradients after a backward and of AdamW's states after a
    step (sum of tensor nbytes)."""
    params = sum(p.nbytes for p in model.parameters())
    ids = torch.randint(0, 50, (2, 16))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt.step()
    states = sum(t.nbytes for st in opt.state.values() for t in st.values()
                 if isinstance(t, torch.Tensor))
    return params, grads, states


class _Rows:
    """The fields of a `TrainBatch` that `response_logprobs` reads."""

    def __init__(self, ids: torch.Tensor, lengths: torch.Tensor, prompt: int):
        self.input_ids, self.lengths = ids, lengths
        self.prompt_lens = torch.full_like(lengths, prompt)
        self.response_lens = lengths - prompt

    def __len__(self) -> int:
        return len(self.input_ids)


def _peak_saved_bytes(model, rows: _Rows, compute_dtype) -> int:
    """The most bytes autograd holds for the backward at any moment of the update's forward
    (`response_logprobs`: the model, the LM head's chunked log-probs), parameters aside."""
    from appo.trainer.memory import peak_saved_bytes
    from appo.trainer.update import response_logprobs

    with torch.enable_grad(), peak_saved_bytes(model) as state:
        out = response_logprobs(model, rows, 128, with_entropy=True, share_prefix=False,
                                compute_dtype=compute_dtype)
    del out
    return state["peak"]


def _compare(spec: str, rows: int, row: int, hf_config=None) -> dict[str, tuple[int, int]]:
    """(measured, planned) bytes for model `spec` (or a random model of `hf_config`):
    weights, gradients and AdamW states, and the activations of the update's forward at
    `rows` x `row` padded tokens in float32 and in bfloat16 autocast, with and without
    gradient checkpointing."""
    from transformers import AutoModelForCausalLM

    from appo.models import load_model
    from appo.trainer.memory import memory_options

    cfg = load_config(None, [f"model.path={spec}"])
    if hf_config is None:
        _, hf_config = resolve_architecture(spec)
        model = load_model(spec).model.train()
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config).train()
    shape = model_shape(hf_config)
    plan = plan_memory(_cpu_inputs(cfg, rows * row, row, False, False), shape)
    pairs = {}
    measured = _measured_states(model)
    model.zero_grad(set_to_none=True)
    for key, value in zip(("params", "grads", "optimizer"), measured, strict=True):
        pairs[key] = (value, plan.term(key).update)
    memory_options(model, cfg.actor, fsdp=False)  # as the trainer runs the model
    ids = torch.randint(0, shape.vocab, (rows, row), generator=torch.Generator().manual_seed(0))
    batch = _Rows(ids, torch.tensor([row - 7 * k for k in range(rows)]), prompt=8)
    for ckpt in (False, True):
        if ckpt:
            model.gradient_checkpointing_enable()
        for autocast in (False, True):
            inputs = _cpu_inputs(cfg, rows * row, row, ckpt, autocast)
            got = _peak_saved_bytes(model, batch, torch.bfloat16 if autocast else None)
            saved, _ = activation_bytes(inputs, shape)
            pairs[f"activations ckpt={ckpt} autocast={autocast}"] = (
                got, saved + weight_cast_bytes(inputs, shape))
    return pairs


def _assert_within(pairs: dict, tolerance: float = 0.10):
    for key, (measured, planned) in pairs.items():
        assert abs(planned - measured) <= tolerance * measured, (key, measured, planned)


def test_plan_matches_measured_tiny_test():
    pairs = _compare("tiny-test", rows=4, row=96)
    for key in ("params", "grads", "optimizer"):
        assert pairs[key][0] == pairs[key][1], (key, pairs[key])  # exact
    _assert_within(pairs)


def test_plan_matches_measured_qwen3_layout():
    """Qwen3's per-head query/key norms and explicit head_dim, on a small random model."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, head_dim=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    assert model_shape(config).qk_norm
    pairs = _compare("qwen3-small", rows=3, row=80, hf_config=config)
    for key in ("params", "grads", "optimizer"):
        assert pairs[key][0] == pairs[key][1], (key, pairs[key])
    _assert_within(pairs)


@pytest.mark.slow
def test_plan_matches_measured_smollm2():
    _assert_within(_compare("smollm2-135m", rows=2, row=128))
