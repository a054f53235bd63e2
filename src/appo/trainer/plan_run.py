"""A run's memory plan from its config: `appo plan`'s table and the trainer's start-up check.

`plan_inputs` reads the settings `appo.trainer.plan.plan_memory` needs from an appo config;
`plan_for_config` resolves the model's architecture (`appo.models.arch`: a shipped
`config.json`, a local model directory, `--arch`) and plans; `check_plan_fits` is what the
trainer calls on CUDA before it loads anything: the plan, or one line refusing the run
(`trainer.skip_memory_plan=true` starts it anyway). `render_table` is the text `appo plan`
prints.
"""

from __future__ import annotations

import math
from typing import Any

from appo.errors import AppoError
from appo.trainer.plan import GIB, MemoryPlan, PlanInputs, check_fits, model_shape, plan_memory

__all__ = ["check_plan_fits", "plan_for_config", "plan_inputs", "render_table", "startup_plan"]


def resolve_parallel(parallel: str, world: int) -> str:
    """`trainer.parallel` as a plan reads it: one GPU is `single`; `auto` on several is
    planned as `fsdp` (what `accelerate launch` with an FSDP config, or
    `trainer.parallel=fsdp`, runs)."""
    if world == 1:
        return "single"
    return "fsdp" if parallel in ("auto", "fsdp") else "ddp"


def plan_inputs(cfg: Any, gpus: int, gpu_memory_gb: float, nodes: int = 1,
                parallel: str | None = None, overlap: bool = False,
                device: str = "cuda") -> PlanInputs:
    """The plan's settings from config `cfg` on `nodes` x `gpus` GPUs of `gpu_memory_gb`.
    `parallel`: the sharding the trainer resolved (default: from `trainer.parallel`)."""
    from appo.trainer.update import kl_coef

    world = gpus * nodes
    m, a, r, d = cfg.model, cfg.actor, cfg.rollout, cfg.data
    autocast = m.dtype == "bfloat16" and bool(a.fp32_master_weights)
    dtype = m.dtype if m.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    master = 4 if autocast or dtype == "float32" else 2
    rollout = r.name if r.name in ("vllm", "hf", "openai") else ("vllm" if device == "cuda"
                                                                 else "hf")
    return PlanInputs(
        gpus=gpus, nodes=nodes, gpu_memory_gb=float(gpu_memory_gb),
        parallel=resolve_parallel(parallel or cfg.trainer.parallel, world),
        device=device, master_bytes=master, autocast=autocast,
        lora_rank=int(m.lora_rank), kl_reference=kl_coef(a) != 0,
        critic=cfg.algorithm.adv_estimator == "gae",
        rollout=rollout, tensor_parallel=int(r.tensor_model_parallel_size),
        gpu_memory_utilization=float(r.gpu_memory_utilization),
        kv_cache_gib=None if r.kv_cache_gib is None else float(r.kv_cache_gib),
        rollout_rows=math.ceil(d.train_batch_size * r.n / world),
        sequence_tokens=int(d.max_prompt_length + d.max_response_length),
        token_budget=int(a.ppo_max_token_len_per_device),
        gradient_checkpointing=bool(m.enable_gradient_checkpointing),
        lean_mlp=bool(a.lean_mlp_activations), sdpa_gqa=bool(a.sdpa_gqa),
        logprob_chunk=int(a.logprob_chunk_size), overlap=overlap,
        rollout_copy=(r.name != "vllm" or r.strategy == "appo"
                      or cfg.algorithm.adv_estimator == "gae"),
    )


def plan_for_config(cfg: Any, gpus: int, gpu_memory_gb: float, nodes: int = 1,
                    arch: str | None = None, parallel: str | None = None,
                    overlap: bool = False) -> MemoryPlan:
    """The memory plan of `cfg`'s run (see `plan_inputs`), its model from `arch` or
    `model.path` (`appo.models.arch.resolve_architecture`)."""
    from appo.models.arch import resolve_architecture

    inputs = plan_inputs(cfg, gpus, gpu_memory_gb, nodes, parallel, overlap)
    if inputs.tensor_parallel < 1 or gpus % inputs.tensor_parallel:
        raise AppoError(f"rollout.tensor_model_parallel_size={inputs.tensor_parallel} must "
                        f"divide the GPUs per node ({gpus})")
    source, hf_config = resolve_architecture(cfg.model.path, arch,
                                             trust_remote_code=bool(cfg.model.trust_remote_code))
    shape = model_shape(hf_config, name=source, lora_rank=inputs.lora_rank,
                        target_modules=cfg.model.target_modules)
    plan = plan_memory(inputs, shape, source=source)
    if cfg.actor.max_memory_gb is not None:
        plan.notes.append("actor.max_memory_gb is set: the trainer derives the token budget "
                          "from it at start-up; planned at actor.ppo_max_token_len_per_device")
    return plan


