"""What the `appo train rollout.name=vllm` tests share (test_vllm_train, test_vllm_lora,
test_vllm_fsdp): the run's config (on the session's tiny model, `tiny_llama.py`), one
subprocess per run, and the check that a dump's recorded
log-probs come from a given model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

LOGP_TOL = 5e-4  # derived in test_vllm_engine.py's docstring
# The bound on one subprocess (a run, a launch): it catches a hang, not a slow machine. A
# run that took 1200 s at load average 5-8 once hit the old 1200 s bound.
HANG_TIMEOUT_S = 3600

TRAIN_ARGS = (
    "rollout.name=vllm", "rollout.kv_cache_gib=1",
    "rollout.strategy=arpo", "rollout.n=4", "rollout.initial_rollouts=2",
    "data.template=math", "tools.enabled=[python]",
    "data.train_files=['synth:arith?split=train&levels=1&n=16']",
    "data.train_batch_size=2", "data.max_response_length=96",
    # The base model rarely earns a reward here, so group advantages may all be 0; the
    # entropy bonus keeps every update non-zero (Adam then moves each weight ~lr).
    "actor.optim.lr=1e-4", "actor.entropy_coeff=0.01", "trainer.save_freq=1",
)


def train(out: Path, model: Path, *extra: str) -> subprocess.CompletedProcess:
    """`appo train` of `model` with `TRAIN_ARGS`, checkpoints in `out` and rollout dumps in
    `out/rollouts`; `extra` overrides come last (later keys win)."""
    args = [f"model.path={model}", *TRAIN_ARGS, f"trainer.default_local_dir={out}",
            f"trainer.rollout_data_dir={out / 'rollouts'}", *extra]
    # the worker's thread budget under pytest-xdist (tests/conftest.py), else 2
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    return subprocess.run([sys.executable, "-m", "appo.cli", "train", *args],
                          capture_output=True, text=True, env=env, timeout=HANG_TIMEOUT_S)


def rollout_errors(model_dir, dump: Path) -> list[float]:
    """|recorded log-prob - an HF forward's| of every trained token in a rollout dump."""
    from appo.models import load_model
    from logp_check import rollout_logp_errors

    return rollout_logp_errors(load_model(str(model_dir), device="cpu").model, dump)
