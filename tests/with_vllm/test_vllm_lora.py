"""`appo train rollout.name=vllm model.lora_rank=16` (the session's tiny
model, `tiny_llama.py`): the vllm engine serves the
merged weights (base names, synced like full weights after each update), so step 2's
rollouts have the log-probs of the step-1 merged checkpoint under an HF forward, and not
those of the base model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_train_run import LOGP_TOL, rollout_errors, train

pytestmark = pytest.mark.vllm


def test_lora_train_syncs_merged_weights(tmp_path, tiny_llama_dir):
    out = tmp_path / "run"
    # lr 2e-3: Adam moves each entry of B by ~lr per step, enough for the adapted policy's
    # log-probs to leave the base model's by far more than the tolerance after one step.
    run = train(out, tiny_llama_dir, "trainer.total_steps=2", "model.lora_rank=16", "model.lora_alpha=32",
                "model.lora_save_merged=true", "actor.optim.lr=2e-3")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("time/lora_merge" in r for r in rows)
    merged = out / "global_step_1" / "merged"
    assert (out / "global_step_1" / "adapter_model.safetensors").is_file()
    dump = out / "rollouts" / "step_00002.jsonl"
    synced = rollout_errors(merged, dump)
    assert len(synced) > 50 and max(synced) < LOGP_TOL, max(synced)
    assert max(rollout_errors(tiny_llama_dir, dump)) > 10 * LOGP_TOL
    assert Path(out / "global_step_2" / "adapter_config.json").is_file()
