"""`python -m appo.rollout.cpu.warm` (run by `make test` before the workers start) compiles
every kernel signature a CPU rollout calls, so the workers only load numba's cache."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from appo.rollout.cpu import kernels
from appo.rollout.cpu.matmuls import decode_rule

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba not installed")

# In a fresh process (nothing compiled or loaded yet): the warm-up, then decodes shaped
# unlike its own (other row counts, forks, a second call on the same rows, greedy, top-p,
# top-k with a repetition penalty).
# A kernel signature is in a dispatcher once compiled or loaded from the cache, so any
# signature the later decodes add is one the warm-up left for a worker to compile.
SCRIPT = textwrap.dedent("""
    import json
    import numba
    from appo.models import load_model
    from appo.rollout.cpu import attention, kernels, sampling, team, warm
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams

    def compiled():
        found = {name: d for module in (attention, sampling, team)
                 for name, d in vars(module).items()
                 if isinstance(d, numba.core.dispatcher.Dispatcher)}
        found.update({"kernels." + kind: d for kind, d in kernels._built.items()})
        return {name: sorted(map(str, d.signatures)) for name, d in found.items()}

    warm.warm()
    before = compiled()
    lm = load_model("tiny-test", device="cpu")
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=3, eos_ids=frozenset())
    rows = eng.fork(eng.add_row(tok.encode("Be brief. " * 30 + "Why?")), 6)
    eng.decode(rows, [5, 2, 7, 1, 3, 4], SamplingParams(temperature=0.7, top_p=0.9))
    eng.decode(rows[:2], 3, SamplingParams(temperature=0))
    eng.decode(rows[2:], 3, SamplingParams(temperature=0.6, top_k=20, top_p=0.95,
                                           repetition_penalty=1.1))
    many = [eng.add_row(tok.encode(f"n{i}")) for i in range(20)] + [eng.add_row([5] * 40)]
    eng.decode(many, 4, SamplingParams())
    print(json.dumps({"before": before, "after": compiled()}))
""")


def test_warm_compiles_every_signature_a_rollout_calls():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    before, after = seen["before"], seen["after"]
    # The fused step's kernels and at least one matmul kernel of this machine's rule (where
    # it names one: the AMD AVX-512 rule multiplies through oneDNN alone).
    assert all(before.get(name) for name in ("rope_attend_units", "rms_norm",
                                             "add_rms_norm", "silu_mul", "sample_rows",
                                             "_matmul", "_attention", "_serve")), before
    if decode_rule(torch.float32, torch.device("cpu"), True).kernels:
        assert any(name.startswith("kernels.") and sigs for name, sigs in before.items()), before
    assert after == before  # the later decodes compiled (or loaded) nothing new
