"""Weight sync into vLLM per step: streamed (in this process) against the file route.

    .venv-vllm/bin/python benchmarks/weight_sync.py [--repeats 3]

The policy (SmolLM2-135M, float32) goes into an in-process `vllm.LLM` through
`VLLMEngine.sync_weights`, each way `--repeats` times, alternating:
- streamed: one tensor at a time through `reload_weights(weights_iterator=...)`, in the
  engine's dtype; what an engine in the trainer's process (or colocated in each rank on
  GPUs) does;
- file: the whole state saved as safetensors into a temporary directory, then
  `reload_weights(weights_path=...)`; what every engine under DDP/FSDP did before (and what
  an engine core in a child process, vLLM's CPU build under DDP/FSDP, still does).
Reports seconds per sync (median) and bytes written to disk per sync, and checks that both
leave vLLM's log-probs equal (the same weights arrive). Writes
`benchmarks/results/weight_sync.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

if __name__ == "__main__":
    import torch

    from appo.config import load_config
    from appo.models import load_model
    from appo.rollout import vllm_server
    from appo.rollout.vllm_engine import VLLMEngine, start_llm

    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    cfg = load_config(overrides=["model.path=smollm2-135m", "rollout.name=vllm",
                                 "rollout.kv_cache_gib=1"])
    lm = load_model("smollm2-135m", device="cpu")
    t0 = time.perf_counter()
    engine = VLLMEngine(start_llm(cfg), lm.tokenizer)
    startup = time.perf_counter() - t0
    written: list[int] = []
    real_save = vllm_server.save_state

    def counting_save(model, path):
        real_save(model, path)
        written.append(sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()))

    vllm_server.save_state = counting_save

    def logprobs() -> list[float]:
        from vllm import SamplingParams

        ids = lm.tokenizer.encode("The weight sync check: 2 + 2 =")
        out = engine.llm.generate([{"prompt_token_ids": ids}],
                                  SamplingParams(max_tokens=8, temperature=0.0, logprobs=1),
                                  use_tqdm=False)[0].outputs[0]
        return [next(iter(step.values())).logprob for step in out.logprobs]

    times: dict[str, list[float]] = {"streamed": [], "file": []}
    ref = None
    for _ in range(args.repeats):
        for route in ("streamed", "file"):
            engine.in_process = route == "streamed"
            n_before = len(written)
            t = time.perf_counter()
            engine.sync_weights(lm.model)
            times[route].append(time.perf_counter() - t)
            assert (len(written) > n_before) == (route == "file")
            lp = logprobs()
            ref = ref or lp
            assert max(abs(a - b) for a, b in zip(lp, ref, strict=True)) < 1e-4, (route, lp, ref)
    engine.in_process = True
    result = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "model": "SmolLM2-135M float32", "repeats": args.repeats,
        "vllm_startup_s": round(startup, 1),
        "streamed_s_median": round(statistics.median(times["streamed"]), 3),
        "file_s_median": round(statistics.median(times["file"]), 3),
        "streamed_bytes_written": 0,
        "file_bytes_written": int(statistics.median(written)),
        "times": times,
    }
    out = Path(__file__).resolve().parent / "results" / "weight_sync.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
