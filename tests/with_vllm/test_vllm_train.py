"""`appo train rollout.name=vllm` from the command line (the session's tiny model,
`tiny_llama.py`) with the python tool:
3 steps, then a resume to step 4. The resumed run's rollouts must come from the step-3
checkpoint's weights (the engine loads `model.path`, so without the weight sync after resume
they would come from the base model): their recorded log-probs equal an HF forward of the
checkpoint, and not of the base model.
"""

from __future__ import annotations

import json

import pytest
from vllm_train_run import LOGP_TOL, rollout_errors, train

pytestmark = pytest.mark.vllm


def test_train_three_steps_then_resume(tmp_path, tiny_llama_dir):
    out = tmp_path / "run"
    first = train(out, tiny_llama_dir, "trainer.total_steps=3")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    second = train(out, tiny_llama_dir, "trainer.total_steps=4", "trainer.resume=true")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["rollout/tool_calls_per_traj"] >= 0 and r["actor/grad_norm"] > 0 for r in rows)
    dump = out / "rollouts" / "step_00004.jsonl"
    synced = rollout_errors(out / "global_step_3", dump)
    assert len(synced) > 50 and max(synced) < LOGP_TOL
    assert max(rollout_errors(tiny_llama_dir, dump)) > 10 * LOGP_TOL
