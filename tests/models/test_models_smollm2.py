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


def test_two_processes_convert_once(tmp_path):
    """A fresh cache, two concurrent loads: the file lock makes exactly one convert."""
    code = (
        "from appo.models import load_model\n"
        "from appo.models.loader import converted_dir\n"
        "lm = load_model('smollm2-135m')\n"
        "print('CONVERTED' if lm.extra.get('converted') else 'REUSED')\n"
    )
    env = dict(os.environ, APPO_CACHE=str(tmp_path))
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    verdicts = sorted(o[0].strip().splitlines()[-1] for o in outs)
    assert verdicts == ["CONVERTED", "REUSED"]
    assert (tmp_path / "models" / "smollm2-135m" / ".complete").is_file()
    assert not list((tmp_path / "models").glob("*.tmp*"))
