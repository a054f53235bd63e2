"""The embedded SmolLM2-135M: GGUF conversion cache, locking, deterministic generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from appo.models import load_model
from appo.models.generate import generate_chat
from appo.models.loader import converted_dir
from cli_runner import run_cli

pytestmark = pytest.mark.slow


def test_conversion_cache_is_reused(monkeypatch):
    from appo.models import loader

    first = load_model("smollm2-135m")  # converts on a fresh machine (~20-40 s), else reuses
    assert (converted_dir("smollm2-135m") / ".complete").is_file()

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    # Reused, not converted again (what a time bound said before, on a loaded machine not)
    monkeypatch.setattr(loader, "convert_gguf", no_second_conversion)
    second = load_model("smollm2-135m")
    assert second.model.config.vocab_size == 49152
    assert "quantization_config" not in json.loads(
        (converted_dir("smollm2-135m") / "config.json").read_text()
    )
    assert first.tokenizer.eos_token == "<|im_end|>"


def test_generate_is_deterministic_under_seed():
    lm = load_model("smollm2-135m")
    conv = [[{"role": "user", "content": "What is 17*23?"}]]
    greedy = generate_chat(lm, conv, max_new_tokens=24)
    assert greedy == generate_chat(lm, conv, max_new_tokens=24)
    kw = dict(max_new_tokens=24, temperature=0.8, top_p=0.95, top_k=20)
    assert generate_chat(lm, conv, seed=1, **kw) == generate_chat(lm, conv, seed=1, **kw)
    assert greedy[0].strip()


def test_cli_generate_on_embedded_model():
    r = run_cli("generate", "--model", "smollm2-135m", "--max-new-tokens", "20", "What is 17*23?")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


# What each process of test_two_processes_convert_once runs: the real load_model, lock and
# atomic save, around a stand-in for the GGUF dequantisation (SmolLM2's takes 20-40 s per
# process and proves nothing more here): a random 2-layer Llama with SmolLM2's tokenizer,
# after a pause that holds the lock long enough for the other process to reach it.
CONVERT_ONCE = """
import sys, time
from appo.models import load_model, loader

def stand_in(gguf, dtype):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    time.sleep(4)
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)
    return LlamaForCausalLM(cfg), tok

loader._load_gguf = stand_in
lm = load_model("smollm2-135m")
print("CONVERTED" if lm.extra.get("converted") else "REUSED")
"""


def test_two_processes_convert_once(tmp_path):
    """A fresh cache, two concurrent loads: the file lock makes exactly one convert.
    (Without the lock, or without the re-check under it, both print CONVERTED.)"""
    load_model("smollm2-135m")  # the shared cache's conversion: its tokenizer files
    tokenizer_dir = converted_dir("smollm2-135m")
    cache = tmp_path / "cache"
    env = dict(os.environ, APPO_CACHE=str(cache))
    procs = [
        subprocess.Popen([sys.executable, "-c", CONVERT_ONCE, str(tokenizer_dir)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    verdicts = sorted(o[0].strip().splitlines()[-1] for o in outs)
    assert verdicts == ["CONVERTED", "REUSED"]
    assert (cache / "models" / "smollm2-135m" / ".complete").is_file()
    assert not list((cache / "models").glob("*.tmp*"))
