"""`appo sft`, `appo train`, `appo demo` (the demo's stages are in appo.trainer.demo)."""

from __future__ import annotations

import argparse

from appo.commands import add_config_args, config_from_args, split_overrides
from appo.paths import check_output_dir


def _sft(args: argparse.Namespace) -> int:
    import torch

    from appo.data.sft import sft_data_from_config
    from appo.errors import AppoError
    from appo.models import load_model
    from appo.models.lora import apply_lora
    from appo.trainer.metrics import MetricsLogger
    from appo.trainer.precision import master_dtype, train_compute_dtype
    from appo.trainer.rundir import prepare_run_dir
    from appo.trainer.sft import train_sft

    cfg = config_from_args(args)
    if cfg.sft.output_dir:  # a file in the way or a read-only disk: one line, now
        check_output_dir(cfg.sft.output_dir, "sft.output_dir")
    # Before anything is loaded: a new SFT run never writes into an old run's directory.
    cfg.sft.output_dir = str(prepare_run_dir(cfg.sft.output_dir, "sft", "sft.output_dir",
                                             overwrite=cfg.trainer.overwrite, resumable=False))
    print(f"appo sft: run directory {cfg.sft.output_dir}", flush=True)
    # bfloat16: float32 master weights, bfloat16 forwards (appo.trainer.precision)
    lm = load_model(cfg.model.path, dtype=master_dtype(cfg), device=cfg.model.device)
    torch.manual_seed(cfg.trainer.seed)  # the LoRA adapter's initialisation
    lora = apply_lora(lm.model, cfg.model)  # None: full fine-tuning
    from appo.trainer.memory import memory_options  # the same savings as in RL

    memory_options(lm.model, cfg.actor, fsdp=False, mmap_threshold_kb=cfg.trainer.mmap_threshold_kb)
    train = sft_data_from_config(cfg, lm.tokenizer, "train")
    if not train.examples:
        raise AppoError("sft.train_files produced no examples")
    val = sft_data_from_config(cfg, lm.tokenizer, "val").examples if cfg.sft.val_files else None
    s = cfg.sft
    logger = MetricsLogger(s.output_dir, list(cfg.trainer.logger))
    print(f"appo sft: {len(train.examples)} examples "
          f"({train.stats.skipped_overlong} skipped as too long), model {cfg.model.path}")
    result = train_sft(lm.model, lm.tokenizer, train.examples, s, seed=cfg.trainer.seed,
                       val=val, logger=logger,
                       gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
                       compute_dtype=train_compute_dtype(cfg), lora=lora,
                       save_merged=cfg.model.lora_save_merged)
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


def register(sub) -> None:
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
