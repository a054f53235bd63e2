"""Compile the CPU decode kernels once, into numba's on-disk cache: `python -m appo.rollout.cpu.warm`.

The numba kernels (`kernels`, `attention`, `sampling`) are compiled on their first call in
each process and cached next to their source (`cache=True`), so only a process that finds no
cache pays the compile (tens of seconds on a 2-core machine). A test run over several pytest-xdist
workers on a fresh clone would otherwise pay it once per worker, inside whichever test first
decodes, so `make test` runs this first: the tiny-test model decodes one row, a group of forks
over a shared system prompt (the cascade path) and a batch wide enough for the many-row
kernel of this CPU's rule, which compiles what those calls use (the sampling kernel has one
signature whatever the sampling parameters). Nothing here changes a
result; without numba it only says so.
"""

from __future__ import annotations

import sys
import time

from appo.rollout.cpu import kernels


def warm() -> float:
    """Decode a few tiny-test batches through the CPU kernels; returns the seconds taken."""
    from appo.models import load_model
    from appo.rollout.cpu import team
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams

    began = time.perf_counter()
    team.warm()  # the split jobs: the tiny model's matrices are too small to be split
    lm = load_model("tiny-test", device="cpu")
    tok = lm.tokenizer
    eng = HFEngine(lm.model, tok, seed=0, eos_ids=frozenset())
    system = tok.encode("You are a careful assistant. " * 12)  # long enough to share: cascade
    params = SamplingParams()
    eng.decode([eng.add_row(tok.encode("Hi"))], 4, params)
    forks = eng.fork(eng.add_row(system + tok.encode(" One?")), 4)
    eng.decode(forks, 4, params)
    # Wide enough for every rule's many-row kernel (the widest rule starts at 16 rows).
    wide = [eng.add_row(tok.encode(f"Question {i}?")) for i in range(32)]
    eng.decode(wide, 3, params)
    return time.perf_counter() - began


def main() -> int:
    if not kernels.available():
        print("cpu kernels: numba is not installed; nothing to compile")
        return 0
    print(f"cpu kernels: compiled or loaded from numba's cache in {warm():.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