def check_plan_fits(cfg: Any, gpus: int, gpu_memory_gb: float, nodes: int = 1,
                    parallel: str | None = None) -> MemoryPlan:
    """The trainer's start-up check on CUDA: the run's plan when it fits (or when
    `trainer.skip_memory_plan` is true), else AppoError with one line naming the largest
    term, the keys that shrink it and the key that starts the run anyway."""
    plan = plan_for_config(cfg, gpus, gpu_memory_gb, nodes, parallel=parallel)
    if getattr(cfg.trainer, "skip_memory_plan", False):
        return plan
    return check_fits(plan)


def startup_plan(cfg: Any, world: int, fsdp: bool) -> MemoryPlan | None:
    """`appo train`'s check on CUDA, before the model loads: this node's GPUs (their count
    from LOCAL_WORLD_SIZE, else every visible one) of this device's memory, the sharding the
    trainer resolved. None on CPU. Refuses with one line (`check_plan_fits`)."""
    import os

    import torch

    if not torch.cuda.is_available():
        return None
    gpus = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count() if world > 1
                              else 1))
    gpus = max(1, min(gpus, world))
    nodes = max(1, world // gpus)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
    parallel = "fsdp" if fsdp else ("ddp" if world > 1 else "single")
    return check_plan_fits(cfg, gpus, total, nodes, parallel=parallel)


def _gb(n: int) -> str:
    return f"{n / GIB:8.2f}"


def render_table(plan: MemoryPlan, config: str = "") -> str:
    """The plan as `appo plan` prints it."""
    i, s = plan.inputs, plan.shape
    precision = ("float32 weights and AdamW, bfloat16 compute" if i.autocast else
                 f"{'float32' if i.master_bytes == 4 else 'bfloat16'} weights and AdamW")
    sharding = {"fsdp": f"fsdp (sharded over {i.world})", "ddp": "ddp (a replica per GPU)",
                "single": "one GPU"}[i.parallel]
    training = f"LoRA rank {i.lora_rank}" if i.lora_rank else "full fine-tuning"
    lines = [
        f"appo plan{': ' + config if config else ''}",
        f"model: {plan.source}: {s.params / 1e9:.2f} B parameters ({s.layers} layers, "
        f"hidden {s.hidden}, {s.heads} heads / {s.kv_heads} kv, vocab {s.vocab}"
        f"{', tied' if s.tied else ''})",
        f"layout: {i.nodes} node(s) x {i.gpus} GPU(s) of {i.gpu_memory_gb:g} GB, {sharding}; "
        f"{precision}; {training}; gradient checkpointing "
        f"{'on' if i.gradient_checkpointing else 'off'}",
        f"rollout: {i.rollout}" + (f", tensor parallel {i.tensor_parallel}, "
                                   f"gpu_memory_utilization {i.gpu_memory_utilization:g}"
                                   if i.rollout == "vllm" else ""),
        "",
        f"{'per GPU (GB = 2^30 bytes)':48s} {'rollout':>8s} {'update':>8s}  shrink with",
    ]
    for t in plan.terms:
        lines.append(f"{t.label:48s} {_gb(t.rollout)} {_gb(t.update)}  {', '.join(t.shrink)}")
    lines.append(f"{'total':48s} {_gb(plan.total('rollout'))} {_gb(plan.total('update'))}")
    lines.append(f"{'card':48s} {_gb(plan.card)} {_gb(plan.card)}")
    lines.append("")
    lines.extend(plan.notes)
    lines.append(f"verdict: {plan.verdict()}")
    return "\n".join(lines)
