"""Weight sync into vLLM per step: in-process (streamed vs file) and servers (group vs file).

    .venv-vllm/bin/python benchmarks/weight_sync.py [--repeats 3] [--part both|engine|server]

Engine part: the policy (SmolLM2-135M, float32) goes into an in-process `vllm.LLM` through
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

Server part: a `vllm serve` of the same model on 127.0.0.1 (CPU, appo's worker extension,
its own temp dir) gets the policy through `appo.rollout.server_sync.ServerWeightSync`,
alternating:
- group (`rollout.weight_transfer=group`): broadcast over a gloo group with the server's
  worker, in buckets, loaded in place; the first push also joins the group (timed apart);
- file (`rollout.weight_transfer=file`): safetensors into the weights dir, then the server's
  `reload_weights(weights_path=...)` (what server mode did before).
Each sync sends a changed policy (one MLP scaled by 2, then back), and the server's log-probs
of a fixed text are checked against an HF forward of the weights just sent (1e-3). Bytes
written to disk per sync: the kernel's `write_bytes` (/proc/PID/io) of this process and of
every process of the server, before and after. Writes
`benchmarks/results/weight_sync_server.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

SCORED = "The weight sync check: the capital of France is Paris, and 2 + 2 = 4."


def written_bytes(pids: list[int]) -> int:
    """Bytes these processes caused to be written to storage so far (/proc/PID/io)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/io").read_text().splitlines():
                if line.startswith("write_bytes:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def group_pids(pgid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getpgid(int(d.name)) == pgid:
                    pids.append(int(d.name))
            except OSError:
                pass
    return pids


def server_part(args, lm) -> dict:
    import signal
    import socket
    import subprocess
    import sys
    import tempfile
    import urllib.request

    import torch

    from appo.http import endpoint
    from appo.models.loader import converted_dir
    from appo.rollout.server_sync import ServerWeightSync
    from appo.rollout.vllm_server import wait_for_server

    model_dir = converted_dir("smollm2-135m")
    work = Path(tempfile.mkdtemp(prefix="appo-bench-server-"))
    (work / "server-tmp").mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = Path(__file__).resolve().parents[1] / "src"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_CI_ENV": os.environ.get("VLLM_CPU_CI_ENV", "1"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"),
           "TMPDIR": str(work / "server-tmp"),
           "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", "--seed", "0",
           "--worker-extension-cls", "appo.rollout.weight_group.WeightGroupExtension"]
    t0 = time.perf_counter()
    with open(work / "server.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, timeout=1800, poll_s=2.0, process=proc)
        startup = time.perf_counter() - t0
        model = lm.model
        ids = lm.tokenizer.encode(SCORED, add_special_tokens=False)
        param = model.get_parameter("model.layers.10.mlp.down_proj.weight")

        def gap() -> float:
            body = {"model": str(model_dir), "prompt": ids, "max_tokens": 1,
                    "prompt_logprobs": 0, "temperature": 0.0}
            req = urllib.request.Request(endpoint(url, "completions"),
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=900) as r:
                rows = json.loads(r.read())["choices"][0]["prompt_logprobs"]
            served = [row[str(t)]["logprob"] for t, row in zip(ids[1:], rows[1:], strict=True)]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].double()
            hf = torch.log_softmax(logits, -1)[:-1].gather(
                1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
            return max(abs(a - b) for a, b in zip(served, hf, strict=True))

        syncs = {"group": ServerWeightSync([url], None, "group"),
                 "file": ServerWeightSync([url], str(work / "rollout_weights"), "file")}
        times: dict[str, list[float]] = {"group": [], "file": []}
        written: dict[str, list[int]] = {"group": [], "file": []}
        gaps: list[float] = []
        first = {}
        for i in range(args.repeats + 1):
            for route in ("group", "file"):
                with torch.no_grad():  # a changed policy each time: x2, then back
                    param.mul_(2.0 if len(gaps) % 2 == 0 else 0.5)
                pids = [os.getpid(), *group_pids(proc.pid)]
                # write_bytes counts pages as they are dirtied: no sync needed
                before = written_bytes(pids)
                t = time.perf_counter()
                syncs[route].sync(model)
                seconds = time.perf_counter() - t
                after = written_bytes(pids)
                gaps.append(gap())
                assert gaps[-1] < 1e-3, (route, gaps[-1])
                if i == 0:  # the first push of each: the group's join, the file's first write
                    first[route] = (round(seconds, 3), after - before)
                    continue
                times[route].append(seconds)
                written[route].append(after - before)
        syncs["group"].close()
        return {
            "model": "SmolLM2-135M float32", "repeats": args.repeats,
            "server_startup_s": round(startup, 1),
            "group_s_median": round(statistics.median(times["group"]), 3),
            "file_s_median": round(statistics.median(times["file"]), 3),
            "group_bytes_written_median": int(statistics.median(written["group"])),
            "file_bytes_written_median": int(statistics.median(written["file"])),
            "group_bytes_sent": syncs["group"].bytes_sent[url],
            "first_push": first, "max_logprob_gap": max(gaps),
            "times": times, "bytes_written": written,
        }
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)


def machine() -> dict:
    import torch

    return {"date": time.strftime("%Y-%m-%d", time.gmtime()),
            "machine": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg()}


def engine_part(args, lm) -> None:
    import torch

    from appo.config import load_config
    from appo.rollout import vllm_server
    from appo.rollout.vllm_engine import VLLMEngine, start_llm

    cfg = load_config(overrides=["model.path=smollm2-135m", "rollout.name=vllm",
                                 "rollout.kv_cache_gib=1"])
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


if __name__ == "__main__":
    from appo.models import load_model

    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--part", choices=("both", "engine", "server"), default="both")
    args = p.parse_args()
    lm = load_model("smollm2-135m", device="cpu")
    if args.part in ("both", "engine"):
        engine_part(args, lm)
    if args.part in ("both", "server"):
        start = machine()
        result = {**start, **server_part(args, lm), "load_average_end": os.getloadavg()}
        out = Path(__file__).resolve().parent / "results" / "weight_sync_server.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result, indent=1))
