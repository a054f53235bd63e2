"""`benchmarks/gpu_check.py --device cpu --tiny`: the GPU check's code path, here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_runs_on_cpu_tiny(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device",
                        "cpu", "--tiny", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    checks = report["checks"]
    assert set(checks) >= {"engine_logprobs", "rl_arpo", "rl_appo", "tree_forward",
                           "fsdp_resume"}
    assert all(c["ok"] for c in checks.values()), checks
    # The CPU promise: the resumed step equals the uninterrupted one bit for bit.
    assert checks["fsdp_resume"]["bit_exact"] and checks["fsdp_resume"]["resumed_step"] == 2
    assert checks["engine_logprobs"]["max_abs_diff"] < 1e-3
    assert checks["rl_appo"]["step1"]["rollout/branches"] > 0
    # The tree forward computed fewer tokens than the flat one, and agreed with it.
    tree = checks["tree_forward"]
    assert tree["branches"] > 0
    assert tree["tree"]["computed_tokens"] < tree["flat"]["computed_tokens"]
    assert tree["grad_rel_diff"] < 1e-4
    assert (tmp_path / "gpu_check.md").read_text().startswith("# appo GPU check")
