"""The lean decoder's prefill: token-wise matmuls on the real tokens only (`lean._Tokens`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest


def test_prefill_matmuls_skip_the_padding_of_shorter_rows(monkeypatch):
    # Rows with pending parts of different lengths are left-padded to the longest in one
    # prefill forward; the token-wise matmuls then run on the real tokens only (packed
    # rows), with the logits and tokens of the padded computation up to float32 rounding.
    from appo.models import load_model
    from appo.rollout.cpu import lean as lean_mod
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams

    lm = load_model("tiny-test", device="cpu")
    tok = lm.tokenizer
    prompts = [tok.encode("Hi."), tok.encode("A much longer question about the deep blue sea?"),
               tok.encode("Count to five, slowly.")]
    real = sum(len(p) for p in prompts)
    padded = len(prompts) * max(len(p) for p in prompts)
    assert real < padded

    def run():
        eng = HFEngine(lm.model, tok, seed=5, eos_ids=frozenset())
        if eng._lean is None:
            pytest.skip("the tiny model is not served by the lean decoder")
        seen: list[int] = []
        impl = eng._lean.rule.prefill_implementation()
        spy = dataclasses.replace(impl, linear=lambda x, w, b=None: (
            seen.append(x.reshape(-1, x.shape[-1]).shape[0]) or impl.linear(x, w, b)))
        monkeypatch.setattr(eng._lean, "_matmuls", lambda ids: spy if ids.shape[1] > 1
                            else eng._lean.rule.implementation(ids.shape[0]))
        rows = [eng.add_row(p) for p in prompts]
        outs = eng.decode(rows, 5, SamplingParams(temperature=1.0))
        return seen, [(o.token_ids, o.logps) for o in outs]

    seen, got = run()
    assert seen and set(seen) == {real}  # every prefill matmul: the real tokens only
    monkeypatch.setattr(lean_mod._Tokens, "of", classmethod(
        lambda cls, cache, batch, steps: cls(batch, steps, None, None)))
    seen, want = run()
    assert set(seen) == {padded}
    for (ids_a, lp_a), (ids_b, lp_b) in zip(got, want, strict=True):
        assert ids_a == ids_b
        np.testing.assert_allclose(lp_a, lp_b, atol=1e-4)
