"""The model of the vLLM training tests: a random 2-layer Llama with SmolLM2's tokenizer.

Why not SmolLM2-135M itself: every engine start traces each of its 30 layers with dynamo,
and every `appo train` step runs forward and backward passes of 135M parameters on 2 CPU
cores; in the training tests (`test_vllm_train`, `test_vllm_lora`, `test_vllm_fsdp`,
`test_vllm_colocate`) that was most of the time. What they prove does not need SmolLM2's
skill: vLLM's log-probs against an HF forward of the same weights, a weight sync reaching
the engine, a resume's rollouts coming from its checkpoint and not from the base model.
They need a llama-shaped HF dir that vLLM loads like any other and runs through the same
kernels: head_dim 64 and 3:1 grouped-query attention as SmolLM2 (vLLM's CPU attention takes
head sizes of 32 and up), tied embeddings (the LM head a sync must reach through the
embedding), SmolLM2's vocabulary and chat template; two layers of width 192 instead of 30
of 576. The tests that need a model that calls the python tool by itself (the engine's
strategies, the server's tool loop) keep SmolLM2.

Built once per session in a second or two from SmolLM2's converted dir (its tokenizer
files) and a fixed seed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
         "generation_config.json")
# Wider than transformers' 0.02: a random model's next-token distributions are then far
# from uniform (as a trained model's), so an update moves its log-probs measurably.
INIT_STD = 0.1


def tiny_config(vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=192, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=1, head_dim=64,
        max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        initializer_range=INIT_STD, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=2, dtype="float32")


def build(out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write the random model and SmolLM2's tokenizer files into `out` (once: `.complete`
    marks a finished dir)."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    if (out / ".complete").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(len(tok))).eval()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in FILES:
        shutil.copy(tokenizer_dir / name, tmp / name)
    (tmp / ".complete").write_text(f"random, seed {seed}, tokenizer of {tokenizer_dir}\n")
    tmp.rename(out)
    return out
