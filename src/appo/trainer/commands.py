"""`appo sft`, `appo train`, `appo demo` (the demo's stages are in appo.trainer.demo), `appo plan`
(appo.trainer.plan_run), `appo export` (appo.trainer.sharded)."""

from __future__ import annotations

import argparse

from appo.cli_args import (
    add_config_args,
    config_from_args,
    positive_float,
    positive_int,
    split_overrides,
)
from appo.paths import check_output_dir


def _sft(args: argparse.Namespace) -> int:
    import torch

    from appo.data.sft import sft_data_from_config
    from appo.errors import AppoError
    from appo.models import load_model
    from appo.models.lora import apply_lora
    from appo.trainer.cpu_linear import run_uses_onednn
    from appo.trainer.metrics import MetricsLogger
    from appo.trainer.precision import master_dtype, train_compute_dtype
    from appo.trainer.rundir import open_run_dir
    from appo.trainer.sft import train_sft

    cfg = config_from_args(args)
    if cfg.sft.output_dir:  # a file in the way or a read-only disk: one line, now
        check_output_dir(cfg.sft.output_dir, "sft.output_dir")
    # Before anything is loaded: a new SFT run never writes into an old run's directory,
    # and a start that fails (bad data) leaves nothing behind (appo.trainer.rundir).
    run = open_run_dir(cfg.sft.output_dir, "sft", "sft.output_dir",
                       overwrite=cfg.trainer.overwrite, resumable=False)
    cfg.sft.output_dir = str(run.path)
    print(f"appo sft: run directory {cfg.sft.output_dir}", flush=True)
    with run.starting():
        # bfloat16: float32 master weights, bfloat16 forwards (appo.trainer.precision)
        lm = load_model(cfg.model.path, dtype=master_dtype(cfg), device=cfg.model.device)
        torch.manual_seed(cfg.trainer.seed)  # the LoRA adapter's initialisation
        lora = apply_lora(lm.model, cfg.model)  # None: full fine-tuning
        from appo.trainer.memory import memory_options  # the same savings as in RL

        memory_options(lm.model, cfg.actor, fsdp=False,
                       mmap_threshold_kb=cfg.trainer.mmap_threshold_kb,
                       mmap_scope=cfg.trainer.mmap_threshold_scope)
        train = sft_data_from_config(cfg, lm.tokenizer, "train")
        if not train.examples:
            raise AppoError("sft.train_files produced no examples")
        val = (sft_data_from_config(cfg, lm.tokenizer, "val").examples if cfg.sft.val_files
               else None)
        logger = MetricsLogger(cfg.sft.output_dir, list(cfg.trainer.logger))
    s = cfg.sft
    print(f"appo sft: {len(train.examples)} examples "
          f"({train.stats.skipped_overlong} skipped as too long), model {cfg.model.path}")
    with run.running():
        result = train_sft(lm.model, lm.tokenizer, train.examples, s, seed=cfg.trainer.seed,
                           val=val, logger=logger,
                           gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
                           compute_dtype=train_compute_dtype(cfg), lora=lora,
                           save_merged=cfg.model.lora_save_merged,
                           onednn=run_uses_onednn(cfg, lm.model))
    logger.close()
    last = result.train_loss[-1] if result.train_loss else float("nan")
    print(f"appo sft: {result.steps} steps in {result.seconds:.0f} s, final loss {last:.4f}"
          + (f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else "")
          + f"; checkpoint {result.checkpoint}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from appo.trainer.demo import demo_config, demo_yaml, run_demo

    if args.print_config:
        print(demo_yaml(), end="")
        return 0
    overrides, _ = split_overrides(list(args.overrides or []))
    cfg = demo_config(args.config, overrides)
    if cfg.trainer.default_local_dir:  # null: a new unique directory (appo.trainer.rundir)
        check_output_dir(cfg.trainer.default_local_dir, "trainer.default_local_dir")
    return run_demo(cfg)


def _train(args: argparse.Namespace) -> int:
    from appo.trainer.guards import NonFiniteError
    from appo.trainer.loop import RLTrainer

    cfg = config_from_args(args)
    if cfg.trainer.default_local_dir:  # null: a new unique directory (appo.trainer.rundir)
        check_output_dir(cfg.trainer.default_local_dir, "trainer.default_local_dir")
    if cfg.trainer.rollout_data_dir:
        check_output_dir(cfg.trainer.rollout_data_dir, "trainer.rollout_data_dir")
    trainer = RLTrainer(cfg)
    try:
        history = trainer.fit()
    except NonFiniteError as e:  # the update knows no step number: the one being trained
        raise e.at_step(trainer.step + 1) from None
    if trainer.dp.is_main:
        last = history[-1] if history else {}
        print(f"appo train: {trainer.step} steps; last reward/mean "
              f"{last.get('reward/mean', float('nan')):.3f}; outputs in {trainer.out_dir}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    import json

    from appo.config import load_config
    from appo.errors import AppoError
    from appo.trainer.plan_run import plan_for_config, render_table

    files = [i for i in args.items if "=" not in i]
    overrides = [i for i in args.items if "=" in i]
    if args.config is not None:
        files.insert(0, args.config)
    if len(files) > 1:
        raise AppoError(f"give one config file, got {len(files)}: {', '.join(files)}")
    cfg = load_config(files[0] if files else None, overrides)
    plan = plan_for_config(cfg, args.gpus, args.gpu_memory_gb, nodes=args.nodes,
                           arch=args.arch, overlap=args.overlap)
    if args.json:
        print(json.dumps({"config": files[0] if files else None, **plan.to_dict()}, indent=2))
    else:
        print(render_table(plan, files[0] if files else ""))
    return 0 if plan.fits else 1


def _export(args: argparse.Namespace) -> int:
    from appo.trainer.sharded import export_hf

    export_hf(args.checkpoint, args.out)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "plan", help="memory per GPU of a run before any GPU is held (exit 1: does not fit)",
        description="Plan a run's memory per GPU from its config and the model's config.json "
                    "alone (built on the meta device; no weights, no GPU): parameters, "
                    "gradients, AdamW states, reference, rollout engine, activations, "
                    "against the card. GB are 2^30 bytes.")
    p.add_argument("--config", "-c", metavar="FILE", help="YAML config file")
    p.add_argument("items", nargs="*", metavar="CONFIG|key=value",
                   help="the config file and dotted overrides")
    p.add_argument("--gpus", type=positive_int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--nodes", type=positive_int, default=1, help="nodes (default 1)")
    p.add_argument("--gpu-memory-gb", type=positive_float, default=80.0,
                   help="memory of one GPU in GB (default 80)")
    p.add_argument("--arch", metavar="NAME|PATH",
                   help="the model's architecture: a shipped name (qwen2.5-7b, qwen3-8b, "
                        "qwen3-14b, llama-3.1-8b, smollm2-135m) or a config.json / model "
                        "directory (default: from model.path)")
    p.add_argument("--overlap", action="store_true",
                   help="plan the rollout engine's memory held through the update (default: "
                        "released, vLLM sleep mode as verl)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(handler=_plan)
    p = sub.add_parser(
        "export", help="a sharded checkpoint as a Hugging Face model directory",
        description="Write the policy of a sharded checkpoint (trainer.sharded_checkpoint=true, "
                    "global_step_N with shards/) as a Hugging Face directory that transformers "
                    "and vLLM load: config, safetensors, tokenizer. One process, no GPU.")
    p.add_argument("checkpoint", help="the checkpoint directory (runs/.../global_step_N)")
    p.add_argument("out", help="the directory to write (new or empty)")
    p.set_defaults(handler=_export)
    p = sub.add_parser("sft", help="supervised cold start on tool trajectories (sft.*)")
    add_config_args(p)
    p.set_defaults(handler=_sft)
    p = sub.add_parser("train", help="RL training: grpo / arpo / aepo / appo (rollout.strategy)")
    add_config_args(p)
    p.set_defaults(handler=_train)
    p = sub.add_parser("demo", help="the main job on the embedded model (make demo)")
    add_config_args(p)
    p.add_argument("--print-config", action="store_true",
                   help="print the demo's config (configs/demo.yaml) and exit")
    p.set_defaults(handler=_demo)
