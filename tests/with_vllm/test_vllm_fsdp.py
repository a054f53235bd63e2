"""`appo train rollout.name=vllm trainer.parallel=fsdp` on two ranks from the command line: each
rank's engine inside the rank, no whole copy of the policy kept (a meta skeleton), the policy
streamed into vLLM from the FSDP shards after a resume (the same sync as after every
update). The resumed step's rollouts must come from the checkpoint it resumed: their recorded
log-probs equal an HF forward of that checkpoint, not of the base model.

The checkpoint resumed is written by a one-process run on the hf engine: a checkpoint resumes
in any layout and world size (tests/trainer/test_resume_layouts.py), and what is under test
here is the FSDP launch that resumes it. A two-process vLLM launch for step 1 only repeated
the second launch's start-up (an engine per rank) for nothing this test checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_train_run import HANG_TIMEOUT_S, LOGP_TOL, TRAIN_ARGS, rollout_errors, train

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]


def launch(out: Path, model: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(REPO / "configs" / "accelerate" / "cpu_2proc.yaml"), "-m", "appo.cli", "train",
           f"model.path={model}", *TRAIN_ARGS, "trainer.parallel=fsdp", "rollout.kv_cache_gib=0.5",
           f"trainer.default_local_dir={out}", f"trainer.rollout_data_dir={out / 'rollouts'}",
           *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=HANG_TIMEOUT_S)


def test_fsdp_ranks_stream_from_the_shards_after_a_resume(tmp_path, tiny_llama_dir):
    """Step 1, saved (one process, hf engine); then a resumed two-rank FSDP run's step 2. Its
    rollouts come from the step-1 weights: loaded into the shards by the resume (through the
    meta skeleton) and streamed into each rank's engine, the same sync that follows every
    update (`sync_rollout_weights`)."""
    out = tmp_path / "run"
    first = train(out, tiny_llama_dir, "rollout.name=hf", "trainer.total_steps=1")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    second = launch(out, tiny_llama_dir, "trainer.total_steps=2", "trainer.resume=true")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-4000:]
    assert "Invalid process group" not in second.stderr  # vLLM's exit after appo's group
    assert (out / "global_step_2" / "config.json").is_file()  # saved from the shards
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/trajectories"] == 8 for r in rows)  # both ranks' rows at step 2
    dump = out / "rollouts" / "step_00002.jsonl"
    synced = rollout_errors(out / "global_step_1", dump)
    assert len(synced) > 20 and max(synced) < LOGP_TOL, max(synced)
    assert max(rollout_errors(tiny_llama_dir, dump)) > 10 * LOGP_TOL
