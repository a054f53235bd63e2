"""RL step cost on SmolLM2-135M (float32, CPU), and the same GRPO work on TRL's GRPOTrainer.

Two parts, each in its own child process (so each framework's peak RSS is its own), in one
script run:

(1) appo, 16 trajectories of up to 256 tokens: `appo.trainer.loop.RLTrainer.train_step` with
    arpo (n=8, 4 initial), the python tool, 2 prompts of `synth:arith` per step; seconds per
    step split by phase (rollout / reward / advantage / update), rollout and training
    tokens/s, peak RSS. Median over the timed steps after a warm-up step.
(2) appo vs TRL `GRPOTrainer` on the same work: same model and prompts (the `math` template
    with no tools), 2 prompts x 8 completions of up to 64 new tokens, temperature 1, grpo,
    one PPO epoch (one optimizer step per step), no KL term (TRL's default beta=0), lr 1e-6.
    Per-step wall time from a callback (TRL) or around `train_step` (appo); one warm-up step,
    then the median of 3 steps; the ratio TRL / appo is the speed-up.

TRL is a benchmark-only extra (`pip install -e '.[bench]'`, or `make bench`); without it
part (2) reports that TRL is missing. Torch uses 2 threads in both children (`--threads`).

    .venv/bin/python benchmarks/train_step.py            # full run, writes results/train_step.md
    .venv/bin/python benchmarks/train_step.py --quick    # tiny-test model, 1 timed step, no write
    .venv/bin/python benchmarks/train_step.py --part 2 --base ../appo-base  # before / after

`--base TREE` adds a third part-(2) worker, `appo-base`: the same appo worker with TREE's `src`
first on the path (a git worktree of the commit before a change), run in the same script
run, so a change's effect on the step is a ratio of two figures taken side by side.
`--part 2` skips part (1) (and writes no results file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "train_step.md"
MACHINE = "2-core x86_64 CPU, 24 GiB, torch 2.13.0 CPU"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def no_tool_prompts(out: str) -> str:
    """The same arith questions as a JSONL file whose prompts describe no tools (the synth
    loader insists on the python tool its gold demos use)."""
    from appo.data import load_rl_data
    from appo.data.templates import build_messages

    examples = load_rl_data("synth:arith?split=train&levels=1,2,3&n=64", template="math",
                            tools=["python"]).examples
    path = Path(out) / "arith_no_tools.jsonl"
    with path.open("w") as f:
        for ex in examples:
            f.write(json.dumps({"prompt": build_messages(ex.question, "math", []),
                                "answer": ex.ground_truth, "data_source": ex.data_source,
                                "ability": "math"}) + "\n")
    return str(path)


def appo_config(model: str, tools: bool, response_len: int, strategy: str, out: str,
                prompts: int = 2, n: int = 8, extra: tuple[str, ...] = ()):
    from appo.config import load_config

    train = ("synth:arith?split=train&levels=1,2,3&n=64" if tools else no_tool_prompts(out))
    over = [
        f"model.path={model}",
        "data.template=math",
        f"data.train_files=['{train}']",
        "data.val_files=[]",
        "data.shuffle=false",
        f"data.train_batch_size={prompts}",
        "data.max_prompt_length=2048",
        f"data.max_response_length={response_len}",
        "tools.enabled=[python]" if tools else "tools.enabled=[]",
        f"rollout.strategy={strategy}",
        f"rollout.n={n}",
        f"rollout.initial_rollouts={n // 2 if strategy == 'arpo' else n}",
        "rollout.temperature=1.0",
        "actor.optim.lr=1e-6",
        "actor.optim.lr_scheduler=constant",
        f"actor.ppo_mini_batch_size={prompts}",
        "actor.ppo_epochs=1",
        "trainer.total_steps=100",
        "trainer.logger=[]",
        f"trainer.default_local_dir={out}/run",  # `out` may hold the prompts file
    ]
    return load_config(None, over + list(extra))


def worker_appo(args) -> dict:
    import torch

    import appo
    from appo.trainer.loop import RLTrainer

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = appo_config(args.model, args.tools, args.response_len, args.strategy, tmp,
                          extra=tuple(args.set))
        trainer = RLTrainer(cfg, progress=False)
        steps = []
        for i in range(1 + args.steps):
            t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
            m = trainer.train_step()
            wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            trainer.step += 1
            if i > 0:  # the first step warms up allocators and the sandbox
                # CPU seconds of this process (the sandbox's children excluded): on a
                # shared machine a steadier measure of work than the wall clock.
                m.update(wall=wall, cpu_user=r1.ru_utime - r0.ru_utime,
                         cpu_sys=r1.ru_stime - r0.ru_stime)
                steps.append(m)
        trainer.tools.close()
        bounds = None if args.tools else step_bounds(trainer.model, steps)
    keys = ["wall", "cpu_user", "cpu_sys", "time/rollout", "time/reward", "time/advantage", "time/update",
            "perf/rollout_tokens_per_s", "perf/train_tokens_per_s", "rollout/trajectories",
            "rollout/response_len", "rollout/tool_calls_per_traj", "actor/prefix_saving",
            "actor/computed_tokens"]
    out = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in keys}
    out["step_walls"] = [s["wall"] for s in steps]
    out["peak_rss_mb"] = peak_rss_mb()
    out["appo_src"] = str(Path(appo.__file__).resolve().parent)  # which tree ran (--base)
    if bounds:
        out["bounds"] = bounds
    return out


def gemm_gflops(m: int, k: int, n: int, backward: bool, repeats: int = 20) -> float:
    """This machine's float32 matmul rate (GFLOP/s, median of `repeats`) at `[m, k] @ [k, n]`,
    forward only or forward + both backward matmuls (what a trained linear layer costs)."""
    import torch

    x = torch.randn(m, k, requires_grad=backward)
    w = torch.randn(n, k, requires_grad=backward)
    rates = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        out = torch.nn.functional.linear(x, w)
        if backward:
            out.backward(torch.ones_like(out))
        rates.append((6 if backward else 2) * m * k * n / (time.perf_counter() - t0) / 1e9)
    return statistics.median(rates[2:])


def step_bounds(model, steps: list[dict]) -> dict:
    """What bounds the GRPO step: the update's and the decode's matmul work (FLOPs from the
    parameter counts; attention and elementwise work left out, so these are lower bounds)
    against this machine's matmul rate at their shapes, measured here."""
    emb = model.get_input_embeddings().weight
    n_head = emb.numel()  # SmolLM2 ties the LM head to the embeddings
    n_body = sum(p.numel() for p in model.parameters()) - n_head
    hidden = emb.shape[1]
    inter = getattr(model.config, "intermediate_size", 4 * hidden)
    computed = statistics.median(s["actor/computed_tokens"] for s in steps)
    rows = statistics.median(s["rollout/trajectories"] for s in steps)
    response = rows * statistics.median(s["rollout/response_len"] for s in steps)
    budget = int(min(computed, 1024))
    update_gflop = 6 * (n_body * computed + n_head * response) / 1e9
    decode_gflop = 2 * (n_body + n_head) * response / 1e9
    train_rate = gemm_gflops(budget, hidden, inter, backward=True)
    decode_rate = gemm_gflops(int(rows), hidden, inter, backward=False, repeats=200)
    return {"update_gflop": update_gflop, "decode_gflop": decode_gflop,
            "gemm_train_gflops": train_rate, "gemm_decode_gflops": decode_rate,
            "gemm_train_shape": [budget, hidden, inter], "gemm_decode_shape": [int(rows),
                                                                               hidden, inter],
            "update_gflops_achieved": update_gflop / statistics.median(
                s["time/update"] for s in steps),
            "decode_floor_s": decode_gflop / decode_rate,
            "update_floor_s": update_gflop / train_rate}


