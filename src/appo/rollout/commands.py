"""`appo rollout`: run one rollout strategy on a question and print the trajectory tree.

    appo rollout --model smollm2-135m --strategy arpo rollout.n=8 rollout.initial_rollouts=4 \
        "What is 17*23?"

Import-light: torch, transformers and the tools load inside the handler.
"""

from __future__ import annotations

import argparse

from appo.cli_args import add_config_args, config_from_args, positive_int, split_overrides


def _prompt_ids(lm, question: str, cfg, tags: list[str]) -> list[int]:
    """Chat-templated prompt ids; the data area's system prompt when it is available."""
    try:
        from appo.data.templates import build_messages

        messages = build_messages(question, cfg.data.template, tags)
    except ImportError:
        messages = [
            {"role": "system", "content": "You are a helpful assistant. Think step by step; "
             "put the final answer in <answer> </answer>."},
            {"role": "user", "content": question},
        ]
    ids = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    return list(ids)


def _rollout(args: argparse.Namespace) -> int:
    import random

    from appo.errors import AppoError

    overrides, rest = split_overrides(list(args.overrides or []))
    question = " ".join(rest).strip()
    if not question:
        raise AppoError('give a question, e.g. appo rollout rollout.n=8 "What is 17*23?"')
    extra = []
    if args.strategy:
        extra.append(f"rollout.strategy={args.strategy}")
    if args.model:
        extra.append(f"model.path={args.model}")
    if args.seed is not None:
        extra.append(f"rollout.seed={args.seed}")
    cfg = config_from_args(args, extra)

    from appo.models import load_model
    from appo.rollout import RolloutPrompt, RolloutSettings, build_engine, rollout, write_jsonl
    from appo.rollout.tree import render_tree

    lm = load_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device,
                    trust_remote_code=cfg.model.trust_remote_code)
    if args.no_tools:
        tools = None
    else:
        from appo.tools.registry import build_tools

        tools = build_tools(cfg.tools)
    tags = list(tools.tags) if tools is not None else []
    # rollout.name=auto: this command makes one call of rollout.n rows
    from appo.rollout.auto import Workload

    engine = build_engine(cfg, lm, workload=Workload(int(cfg.rollout.n), 1,
                                                     int(cfg.data.max_response_length)))
    settings = RolloutSettings.from_config(cfg)
    prompt = RolloutPrompt("q0", _prompt_ids(lm, question, cfg, tags),
                           extra={"question": question})
    score_fn = None
    if cfg.rollout.strategy == "appo":
        from appo.rollout.scoring import hf_score_fn

        score_fn = hf_score_fn(lm.model, settings.sampling)
    try:
        batch = rollout([prompt], engine, tools, settings, strategy=cfg.rollout.strategy,
                        rng=random.Random(cfg.rollout.seed), score_fn=score_fn)
    finally:
        close = getattr(tools, "close", None)
        if callable(close):
            close()
    print(render_tree(batch, lm.tokenizer, width=args.width))
    if args.out:
        count = write_jsonl(batch.trajectories, args.out, tokenizer=lm.tokenizer,
                            model=cfg.model.path)
        print(f"wrote {count} trajectories to {args.out}")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "rollout",
        help="run a rollout strategy (grpo/arpo/aepo/appo) on a question; print the tree",
        description="Run one rollout of the configured strategy on QUESTION and print the "
        "trajectory tree: branch points, segment entropies, tool calls, finish. Config "
        "overrides (key=value) may be mixed with the question words.",
    )
    p.add_argument("--model", "-m", default=None, help="model spec (default: model.path)")
    p.add_argument("--strategy", "-s", default=None,
                   help="grpo | arpo | aepo | appo (default: rollout.strategy)")
    p.add_argument("--out", "-o", metavar="FILE", help="write the trajectories as JSONL")
    p.add_argument("--seed", type=int, default=None, help="rollout.seed")
    p.add_argument("--no-tools", action="store_true", help="no tools: stop at EOS only")
    p.add_argument("--width", type=positive_int, default=72, help="text width of the tree")
    add_config_args(p)
    p.set_defaults(handler=_rollout)
