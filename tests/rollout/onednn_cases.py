"""Inputs of the oneDNN tests: random linear layers, and tiny-test's hf engine."""

from __future__ import annotations

import pytest
import torch


def random_linear(rows: int, n: int = 200, k: int = 96, seed: int = 0):
    """`x` `[rows, k]`, weight `[n, k]` and bias `[n]`, float32, from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen),
            torch.randn(n, generator=gen))


def lean_engine(**kwargs):
    """tiny-test's hf engine (seed 3, EOS off) and its tokenizer; skips the test where the
    lean decoder does not serve the tiny model."""
    from appo.models import load_model
    from appo.rollout.hf_engine import HFEngine

    lm = load_model("tiny-test", device="cpu")
    eng = HFEngine(lm.model, lm.tokenizer, seed=3, eos_ids=frozenset(), **kwargs)
    if eng._lean is None:
        pytest.skip("the tiny model is not served by the lean decoder")
    return eng, lm.tokenizer


def greedy_under(eng, tok, rule):
    """(token ids, log-probs) of 3 rows decoded greedily for 5 tokens with the lean
    decoder's rule set to `rule`; the rows are released after."""
    from appo.rollout.sampling import SamplingParams

    eng._lean.rule = rule
    rows = [eng.add_row(tok.encode(f"Tell me about the number {i}.")) for i in range(3)]
    outs = eng.decode(rows, 5, SamplingParams(temperature=0.0))
    eng.release(rows)
    return [(o.token_ids, o.logps) for o in outs]