def worker_trl(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as e:
        return {"missing": f"TRL not installed ({e}); pip install -e '.[bench]'"}
    import trl

    from appo.data import rl_data_from_config
    from appo.models import load_model

    lm = load_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = appo_config(args.model, False, args.response_len, "grpo", tmp)
        examples = rl_data_from_config(cfg, "train", lm.tokenizer).examples
        # appo's step k uses prompts [2k, 2k+2) of the same (unshuffled) list.
        rows = [{"prompt": ex.prompt} for ex in examples[: 2 * (1 + args.steps)]]
        dataset = Dataset.from_list(rows)

        def length_reward(completions, **_):
            return [float(len(c[0]["content"]) % 7) for c in completions]

        class Timer(TrainerCallback):
            def __init__(self):
                self.walls, self.t0 = [], None

            def on_step_begin(self, *a, **k):
                self.t0 = time.perf_counter()

            def on_step_end(self, *a, **k):
                self.walls.append(time.perf_counter() - self.t0)

        timer = Timer()
        config = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, fp16=False,
            per_device_train_batch_size=16, num_generations=8, gradient_accumulation_steps=1,
            max_completion_length=args.response_len, temperature=1.0, top_p=1.0,
            num_iterations=1, beta=0.0, learning_rate=1e-6, lr_scheduler_type="constant",
            max_steps=1 + args.steps, logging_steps=1, report_to="none", save_strategy="no",
            shuffle_dataset=False, dataloader_num_workers=0, seed=0,
        )
        trainer = GRPOTrainer(model=lm.model, reward_funcs=length_reward, args=config,
                              train_dataset=dataset, processing_class=lm.tokenizer,
                              callbacks=[timer])
        trainer.train()
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history
                   if "completions/mean_length" in h]
    timed = timer.walls[1:]
    return {"wall": statistics.median(timed), "step_walls": timed, "peak_rss_mb": peak_rss_mb(),
            "completion_len": statistics.median(lengths[1:]) if len(lengths) > 1 else None,
            "trl_version": trl.__version__}


