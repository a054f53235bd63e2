"""`python -m appo.rollout.cpu.warm` (run by `make test` before the workers start) leaves
numba's cache holding every kernel a CPU rollout calls, so a later process compiles nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from appo.rollout.cpu import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba not installed")

# Decodes shaped unlike the warm-up's own (other row counts, forks, a second call on the same
# rows, greedy and sampled), then lists the cache again.
AFTER = textwrap.dedent("""
    import os, sys
    from appo.models import load_model
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams
    lm = load_model("tiny-test", device="cpu")
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=3, eos_ids=frozenset())
    rows = eng.fork(eng.add_row(tok.encode("Be brief. " * 30 + "Why?")), 6)
    eng.decode(rows, [5, 2, 7, 1, 3, 4], SamplingParams(temperature=0.7, top_p=0.9))
    eng.decode(rows[:2], 3, SamplingParams(temperature=0))
    many = [eng.add_row(tok.encode(f"n{i}")) for i in range(20)] + [eng.add_row([5] * 40)]
    eng.decode(many, 4, SamplingParams())
    print("\\n".join(sorted(os.listdir(sys.argv[1]))))
""")


def _cache_files(env: dict[str, str], cache: str, *args: str) -> tuple[set[str], str]:
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return {os.path.relpath(os.path.join(root, f), cache)
            for root, _, files in os.walk(cache) for f in files}, done.stdout


def test_warm_compiles_everything_a_rollout_calls(tmp_path):
    cache = str(tmp_path / "numba")
    env = {**os.environ, "NUMBA_CACHE_DIR": cache, "APPO_DECODE_MATMUL": ""}
    before, out = _cache_files(env, cache, "-m", "appo.rollout.cpu.warm")
    assert out.startswith("cpu kernels: compiled")
    # One index per kernel: the matmul kernels of this machine's rule and the fused step's.
    names = {os.path.basename(f).split("-")[0] for f in before if f.endswith(".nbi")}
    assert {"attention.rope_write", "attention.attend_units", "attention.rms_norm",
            "attention.add_rms_norm", "attention.silu_mul"} <= names, names
    assert any(n.startswith("kernels.") for n in names), names
    after, _ = _cache_files(env, cache, "-c", AFTER, cache)
    assert after == before  # nothing new compiled (numba writes an .nbc per new signature)
