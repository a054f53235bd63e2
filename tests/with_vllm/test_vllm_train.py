"""`appo train rollout.name=vllm` from the command line on SmolLM2 with the python tool:
3 steps, then a resume to step 4. The resumed run's rollouts must come from the step-3
checkpoint's weights (the engine loads `model.path`, so without the weight sync after resume
they would come from the base model): their recorded log-probs equal an HF forward of the
checkpoint, and not of the base model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm
LOGP_TOL = 5e-4  # derived in test_vllm_engine.py


def train(out: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [
        "model.path=smollm2-135m", "rollout.name=vllm", "rollout.kv_cache_gib=1",
        "rollout.strategy=arpo", "rollout.n=4", "rollout.initial_rollouts=2",
        "data.template=math", "tools.enabled=[python]",
        "data.train_files=['synth:arith?split=train&levels=1&n=16']",
        "data.train_batch_size=2", "data.max_response_length=96",
        # The base model rarely earns a reward here, so group advantages may all be 0; the
        # entropy bonus keeps every update non-zero (Adam then moves each weight ~lr).
        "actor.optim.lr=1e-4", "actor.entropy_coeff=0.01", "trainer.save_freq=1",
        f"trainer.default_local_dir={out}", f"trainer.rollout_data_dir={out / 'rollouts'}",
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    return subprocess.run([sys.executable, "-m", "appo.cli", "train", *args],
                          capture_output=True, text=True, env=env, timeout=1200)


def rollout_errors(model_dir, dump: Path) -> list[float]:
    from appo.models import load_model

    model = load_model(str(model_dir), device="cpu").model
    errors = []
    for line in dump.read_text().splitlines():
        t = json.loads(line)
        ids = t["prompt_ids"] + t["response_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        p = len(t["prompt_ids"])
        for k, m in enumerate(t["loss_mask"]):
            if m:
                errors.append(abs(float(ref[p + k - 1, ids[p + k]]) - t["logp_rollout"][k]))
    return errors


def test_train_three_steps_then_resume(tmp_path):
    out = tmp_path / "run"
    first = train(out, "trainer.total_steps=3")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    second = train(out, "trainer.total_steps=4", "trainer.resume=true")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rollout/tool_calls_per_traj"] >= 0 and r["actor/grad_norm"] > 0 for r in rows)
    dump = out / "rollouts" / "step_00004.jsonl"
    synced = rollout_errors(out / "global_step_3", dump)
    assert len(synced) > 50 and max(synced) < LOGP_TOL
    assert max(rollout_errors("smollm2-135m", dump)) > 10 * LOGP_TOL