def run_child(kind: str, extra: list[str], src: Path | None = None) -> dict:
    """One worker in its own process; `src` puts another appo tree first on its path."""
    cmd = [sys.executable, __file__, "--worker", kind, *extra]
    env = None
    if src is not None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(src)] + [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{kind} worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny-test model, 1 timed step")
    p.add_argument("--worker", choices=["appo", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--strategy", default="grpo")
    p.add_argument("--tools", action="store_true")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the workers")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="appo config override for the appo workers (repeatable)")
    p.add_argument("--part1-json", help="reuse part (1) from an earlier run (its printed JSON)")
    p.add_argument("--part", choices=["all", "2"], default="all",
                   help="2: part (2) only (no results file written)")
    p.add_argument("--base", type=Path, help="an appo checkout (a worktree of the commit "
                   "before a change): part (2) also runs its appo, as worker appo-base")
    args = p.parse_args()
    if args.base is not None and not (args.base / "src" / "appo").is_dir():
        raise SystemExit(f"--base {args.base}: no src/appo there (expected an appo checkout)")
    if args.worker:
        result = worker_appo(args) if args.worker == "appo" else worker_trl(args)
        print("RESULT " + json.dumps(result), flush=True)
        return
    model = "tiny-test" if args.quick else args.model
    steps = "1" if args.quick else str(args.steps)
    common = ["--model", model, "--steps", steps, "--threads", str(args.threads)]
    appo_common = common + [f"--set={x}" for x in args.set]
    if args.part == "2":
        part1 = None
    elif args.part1_json:
        part1 = json.loads(Path(args.part1_json).read_text())
    else:
        part1 = run_child("appo", appo_common + ["--response-len", "256", "--strategy", "arpo",
                                            "--tools"])
    if part1 is not None:
        print("part 1 (appo, arpo + python, 16 x 256):", json.dumps(part1), flush=True)
    part2 = appo_common + ["--response-len", "64", "--strategy", "grpo"]
    appo2 = run_child("appo", part2)
    print("part 2 appo:", json.dumps(appo2), flush=True)
    if args.base is not None:
        base2 = run_child("appo", part2, src=(args.base / "src").resolve())
        print(f"part 2 appo-base ({args.base}):", json.dumps(base2), flush=True)
        print(f"part 2: appo-base / appo per step = {base2['wall'] / appo2['wall']:.2f}x "
              f"(rollout {base2['time/rollout'] / appo2['time/rollout']:.2f}x, update "
              f"{base2['time/update'] / appo2['time/update']:.2f}x)", flush=True)
    trl2 = run_child("trl", common + ["--response-len", "64"])
    print("part 2 trl:", json.dumps(trl2), flush=True)
    if "wall" in trl2:
        print(f"part 2: TRL / appo per step = {trl2['wall'] / appo2['wall']:.2f}x", flush=True)
    if not args.quick and part1 is not None:
        write_results(part1, appo2, trl2)


def write_results(part1: dict, appo2: dict, trl2: dict) -> None:
    def f(x, nd=1):
        return "-" if x is None else f"{x:.{nd}f}"

    lines = [
        "# RL step benchmarks", "",
        f"Machine: {MACHINE} ({platform.processor() or platform.machine()}). "
        f"Date: {datetime.date.today()}.", "",
        "Command: `.venv/bin/python benchmarks/train_step.py` (TRL from `pip install -e "
        "'.[bench]'`). Wall-clock seconds, medians of 3 steps after 1 warm-up step.", "",
        "## (1) appo RL step on SmolLM2-135M: arpo + python, 2 prompts x 8 trajectories, "
        "up to 256 response tokens", "",
        "| phase | seconds |", "| --- | --- |",
    ]
    for k in ("time/rollout", "time/reward", "time/advantage", "time/update"):
        lines.append(f"| {k.split('/')[1]} | {f(part1[k], 2)} |")
    lines += [
        f"| whole step | {f(part1['wall'], 2)} |", "",
        f"- trajectories per step {f(part1['rollout/trajectories'], 0)}, mean response "
        f"{f(part1['rollout/response_len'])} tokens, tool calls per trajectory "
        f"{f(part1['rollout/tool_calls_per_traj'], 2)}",
        f"- rollout {f(part1['perf/rollout_tokens_per_s'])} sampled tokens/s; update "
        f"{f(part1['perf/train_tokens_per_s'])} tokens/s (prompt+response tokens of all rows; "
        f"the shared-prefix forward skipped {part1['actor/prefix_saving']:.0%} of them)",
        f"- peak RSS {part1['peak_rss_mb']:.0f} MB (target < 8192 MB)", "",
        "## (2) the same GRPO step in appo and in TRL's GRPOTrainer", "",
        "2 prompts x 8 completions, up to 64 new tokens, temperature 1, no tools, grpo, one "
        "PPO epoch, beta 0, SmolLM2-135M float32 on CPU, 2 torch threads each.", "",
    ]
    if "missing" in trl2:
        lines += [f"TRL: {trl2['missing']}", ""]
    else:
        ratio = trl2["wall"] / appo2["wall"]
        lines += [
            "| | seconds per step (median) | steps | mean completion tokens | peak RSS MB |",
            "| --- | --- | --- | --- | --- |",
            f"| appo | {f(appo2['wall'], 2)} | {', '.join(f(x, 1) for x in appo2['step_walls'])}"
            f" | {f(appo2['rollout/response_len'])} | {appo2['peak_rss_mb']:.0f} |",
            f"| TRL {trl2['trl_version']} GRPOTrainer | {f(trl2['wall'], 2)} | "
            f"{', '.join(f(x, 1) for x in trl2['step_walls'])} | {f(trl2['completion_len'])} | "
            f"{trl2['peak_rss_mb']:.0f} |", "",
            f"**appo is {ratio:.2f}x faster per step** (TRL median / appo median; target >= "
            "1.5x).", "",
            f"appo phases: rollout {f(appo2['time/rollout'], 2)} s, update "
            f"{f(appo2['time/update'], 2)} s (shared-prefix forward skipped "
            f"{appo2['actor/prefix_saving']:.0%} of the rows' tokens).", "",
        ]
        b = appo2.get("bounds")
        if b:
            floor = b["update_floor_s"] + b["decode_floor_s"]
            lines += [
                "What bounds the appo step (matmul work from the parameter counts, attention "
                "and elementwise work left out; this machine's float32 matmul rate measured in "
                "the same worker at the step's shapes):", "",
                f"- update: {f(b['update_gflop'])} GFLOP in {f(appo2['time/update'], 2)} s = "
                f"{f(b['update_gflops_achieved'])} GFLOP/s; matmul forward+backward at "
                f"{b['gemm_train_shape']}: {f(b['gemm_train_gflops'])} GFLOP/s, so at least "
                f"{f(b['update_floor_s'], 2)} s",
                f"- decode: {f(b['decode_gflop'])} GFLOP (every sampled token through every "
                f"weight); matmul at {b['gemm_decode_shape']}: {f(b['gemm_decode_gflops'])} "
                f"GFLOP/s, so at least {f(b['decode_floor_s'], 2)} s (rollout measured "
                f"{f(appo2['time/rollout'], 2)} s, prefill and sampling included)",
                f"- a step at these matmul rates: {f(floor, 2)} s; TRL's median / that = "
                f"{trl2['wall'] / floor:.2f}x, the most this step could gain over TRL without "
                "doing less arithmetic", "",
            ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
