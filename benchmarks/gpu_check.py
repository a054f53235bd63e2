"""The GPU check: appo's training path on one CUDA device, offline, in a few minutes.

    python benchmarks/gpu_check.py                       # one GPU (an H100 / H200)
    python benchmarks/gpu_check.py --device cpu --tiny   # the same checks here (test suite)

Needs torch, transformers, accelerate, peft, pyarrow and appo's pure-Python dependencies;
no vLLM, no model download. The model is random-weight, shaped like Qwen2.5-0.5B (24 layers,
hidden 896, 14 heads, 2 KV heads, MLP 4864; `--tiny`: 2 layers, hidden 64), with appo's
byte-level test tokenizer, so the vocabulary is that tokenizer's (a few hundred ids), not
Qwen's 151,936. Training is bfloat16 over float32 master weights (`model.dtype=bfloat16`,
verl's FSDP actor's precision) on CUDA; float32 on CPU.

What it checks, each a named entry of `gpu_check.json` with `ok` and its figures:
- `engine_logprobs`: the hf engine's rollouts on the device; each sampled token's behaviour
  log-prob against a teacher-forced forward of the same ids by the trainer's own log-prob
  code (recompute noise: bfloat16 autocast against the engine's float32 decode on CUDA).
- `rl_arpo`, `rl_appo`: two RL steps each, gradient checkpointing on; finite losses,
  non-zero gradients, CUDA peak memory per phase, decoded and trained tokens/s.
- `tree_forward`: `actor.tree_forward` on an APPO rollout (branches share their responses):
  per group, the tree forward's log-probs and gradient against the flat forward's, with the
  time, computed tokens and CUDA peak of each.
- `fsdp_resume`: a process group of one rank (`cpu:gloo,cuda:nccl` on CUDA, as
  `appo.trainer.distributed` starts it), `trainer.parallel=fsdp` (FSDP2 with bfloat16
  all-gathers, the KL reference sharded, two epochs), two steps saved at each; a second run resumed from step 1 redoes step 2;
  its metrics and final weights against the uninterrupted run's.
- `memory_plan`: measured CUDA peaks against `appo plan`'s prediction for the same run,
  where the plan module is present.

Writes `gpu_check.json` and `gpu_check.md` to `--out`. Exit 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, rope_theta=10_000.0,
            rms_norm_eps=1e-6, tie_word_embeddings=True)

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # Learnable from random weights: the share of lowercase ASCII letters in the reply.
    text = solution_str or ""
    return sum(c.islower() and c.isascii() for c in text) / max(len(text), 1)
'''


def build_lm(arch: dict, device: str, seed: int):
    """A random-weight Qwen2 causal LM of `arch`'s shape on `device` (float32 masters), with
    the byte-level test tokenizer and its chat template."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from appo.models.loader import LoadedModel
    from appo.models.tiny import build_tiny

    tiny, tok = build_tiny()
    template = getattr(tok, "chat_template", None)
    del tiny
    config = Qwen2Config(**arch, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model.eval()
    return LoadedModel(model=model, tokenizer=tok, name="qwen2.5-0.5b-shaped (random)",
                       source="built in code", chat_template=template)


def write_data(root: Path, n: int) -> tuple[Path, Path]:
    data, reward = root / "prompts.jsonl", root / "reward.py"
    with data.open("w") as f:
        for i in range(n):
            row = {"prompt": [{"role": "system", "content": "Think, then answer."},
                              {"role": "user", "content": f"What is {i} + {i + 3}?"}],
                   "answer": str(2 * i + 3), "data_source": "gpu_check", "ability": "math"}
            f.write(json.dumps(row) + "\n")
    reward.write_text(REWARD)
    return data, reward


def make_config(args, root: Path, run: str, *overrides: str):
    from appo.config import load_config

    data, reward = root / "prompts.jsonl", root / "reward.py"
    cuda = args.device == "cuda"
    return load_config(overrides=[
        "model.path=gpu-check",
        f"model.dtype={'bfloat16' if cuda else 'float32'}",
        f"data.train_files=[{data}]",
        "data.val_files=[]",
        f"data.train_batch_size={args.prompts}",
        "data.max_prompt_length=256",
        f"data.max_response_length={args.response_len}",
        f"custom_reward_function.path={reward}",
        f"rollout.n={args.n}",
        f"rollout.initial_rollouts={max(1, args.n // 2)}",
        "tools.enabled=[]",
        f"actor.ppo_mini_batch_size={args.prompts}",
        "actor.optim.lr=1e-5",
        "actor.ppo_max_token_len_per_device=8192",
        "actor.activation_memory_gb=null",
        "rollout.name=hf",
        f"trainer.default_local_dir={root / run}",
        "trainer.logger=[jsonl]",
        "trainer.seed=7",
        *overrides,
    ])


def trainer_for(args, cfg):
    from appo.trainer.loop import RLTrainer

    return RLTrainer(cfg, lm=build_lm(args.arch, args.device_name, seed=0), progress=False)


def weights(model) -> dict[str, torch.Tensor]:
    from appo.trainer.fsdp import full_model_state

    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        state = full_model_state(model)
    else:
        state = model.state_dict()
    return {k: v.detach().float().cpu() for k, v in state.items()}


# ---------------------------------------------------------------------------- checks
def check_engine_logprobs(args, root: Path) -> dict:
    from appo.trainer.batch import TrainBatch

    trainer = trainer_for(args, make_config(args, root, "engine", "rollout.strategy=grpo"))
    t0 = time.perf_counter()
    rollout, by_uid = trainer.rollout(trainer.batch_for_step(0), "s0", 11)
    secs = time.perf_counter() - t0
    trajs = rollout.trajectories
    trainer.score(trajs, by_uid)  # collation wants rewards; their values do not matter here
    batch = TrainBatch.collate(trajs, trainer.pad_id)
    recomputed = trainer._logprobs(trainer.model, batch).float().cpu()
    behaviour = torch.zeros_like(recomputed)
    for i, t in enumerate(batch_rows(batch, trajs)):
        lp = torch.tensor(t.logp_rollout, dtype=torch.float32)
        behaviour[i, : len(lp)] = lp
    mask = batch.loss_mask.bool()
    diff = (recomputed - behaviour).abs()[mask]
    trainer.tools.close()
    # bfloat16 autocast against the engine's float32 decode on CUDA: a recompute noise of a
    # few hundredths (HISTORY.md "recompute noise"); float32 on CPU: rounding only.
    tol_mean, tol_max = (0.05, 1.0) if args.device == "cuda" else (1e-4, 1e-3)
    mean, mx = float(diff.mean()), float(diff.max())
    return {"ok": mean < tol_mean and mx < tol_max and len(trajs) > 0,
            "trajectories": len(trajs), "tokens": int(mask.sum()),
            "mean_abs_diff": mean, "max_abs_diff": mx, "tolerance": [tol_mean, tol_max],
            "decoded_tokens_per_s": rollout.stats.tokens_decoded / max(secs, 1e-9)}


def check_tree_forward(args, root: Path) -> dict:
    """`actor.tree_forward` on the device: an APPO rollout (it branches, so a group's rows share
    responses up to their branch points); per group, the tree forward's log-probs and the
    gradient of a token-mean loss against the flat forward's (each row whole), with the time
    and peak memory of each (a warm pass)."""
    from appo.trainer.batch import TrainBatch
    from appo.trainer.forward import computed_tokens
    from appo.trainer.update import response_logprobs

    trainer = trainer_for(args, make_config(args, root, "tree", "rollout.strategy=appo"))
    rollout, by_uid = trainer.rollout(trainer.batch_for_step(0), "s0", 13)
    trajs = rollout.trajectories
    trainer.score(trajs, by_uid)
    trainer.tools.close()
    batch = TrainBatch.collate(trajs, trainer.pad_id)
    model, cuda = trainer.model, args.device == "cuda"
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    groups = [[i for i, u in enumerate(batch.uids) if u == uid]
              for uid in dict.fromkeys(batch.uids)]
    n_tokens = float(batch.loss_mask.sum())
    runs = {}
    # Each forward twice, alternating: the second pass of each is the one reported, so
    # neither pays the other's first-use costs (kernel selection, allocator growth).
    for name, tree in (("flat", False), ("tree", True)) * 2:
        for p in params:
            p.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        logp_all, computed = torch.zeros_like(batch.loss_mask), 0
        t0 = time.perf_counter()
        for idx in groups:
            mini = batch.select(idx)
            computed += computed_tokens(mini.input_ids, mini.lengths, share_prefix=tree, tree=tree)
            logp, _, mask = response_logprobs(model, mini, trainer.cfg.actor.logprob_chunk_size,
                                              False, share_prefix=tree, tree=tree,
                                              compute_dtype=trainer.compute_dtype)
            (-(logp * mask).sum() / n_tokens).backward()
            logp_all[torch.tensor(idx), : logp.shape[1]] = logp.detach().float().cpu()
        if cuda:
            torch.cuda.synchronize()
        runs[name] = {"logp": logp_all, "seconds": time.perf_counter() - t0,
                      "computed_tokens": computed,
                      "grad": torch.cat([p.grad.detach().float().flatten() for p in params]),
                      "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    mask = batch.loss_mask.bool()
    diff = (runs["tree"]["logp"] - runs["flat"]["logp"]).abs()[mask]
    g_flat, g_tree = runs["flat"]["grad"], runs["tree"]["grad"]
    grad_rel = float((g_tree - g_flat).norm() / g_flat.norm().clamp_min(1e-30))
    # bfloat16 on CUDA: the two forwards differ in kernel and summation order, so a few
    # hundredths of a log-prob; float32 on CPU: rounding only.
    tol_mean, tol_grad = (0.05, 0.1) if cuda else (1e-5, 1e-4)
    mean = float(diff.mean())
    out = {"ok": mean < tol_mean and grad_rel < tol_grad and len(groups) > 0,
           "branches": rollout.stats.branches,
           "rows": len(batch), "response_tokens": int(n_tokens),
           "mean_abs_diff": mean, "max_abs_diff": float(diff.max()), "grad_rel_diff": grad_rel,
           "tolerance": [tol_mean, tol_grad]}
    for name, r in runs.items():
        out[name] = {"seconds": round(r["seconds"], 3), "computed_tokens": r["computed_tokens"],
                     **({"peak_gb": round(r["peak_gb"], 3)} if cuda else {})}
    return out


def batch_rows(batch, trajs) -> list:
    by_id = {t.traj_id: t for t in trajs}
    return [by_id[tid] for tid in batch.traj_ids]


def check_rl(args, root: Path, strategy: str) -> dict:
    cfg = make_config(args, root, f"rl_{strategy}", f"rollout.strategy={strategy}",
                      "trainer.total_steps=2", "model.enable_gradient_checkpointing=true")
    trainer = trainer_for(args, cfg)
    history = trainer.fit()
    return summarise_history(history)


def summarise_history(history: list[dict]) -> dict:
    keys = ("actor/pg_loss", "actor/grad_norm")
    finite = all(math.isfinite(h.get(k, float("nan"))) for h in history for k in keys)
    moved = any(h.get("actor/grad_norm", 0.0) > 0 for h in history)
    out = {"ok": finite and moved and len(history) == 2, "steps": len(history)}
    for h in history:
        s = int(h["step"])
        out[f"step{s}"] = {k: round(float(v), 6) for k, v in h.items()
                           if k.startswith(("memory/", "perf/", "actor/pg_loss", "actor/grad_norm",
                                            "time/step", "reward/mean", "rollout/branches",
                                            "rollout/response_len"))}
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_fsdp_resume(args, root: Path) -> dict:
    import torch.distributed as dist

    from appo.trainer.distributed import init_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                      LOCAL_RANK="0", WORLD_SIZE="1")
    init_process_group(cuda=args.device == "cuda")
    try:
        # A KL term (the reference is sharded too) and two epochs (old log-probs: no-grad
        # passes of the sharded policy).
        common = ("rollout.strategy=arpo", "trainer.parallel=fsdp", "trainer.save_freq=1",
                  "model.enable_gradient_checkpointing=true", "actor.use_kl_loss=true",
                  "actor.kl_loss_coef=0.001", "actor.ppo_epochs=2")
        full = trainer_for(args, make_config(args, root, "fsdp_full", *common,
                                             "trainer.total_steps=2"))
        hist_full = full.fit()
        w_full = weights(full.model)
        backend = str(dist.get_backend())
        del full
        # The resumed run: step 1's checkpoint of the uninterrupted run, resumed to step 2.
        resumed_dir = root / "fsdp_resumed"
        resumed_dir.mkdir()
        shutil.copytree(root / "fsdp_full" / "global_step_1", resumed_dir / "global_step_1")
        (resumed_dir / "latest").write_text("global_step_1\n")
        resumed = trainer_for(args, make_config(args, root, "fsdp_resumed", *common,
                                                "trainer.total_steps=2", "trainer.resume=true"))
        hist_resumed = resumed.fit()
        w_resumed = weights(resumed.model)
    finally:
        dist.destroy_process_group()
    keys = ("actor/pg_loss", "actor/grad_norm", "reward/mean", "rollout/response_len")
    a, b = hist_full[-1], hist_resumed[-1]
    metric_diff = {k: abs(float(a[k]) - float(b[k])) for k in keys if k in a and k in b}
    weight_diff = max(float((w_full[k] - w_resumed[k]).abs().max()) for k in w_full)
    bit_exact = weight_diff == 0.0 and all(v == 0.0 for v in metric_diff.values())
    out = summarise_history(hist_full)
    out.update({"backend": backend, "resumed_step": int(b["step"]), "bit_exact": bit_exact,
                "max_weight_diff": weight_diff, "metric_diff": metric_diff})
    # CPU: bit for bit (the suite's promise). CUDA: the same rollouts and metrics to
    # rounding; bit-exactness is reported, not required (cuBLAS may pick other kernels).
    out["ok"] = out["ok"] and (bit_exact if args.device == "cpu" else
                               weight_diff < 1e-3 and all(v < 1e-2 for v in
                                                          metric_diff.values()))
    return out


def check_memory_plan(args, root: Path, results: dict) -> dict:
    """`appo plan`'s prediction for rl_arpo's run (one GPU, the hf engine) against its
    measured CUDA peaks at step 2 (optimizer states allocated): rollout and update phase."""
    from transformers import Qwen2Config

    from appo.models.tiny import build_tiny_tokenizer
    from appo.trainer.plan import GIB, model_shape, plan_memory
    from appo.trainer.plan_run import plan_inputs

    if args.device != "cuda":
        return {"ok": True, "skipped": "no CUDA peaks on CPU (the plan's CPU checks: "
                                        "tests/trainer/test_plan.py)"}
    arpo = results.get("rl_arpo", {}).get("step2")
    if not arpo:
        return {"ok": False, "error": "rl_arpo did not run"}
    cfg = make_config(args, root, "plan", "rollout.strategy=arpo",
                      "model.enable_gradient_checkpointing=true")
    tok = build_tiny_tokenizer()
    hf = Qwen2Config(**args.arch, vocab_size=len(tok))
    total = torch.cuda.get_device_properties(0).total_memory / GIB
    plan = plan_memory(plan_inputs(cfg, 1, total, parallel="single"), model_shape(hf))
    out = {"ok": True}
    for phase in ("rollout", "update"):
        predicted = (plan.total(phase) - plan.term("cuda_reserve").rollout) / GIB
        measured = float(arpo[f"memory/{phase}_peak_gb"])
        out[phase] = {"predicted_gb": round(predicted, 2), "measured_gb": round(measured, 2),
                      "ratio": round(measured / predicted, 3)}
    return out


CHECKS = {
    "engine_logprobs": check_engine_logprobs,
    "rl_arpo": lambda a, r: check_rl(a, r, "arpo"),
    "rl_appo": lambda a, r: check_rl(a, r, "appo"),
    "tree_forward": check_tree_forward,
    "fsdp_resume": check_fsdp_resume,
}


def environment(args) -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
           "device": args.device, "model": "tiny" if args.tiny else "qwen2.5-0.5b-shaped"}
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gb=round(props.total_memory / 2**30, 1),
                   cuda=torch.version.cuda)
    import transformers

    env["transformers"] = transformers.__version__
    return env


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# appo GPU check, {env['date']}", "",
             ", ".join(f"{k}: {v}" for k, v in env.items() if k != "date"), "",
             "| check | ok | figures |", "| --- | --- | --- |"]
    for name, r in report["checks"].items():
        figures = {k: v for k, v in r.items() if k not in ("ok", "traceback")}
        lines.append(f"| {name} | {'yes' if r.get('ok') else 'NO'} | "
                     f"{json.dumps(figures, sort_keys=True)[:1500]} |")
    lines += ["", f"total: {report['seconds']:.0f} s; all ok: {report['ok']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (the suite's run)")
    p.add_argument("--out", default="gpu_check_out")
    p.add_argument("--only", nargs="*", choices=sorted(CHECKS), help="run these checks only")
    p.add_argument("--prompts", type=int, default=None)
    p.add_argument("--n", type=int, default=4, help="rollouts per prompt")
    p.add_argument("--response-len", type=int, default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --device cpu --tiny here)", file=sys.stderr)
        return 2
    args.arch = TINY if args.tiny else QWEN25_05B
    args.device_name = "cuda:0" if args.device == "cuda" else "cpu"
    args.prompts = args.prompts or (2 if args.tiny else 8)
    args.response_len = args.response_len or (16 if args.tiny else 128)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    report = {"environment": environment(args), "checks": {}}
    with tempfile.TemporaryDirectory(prefix="appo-gpu-check-") as tmp:
        root = Path(tmp)
        write_data(root, 4 * args.prompts)
        for name, fn in CHECKS.items():
            if args.only and name not in args.only:
                continue
            t = time.perf_counter()
            try:
                result = fn(args, root)
            except Exception as e:  # a failed check is a finding: record it, run the rest
                result = {"ok": False, "error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()[-3000:]}
            result["seconds"] = round(time.perf_counter() - t, 1)
            report["checks"][name] = result
            print(f"gpu_check: {name}: {'ok' if result['ok'] else 'FAILED'} "
                  f"({result['seconds']} s)", flush=True)
            if not result["ok"]:
                print(json.dumps({k: v for k, v in result.items()}, indent=1)[-4000:],
                      file=sys.stderr, flush=True)
        # The plan is compared with rl_arpo's peaks: under --only without rl_arpo, not run.
        try:
            if "rl_arpo" in report["checks"]:
                report["checks"]["memory_plan"] = check_memory_plan(args, root,
                                                                    report["checks"])
        except Exception as e:  # noqa: BLE001 - a finding, like any check's failure
            report["checks"]["memory_plan"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    report["seconds"] = time.perf_counter() - t0
    report["ok"] = all(r.get("ok") for r in report["checks"].values())
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
