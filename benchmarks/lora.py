"""One RL step on SmolLM2-135M (float32, CPU): LoRA vs full fine-tuning, in one script run.

Two children run side by side (each process's peak RSS is its own; they share the machine's
load), the same work: grpo, 2 prompts x 8
trajectories of up to 64 tokens of `synth:arith` (the `math` template, the python tool), one PPO
epoch, a KL term (`actor.use_kl_loss=true`, low_var_kl, coef 1e-3) so the reference policy's
cost shows: full fine-tuning keeps a frozen copy of the model, LoRA switches its adapter
off. LoRA: `model.lora_rank=16 model.lora_alpha=32`, all linear layers. Reported: trainable
parameters, peak RSS, the median over the timed steps (after one warm-up step) of the step's
wall time and its phases, and LoRA's re-merge time (inside the rollout phase).

    .venv/bin/python benchmarks/lora.py            # writes results/lora.md
    .venv/bin/python benchmarks/lora.py --quick    # tiny-test, 1 timed step, no write
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "lora.md"
MODES = {"full": [], "lora": ["model.lora_rank=16", "model.lora_alpha=32"]}


def worker(args) -> dict:
    import torch

    from appo.config import load_config
    from appo.trainer.loop import RLTrainer

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, [
            f"model.path={args.model}", "data.template=math", "tools.enabled=[python]",
            "data.train_files=['synth:arith?split=train&levels=1,2,3&n=64']",
            "data.val_files=[]", "data.shuffle=false", "data.max_prompt_length=2048", "data.train_batch_size=2",
            f"data.max_response_length={args.response_len}", "rollout.strategy=grpo",
            "rollout.n=8", "rollout.initial_rollouts=8", "actor.optim.lr=1e-5",
            "actor.ppo_mini_batch_size=2", "actor.use_kl_loss=true", "actor.kl_loss_coef=1e-3",
            "trainer.total_steps=100", "trainer.logger=[]", f"trainer.default_local_dir={tmp}",
            *MODES[args.worker]])
        trainer = RLTrainer(cfg, progress=False)
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        steps = []
        for i in range(1 + args.steps):
            t0 = time.perf_counter()
            m = trainer.train_step()
            m["wall"] = time.perf_counter() - t0
            trainer.step += 1
            if i > 0:
                steps.append(m)
        trainer.tools.close()
    keys = ["wall", "time/rollout", "time/ref_logp", "time/update", "time/lora_merge",
            "rollout/response_len"]
    out = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys}
    out["step_walls"] = [s["wall"] for s in steps]
    out["trainable"] = trainable
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--worker", choices=list(MODES), help=argparse.SUPPRESS)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--response-len", type=int, default=64)
    args = p.parse_args()
    if args.quick:
        args.model, args.steps = "tiny-test", 1
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    # Both children at the same time: on a machine shared with other jobs they then see the
    # same background load, which a run one after the other would not guarantee.
    procs = {mode: subprocess.Popen(
        [sys.executable, __file__, "--worker", mode, "--model", args.model, "--steps",
         str(args.steps), "--response-len", str(args.response_len)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for mode in MODES}
    results = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate()
        lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise SystemExit(f"{mode} failed ({proc.returncode}):\n{stderr[-3000:]}")
        results[mode] = json.loads(lines[-1][len("RESULT "):])
        print(mode, results[mode], flush=True)
    f, lo = results["full"], results["lora"]
    rows = [
        ("trainable parameters", f"{f['trainable']:,}", f"{lo['trainable']:,}"),
        ("peak RSS (MB)", f"{f['peak_rss_mb']:.0f}", f"{lo['peak_rss_mb']:.0f}"),
        ("step wall (s, median)", f"{f['wall']:.2f}", f"{lo['wall']:.2f}"),
        ("  rollout (s)", f"{f['time/rollout']:.2f}", f"{lo['time/rollout']:.2f}"),
        ("  of which LoRA re-merge (s)", "-", f"{lo['time/lora_merge']:.3f}"),
        ("  reference log-probs (s)", f"{f['time/ref_logp']:.2f}", f"{lo['time/ref_logp']:.2f}"),
        ("  update (s)", f"{f['time/update']:.2f}", f"{lo['time/update']:.2f}"),
        ("response length (tokens, median)", f"{f['rollout/response_len']:.1f}",
         f"{lo['rollout/response_len']:.1f}"),
    ]
    table = "\n".join(["| | full fine-tuning | LoRA r=16 |", "| --- | --- | --- |"]
                      + [f"| {a} | {b} | {c} |" for a, b, c in rows])
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    text = (f"# LoRA vs full fine-tuning, one RL step ({when})\n\n"
            f"`{' '.join([Path(sys.executable).name, *sys.argv])}` on {platform.machine()}, "
            f"{platform.processor() or 'CPU'}; step walls full {f['step_walls']}, "
            f"LoRA {lo['step_walls']}\n\n{table}\n")
    print(text)
    if not args.quick:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
