"""Where the memory of `appo demo` goes: resident set size by phase, on SmolLM2-135M.

Runs the demo's configuration (`appo.trainer.demo.demo_config`) shortened, in a child
process per variant so every variant's peak is its own: load the model and build the
trainer, evaluate `--eval` held-out questions (greedy, python tool), `--sft-steps` SFT steps,
`--steps` ARPO steps. A sampler thread reads the process's RSS every 5 ms and keeps, per
phase, the RSS at its start, at its end and its peak; the RL step's phases are the trainer's
own (`StepTimer`: rollout / reward / advantage / ref_logp / old_logp / update). Tensor
accounting next to it: parameters, gradients, AdamW states, engine buffers.

    .venv/bin/python benchmarks/memory.py                       # demo settings
    .venv/bin/python benchmarks/memory.py --set actor.ppo_max_token_len_per_device=1024
    .venv/bin/python benchmarks/memory.py --variants base,"x:actor.foo=1"   # several, one run
    .venv/bin/python benchmarks/memory.py --part1 --eval 0 --sft-steps 0   # train_step.py (1)

Figures go to stdout as a Markdown table (and JSON with --json FILE); copy them into
benchmarks/RESULTS.md with the command, date and machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


class PhaseMemory:
    """RSS sampled in a thread; `with mem.phase(name)` attributes samples to `name`."""

    def __init__(self, interval: float = 0.005, progress: str = ""):
        self.interval = interval
        self.progress = progress
        self.rows: list[dict] = []
        self._current: dict | None = None
        self._started = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            cur = self._current
            if cur is not None:
                cur["peak"] = max(cur["peak"], rss_mb())
            time.sleep(self.interval)

    @contextlib.contextmanager
    def phase(self, name: str):
        outer = self._current
        now = rss_mb()
        self._started += 1
        row = {"phase": name, "start": now, "peak": now, "end": now, "order": self._started}
        self._current = row
        t0 = time.perf_counter()
        try:
            yield row
        finally:
            row["end"] = rss_mb()
            row["peak"] = max(row["peak"], row["end"])
            row["seconds"] = time.perf_counter() - t0
            self.rows.append(row)
            if self.progress:  # a long run shows its phases as they finish
                with open(self.progress, "a") as f:
                    f.write(json.dumps(row) + "\n")
            self._current = outer
            if outer is not None:
                outer["peak"] = max(outer["peak"], row["peak"])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def tensor_mb(tensors) -> float:
    seen, total = set(), 0
    for t in tensors:
        if t is None or not hasattr(t, "untyped_storage"):
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total / 2**20


def accounting(trainer) -> dict[str, float]:
    model = trainer.model
    params = list(model.parameters())
    out = {
        "parameters": tensor_mb(params),
        "gradients": tensor_mb(p.grad for p in params),
        "adamw_states": tensor_mb(v for st in trainer.optimizer.state.values()
                                  for v in st.values()),
    }
    if trainer.ref_model is not None:
        out["ref_model"] = tensor_mb(trainer.ref_model.parameters())
    engine_tensors = []
    for obj in vars(trainer.engine).values():
        for v in (obj if isinstance(obj, (list, tuple)) else [obj]):
            if hasattr(v, "untyped_storage"):
                engine_tensors.append(v)
    out["engine_own_tensors"] = tensor_mb(engine_tensors)
    return out


def child(args) -> dict:
    import torch

    from appo.trainer import metrics as metrics_mod
    from appo.trainer.demo import demo_config

    torch.set_num_threads(2)
    mem = PhaseMemory(progress=args.progress)
    tmp = tempfile.mkdtemp(prefix="appo-mem-")
    overrides = [f"trainer.default_local_dir={tmp}/rl", f"sft.output_dir={tmp}/sft",
                 f"trainer.rollout_data_dir={tmp}/rl/rollouts", "trainer.logger=[jsonl]",
                 f"trainer.total_steps={args.steps}", f"sft.max_steps={args.sft_steps}",
                 *args.set]
    if args.part1:  # benchmarks/train_step.py part (1): the library's defaults
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from train_step import appo_config

        cfg = appo_config("smollm2-135m", True, 256, "arpo", tmp,
                          extra=tuple(o for o in overrides if not o.startswith("sft.")))
    else:
        cfg = demo_config(None, overrides)
    base = rss_mb()
    with mem.phase("load"):
        from appo.models import load_model
        from appo.trainer.loop import RLTrainer

        lm = load_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device)
        trainer = RLTrainer(cfg, lm=lm, progress=False)
    acc = {"after_load": accounting(trainer)}
    if args.eval:
        with mem.phase("eval"):
            trainer.evaluate(trainer.val_data[-args.eval:], "eval", 1, n=1)
    if args.sft_steps:
        from appo.trainer.demo import _sft_stage

        with mem.phase("sft"):
            _sft_stage(trainer, cfg)
    # The trainer's own phases, attributed through its StepTimer.
    orig_measure = metrics_mod.StepTimer.measure

    def measure(self, name):
        timer_ctx = orig_measure(self, name)

        @contextlib.contextmanager
        def both():
            with mem.phase(f"rl/{name}"), timer_ctx:
                yield
        return both()

    metrics_mod.StepTimer.measure = measure
    steps = []
    for i in range(args.steps):
        with mem.phase(f"rl step {i + 1}"):
            m = trainer.train_step()
        trainer.step += 1
        steps.append({k: v for k, v in m.items()
                      if k.startswith(("time/", "response_length", "perf/"))})
    acc["after_rl"] = accounting(trainer)
    mem.close()
    return {"baseline_mb": base, "phases": mem.rows, "accounting": acc, "steps": steps,
            "peak_mb": max(r["peak"] for r in mem.rows)}


def table(name: str, res: dict) -> str:
    lines = [f"### {name}: peak {res['peak_mb']:.0f} MB (interpreter + imports "
             f"{res['baseline_mb']:.0f} MB)", "",
             "| phase | s | RSS start MB | peak MB | end MB | peak - start MB |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(res["phases"], key=lambda r: r.get("order", 0)):
        lines.append(f"| {r['phase']} | {r['seconds']:.1f} | {r['start']:.0f} | {r['peak']:.0f}"
                     f" | {r['end']:.0f} | {r['peak'] - r['start']:.0f} |")
    lines += ["", "| tensors (MB) | " + " | ".join(res["accounting"]) + " |",
              "| --- | " + " | ".join("---:" for _ in res["accounting"]) + " |"]
    keys = sorted({k for v in res["accounting"].values() for k in v})
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(f"{v.get(k, 0):.0f}"
                                              for v in res["accounting"].values()) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--sft-steps", type=int, default=2)
    p.add_argument("--eval", type=int, default=32, help="held-out questions (0: skip)")
    p.add_argument("--set", action="append", default=[], help="a config override (repeat)")
    p.add_argument("--variants", default="",
                   help="comma-separated NAME:key=value;key=value variants, each in a child")
    p.add_argument("--json", default="")
    p.add_argument("--part1", action="store_true",
                   help="benchmarks/train_step.py part (1)'s setting instead of the demo's")
    p.add_argument("--progress", default="", help="append each finished phase to this JSONL")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        res = child(args)
        print("RESULT " + json.dumps(res))
        return
    variants = [("default", [])]
    if args.variants:
        variants = []
        for spec in args.variants.split(","):
            name, _, sets = spec.partition(":")
            variants.append((name, [s for s in sets.split(";") if s]))
    out = {}
    for name, sets in variants:
        cmd = [sys.executable, __file__, "--child", "--steps", str(args.steps),
               "--sft-steps", str(args.sft_steps), "--eval", str(args.eval)]
        if args.part1:
            cmd.append("--part1")
        if args.progress:
            cmd += ["--progress", args.progress]
        for s in args.set + sets:
            cmd += ["--set", s]
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        result = next((ln[7:] for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")),
                      None)
        if proc.returncode or result is None:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"variant {name} failed")
        res = json.loads(result)
        out[name] = res
        print(table(name, res), flush=True)
        print(flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
