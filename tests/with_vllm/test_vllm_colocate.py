"""Two trainer ranks (gloo), each with its own vLLM engine inside it through vLLM's external
launcher (`appo.rollout.vllm_engine.start_llm` under a process group), as on GPUs: each
rank's policy streamed into its own engine with no file, and its log-probs equal to an HF
forward of that rank's weights. Sleep mode is CUDA-only in vLLM (its CPU platform reports
none): its calls are checked with recording fakes (tests/rollout/test_vllm_colocate.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_train_run import HANG_TIMEOUT_S

pytestmark = pytest.mark.vllm
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LOGP_TOL = 5e-4  # as tests/with_vllm/test_vllm_engine.py (float32, different kernels)


def test_two_ranks_each_stream_their_policy_into_their_own_engine(tmp_path, tiny_llama_dir):
    """One launch, two checks on each rank's engine: `whole`, each rank its own policy;
    `fsdp`, one policy sharded over the two ranks, each engine gathering every parameter
    from the shards as it loads it."""
    cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
           str(REPO / "configs" / "accelerate" / "cpu_2proc.yaml"),
           str(HERE / "colocate_worker.py"), str(tmp_path), str(tiny_llama_dir)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    for layout in ("whole", "fsdp"):
        ranks = [json.loads((tmp_path / f"{layout}{i}.json").read_text()) for i in (0, 1)]
        assert ranks[0]["pid"] != ranks[1]["pid"]
        for res in ranks:
            assert res["in_process"], res  # the engine lives in the rank: no child process
            assert res["base_err"] < LOGP_TOL, res
            assert res["stale_err"] > 10 * LOGP_TOL, res  # the change is visible ...
            assert res["synced_err"] < LOGP_TOL, res  # ... and the sync carried it
            assert res["created"] == [] and res["syncs"] == 1, res  # no file written
