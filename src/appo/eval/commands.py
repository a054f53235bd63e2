"""`appo eval` (benchmarks, pass@k, tool statistics, judge) and `appo view` (rollout viewer).

    appo eval --model smollm2-135m --data gsm8k=data/gsm8k/test.jsonl --limit 100 --k 1
    appo eval --base-url http://127.0.0.1:8000 --model Qwen/Qwen3-8B --data aime24=... --k 5
    appo view runs/eval/gsm8k/trajectories.jsonl -o report.html

Import-light: torch, transformers, the tools and the data loaders load inside the handlers.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from appo.cli_args import (
    add_config_args,
    config_from_args,
    nonneg_int,
    positive_float,
    positive_int,
)


def load_tokenizer(spec: str):
    """The tokenizer of a model spec, without loading the model where that is possible
    (a local HF directory, a hub id in the local cache); aliases and GGUF files go through
    `appo.models.load_model`."""
    from appo.errors import AppoError

    if spec == "tiny-test":
        from appo.models.tiny import build_tiny_tokenizer

        return build_tiny_tokenizer()
    path = Path(spec).expanduser()
    if spec in ("smollm2-135m",) or path.suffix == ".gguf" or (
            path.is_dir() and not (path / "tokenizer_config.json").is_file()):
        from appo.models import load_model

        return load_model(spec).tokenizer
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path) if path.is_dir() else spec,
                                            local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise AppoError(
            f"cannot load a tokenizer for {spec!r} ({type(e).__name__}); give a local model "
            "directory, an alias, or a hub id already in the local Hugging Face cache"
        ) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _eval(args: argparse.Namespace) -> int:
    from appo.errors import AppoError

    extra = []
    for key, value in (("model.path", args.model), ("eval.k", args.k),
                       ("eval.out_dir", args.out), ("eval.base_url", args.base_url),
                       ("eval.judge_base_url", args.judge_base_url),
                       ("eval.judge_model", args.judge_model), ("rollout.seed", args.seed)):
        if value is not None:
            extra.append(f"{key}={value}")
    cfg = config_from_args(args, extra)
    if args.limit is not None and args.limit < 1:
        raise AppoError(f"--limit must be >= 1, got {args.limit}")
    if args.logprobs < 0:
        raise AppoError(f"--logprobs must be >= 0, got {args.logprobs}")
    from appo.paths import check_output_dir

    check_output_dir(cfg.eval.out_dir, "eval.out_dir, --out")
    from appo.outdir import lock_dir

    # One evaluation at a time appends to an output directory (appo.outdir).
    out_lock = lock_dir(cfg.eval.out_dir, "eval output directory (--out)")

    from appo.eval.runner import (
        IDENTITY_FILE,
        Evaluator,
        Grader,
        eval_identity,
        eval_settings,
        load_benchmarks,
    )
    from appo.outdir import check_identity
    from appo.rewards.router import RewardRouter, router_from_config

    tools = None
    if not args.no_tools:
        from appo.tools.registry import build_tools

        tools = build_tools(cfg.tools)
    judge = None
    try:
        tags = list(tools.tags) if tools is not None else []
        benchmarks = load_benchmarks(args.data or list(cfg.data.val_files), cfg.data.template,
                                     tags, cfg.data.prompt_key, args.limit,
                                     stage_prompt=cfg.data.appo_stage_prompt,
                                     call_format=cfg.tools.format)
        k = int(cfg.eval.k)
        settings = eval_settings(cfg, k, tags)
        # Before the model loads: an --out made by another model or sampling is refused,
        # so its samples are never resumed (and summarised) as this run's.
        check_identity(cfg.eval.out_dir, IDENTITY_FILE,
                       eval_identity(cfg, settings, tags, args.served_model),
                       what=f"--out {cfg.eval.out_dir}",
                       how="use a new --out (or move this one away to start afresh)",
                       has_outputs=any(Path(cfg.eval.out_dir).glob("*/samples.jsonl")))
        info = {"model": cfg.model.path, "benchmarks": {b.name: b.spec for b in benchmarks}}
        if cfg.eval.base_url:
            from appo.rollout.openai_engine import OpenAICompletionsEngine

            tokenizer = load_tokenizer(cfg.model.path)
            engine = OpenAICompletionsEngine(
                cfg.eval.base_url, tokenizer, model=args.served_model,
                timeout=args.request_timeout, max_concurrency=args.concurrency,
                prompt_format=args.prompt_format, seed=int(cfg.rollout.seed),
                logprobs=args.logprobs, token_ids=not args.no_token_ids,
            )
            info.update(backend="openai", base_url=cfg.eval.base_url, served_model=engine.model)
        else:
            from appo.models import load_model
            from appo.rollout import build_engine

            lm = load_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device,
                            trust_remote_code=cfg.model.trust_remote_code)
            tokenizer = lm.tokenizer
            # rollout.name=auto: every sample of every benchmark, in chunks of --batch-size
            from appo.rollout.auto import Workload

            samples = max(sum(len(b.examples) for b in benchmarks) * k, 1)
            workload = Workload(min(args.batch_size, samples),
                                math.ceil(samples / args.batch_size),
                                int(cfg.eval.max_response_length))
            engine = build_engine(cfg, lm, workload=workload)
            info.update(backend=engine.name, model_source=lm.source)
        if cfg.tools.format == "hermes" and tools is not None:
            from appo.rollout.template_check import check_template

            report = check_template(tokenizer, "hermes", tools.schemas, tags,
                                    cfg.rollout.result_template)
            print(f"appo: {report.line()}", file=sys.stderr, flush=True)
        router = router_from_config(cfg)
        if cfg.custom_reward_function.path:
            lenient = router  # a user reward has no lenient mode
        else:
            lenient = RewardRouter(reward_kwargs={"math": {"lenient": True},
                                                  "qa": {"lenient": True}})
        if cfg.eval.judge_base_url:
            from appo.eval.judge import Judge

            judge = Judge(cfg.eval.judge_base_url, cfg.eval.judge_model,
                          cache_path=args.judge_cache, timeout=args.request_timeout)
        evaluator = Evaluator(engine, tools, tokenizer, settings,
                              Grader(router, lenient, judge), batch_size=args.batch_size,
                              log=lambda msg: print(msg, file=sys.stderr, flush=True),
                              run_info=info)
        result = evaluator.run(benchmarks, cfg.eval.out_dir, k)
    finally:
        if tools is not None:
            tools.close()
        if judge is not None:
            judge.close()
        out_lock.release()
    print(result.table())
    print(f"\nwall time {result.wall_seconds:.1f} s: {result.generated} samples generated, "
          f"{result.resumed} resumed, {result.failed} failed"
          + (" (rerun the same command to retry them)" if result.failed else ""))
    print(f"results: {result.summary_path} (and summary.md, <benchmark>/samples.jsonl; "
          f"view with: appo view {Path(cfg.eval.out_dir) / '<benchmark>' / 'trajectories.jsonl'})")
    return 0 if not result.failed else 1


def _view(args: argparse.Namespace) -> int:
    from appo.eval.viewer import (
        check_view_model,
        check_view_output,
        load_trajectories,
        recorded_models,
        render_html,
    )
    from appo.outdir import write_output

    check_view_output(args.output, args.files)
    trajs = load_trajectories(args.files)
    tokenizer = None
    needs = any(not isinstance(t.extra.get("token_text"), list) for t in trajs)
    model = check_view_model(recorded_models(trajs, args.files), args.model, args.force_model,
                             needs)
    if needs or args.model:
        tokenizer = load_tokenizer(model)
    title = args.title or ", ".join(Path(p).name for p in args.files)
    text = render_html(trajs, tokenizer, title=title, max_prompts=args.max_prompts)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_output(out, text)  # atomic; a failed write names the file
    shown = text.count('class="traj"')
    print(f"wrote {out} ({shown} trajectories, {len(text) / 1e6:.1f} MB)")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a model with tools on benchmarks: pass@1, pass@k, tool statistics",
        description="Run k samples per question through the tool loop (the grpo rollout with "
        "n=k), grade them, and write <out>/<benchmark>/samples.jsonl (resumable: a rerun "
        "skips finished samples), trajectories.jsonl (for appo view), summary.json and "
        "summary.md. Sampling defaults are the original's (eval.temperature=0.6, top_p=0.95, "
        "top_k=20, repetition_penalty=1.1); override with key=value.",
    )
    p.add_argument("--model", "-m", default=None,
                   help="model spec (default: model.path); with --base-url, the tokenizer")
    p.add_argument("--data", "-d", action="append", metavar="NAME=SPEC",
                   help="a benchmark: JSONL/parquet file or synth:TASK?... (repeatable; "
                   "default: data.val_files)")
    p.add_argument("--k", type=positive_int, default=None, help="samples per question (eval.k)")
    p.add_argument("--limit", type=positive_int, default=None, help="first N questions per benchmark")
    p.add_argument("--out", "-o", default=None, help="output directory (eval.out_dir)")
    p.add_argument("--base-url", default=None,
                   help="OpenAI-compatible server (e.g. vLLM) instead of the local engine")
    p.add_argument("--served-model", default=None,
                   help="the model name the server expects (default: its first listed model)")
    p.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="send prompts to the server as token ids (exact) or as text")
    p.add_argument("--concurrency", type=positive_int, default=32, help="parallel requests to the server")
    p.add_argument("--logprobs", type=nonneg_int, default=0, metavar="N",
                   help="with --base-url: ask the server for the sampled tokens' log-probs "
                   "and the top N (recorded in the trajectories; 0: not asked, recorded as 0)")
    p.add_argument("--no-token-ids", action="store_true",
                   help="with --base-url: do not ask for the sampled token ids (vLLM's "
                   "return_token_ids), for servers that reject unknown fields; the returned "
                   "text is then tokenised locally")
    p.add_argument("--request-timeout", type=positive_float, default=300.0,
                   help="seconds per HTTP request (server and judge)")
    p.add_argument("--judge-base-url", default=None, help="OpenAI-compatible judge server")
    p.add_argument("--judge-model", default=None, help="judge model name (eval.judge_model)")
    p.add_argument("--judge-cache", default=None,
                   help="judge verdict cache (SQLite; default $APPO_CACHE/judge/cache.sqlite)")
    p.add_argument("--batch-size", type=positive_int, default=64,
                   help="samples generated together (one batched rollout each)")
    p.add_argument("--no-tools", action="store_true", help="no tools (stop at EOS only)")
    p.add_argument("--seed", type=int, default=None, help="rollout.seed")
    add_config_args(p)
    p.set_defaults(handler=_eval)

    p = sub.add_parser(
        "view",
        help="render rollout dumps (JSONL of trajectories) as one static HTML page",
        description="Per prompt the trajectory tree with branch points, tokens shaded by "
        "entropy, collapsible tool calls and results, reward and advantage per trajectory. "
        "No server, no external assets.",
    )
    p.add_argument("files", nargs="+", help="rollout JSONL files or directories of them")
    p.add_argument("--output", "-o", default="report.html", help="HTML file to write")
    p.add_argument("--model", "-m", default=None,
                   help="tokenizer for dumps without token text (default: the model the dump "
                   "records; a different one is refused)")
    p.add_argument("--force-model", action="store_true",
                   help="read the dump with --model's tokenizer even though it records "
                   "another model")
    p.add_argument("--max-prompts", type=positive_int, default=None, help="show the first N prompts")
    p.add_argument("--title", default=None, help="page title")
    p.set_defaults(handler=_view)
