"""Model loading: tiny-test determinism and speed, and one-line errors for bad specs."""

from __future__ import annotations

import time

import pytest
import torch

from appo.errors import AppoError
from appo.models import load_model
from appo.models.tiny import TAGS, build_tiny
from cli_runner import run_cli


def test_tiny_builds_deterministically_and_fast():
    # warm imports; the bound is for building, not importing transformers: far above the
    # build's time on any machine (a fraction of a second when quiet), far below a download
    build_tiny()
    start = time.perf_counter()
    a = load_model("tiny-test")
    elapsed = time.perf_counter() - start
    b = load_model("tiny-test")
    assert elapsed < 30.0
    assert a.model.config.hidden_size == 64 and a.model.config.num_hidden_layers == 2
    for (na, pa), (nb, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    # Deterministic without touching the caller's RNG stream.
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    load_model("tiny-test")
    assert torch.equal(torch.rand(1), expected)


def test_tiny_tokenizer_round_trips_and_has_tags_and_template():
    lm = load_model("tiny-test")
    tok = lm.tokenizer
    text = "Größe 17*23 = ?\n<think>x</think><python>print(1)</python> <result>\n1\n</result>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    for tag in TAGS:
        for t in (f"<{tag}>", f"</{tag}>"):
            assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert lm.chat_template == tok.chat_template
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None


def test_tiny_generate_is_deterministic_under_seed():
    from appo.models.generate import generate_chat

    lm = load_model("tiny-test")
    conv = [[{"role": "user", "content": "What is 17*23?"}]] * 2
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=50)
    a = generate_chat(lm, conv, seed=7, **kw)
    b = generate_chat(lm, conv, seed=7, **kw)
    c = generate_chat(lm, conv, seed=8, **kw)
    assert a == b
    assert a != c  # a different seed changes a random model's samples


@pytest.mark.parametrize(
    "spec, pattern",
    [
        ("/definitely/not/here", "model path not found"),
        ("./missing-model-dir", "model path not found"),
        ("no-such-alias", "unknown model 'no-such-alias'"),
        ("SomeOrg/not-cached-model", "not in the local Hugging Face cache"),
    ],
)
def test_bad_specs_raise_clear_errors(spec, pattern):
    with pytest.raises(AppoError, match=pattern):
        load_model(spec)


def test_corrupt_gguf_and_empty_dir(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(AppoError, match="cannot read GGUF file"):
        load_model(str(bad))
    with pytest.raises(AppoError, match="holds no config.json"):
        load_model(str(tmp_path))


@pytest.mark.parametrize("spec", ["/definitely/not/here", "no-such-alias", "BROKEN"])
def test_cli_model_errors_are_one_line(spec, tmp_path):
    if spec == "BROKEN":
        spec = str(tmp_path / "broken.gguf")
        (tmp_path / "broken.gguf").write_bytes(b"junk")
    r = run_cli("generate", "--model", spec, "hello")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    r = run_cli("--debug", "generate", "--model", spec, "hello")
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_cli_generate_tiny_is_deterministic():
    args = ("generate", "--model", "tiny-test", "--temperature", "0.8", "--seed", "3",
            "--max-new-tokens", "10", "What is 17*23?")
    a, b = run_cli(*args), run_cli(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.strip() != ""
