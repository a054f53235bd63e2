"""`appo data synth`, `appo data inspect` and `appo data check-template`.

    appo data synth arith --n 200 --seed 1 --split eval --levels 2,3 --out arith_eval.jsonl
    appo data synth lookup --split sft --out lookup_sft.jsonl   # also writes the corpus
    appo data inspect ../shared/data/arpo/rl/valid.parquet
    appo data inspect "synth:arith?split=sft&n=20" --model smollm2-135m
    appo data check-template --model tiny-test --format hermes

`synth` writes JSONL (or parquet for a .parquet name): train/eval splits as question rows
(`question`, `answer`, `data_source`, `ability`, `extra_info`) that the RL loader reads; the
sft split as OpenAI `messages` rows with gold demonstrations (tools actually run).
"""

from __future__ import annotations

import argparse

from appo.cli_args import nonneg_int, positive_int


def register(sub) -> None:
    p = sub.add_parser("data", help="generate synthetic tasks, inspect data files")
    data_sub = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    p.set_defaults(handler=lambda args: (p.print_help(), 0)[1])

    s = data_sub.add_parser("synth", help="write a synthetic task (arith | lookup) to a file")
    s.add_argument("task", choices=["arith", "lookup"])
    s.add_argument("--n", type=positive_int, default=None, help="number of items (default per split)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--split", choices=["train", "eval", "sft"], default="train")
    s.add_argument("--levels", help="arith levels, e.g. 2,3,4 (default 1,2,3,4)")
    s.add_argument("--hops", help="lookup hops, e.g. 2 (default 1,2)")
    s.add_argument("--corpus", help="lookup: corpus path (default: OUT with .corpus.jsonl)")
    s.add_argument("--template", default=None,
                   help="prompt template for sft demos (default: math for arith, search for lookup)")
    s.add_argument("--out", required=True, help="output .jsonl or .parquet")
    s.set_defaults(handler=_synth)

    i = data_sub.add_parser("inspect", help="schema, counts and one rendered sample of a data spec")
    i.add_argument("spec", help="file, HF dataset dir, or synth:TASK?options")
    i.add_argument("--model", default="tiny-test",
                   help="model whose chat template / tokenizer renders the sample (default tiny-test)")
    i.add_argument("--template", default=None, help="prompt template (default by data)")
    i.add_argument("--tools", default=None, help="comma-separated tool tags (default: template's)")
    i.add_argument("--sft", action="store_true", help="treat the data as SFT conversations")
    i.add_argument("--index", type=nonneg_int, default=0, help="which example to render")
    i.set_defaults(handler=_inspect)

    c = data_sub.add_parser(
        "check-template",
        help="check that rollout tokens equal the model's chat template rendering")
    c.add_argument("--model", default="tiny-test", help="model spec (default tiny-test)")
    c.add_argument("--format", choices=["tags", "hermes"], default="hermes",
                   help="tool-call format, tools.format (default hermes)")
    c.add_argument("--tools", default="python",
                   help="comma-separated tools (python, search; default python)")
    c.set_defaults(handler=_check_template)


def _synth_spec(args: argparse.Namespace) -> str:
    options = {"split": args.split, "seed": args.seed, "n": args.n}
    if args.task == "arith":
        options["levels"] = args.levels
    else:
        options["hops"] = args.hops
        options["corpus"] = args.corpus
    query = "&".join(f"{k}={v}" for k, v in options.items() if v is not None)
    return f"synth:{args.task}?{query}"


def _write_rows(rows: list[dict], out) -> None:
    import json

    from appo.fsutil import output_file

    out.parent.mkdir(parents=True, exist_ok=True)
    with output_file(out) as tmp:  # a full disk leaves the old file (or none), never half
        if out.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), tmp)
        else:
            with tmp.open("w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")


def _synth(args: argparse.Namespace) -> int:
    from pathlib import Path

    from appo.data.synth import SYNTH_TASKS, generate, synth_conversations

    out = Path(args.out)
    if args.task == "lookup" and not args.corpus:
        args.corpus = str(out.with_name(out.name.split(".")[0] + ".corpus.jsonl"))
    spec = _synth_spec(args)
    if args.split == "sft":
        template = args.template or ("math" if args.task == "arith" else "search")
        convs = synth_conversations(spec, template=template, tools=SYNTH_TASKS[args.task].tools)
        rows = [{"messages": c.messages, "data_source": c.data_source} for c in convs]
    else:
        rows = [
            {"question": it.question, "answer": it.answer, "data_source": it.data_source,
             "ability": it.ability, "extra_info": it.extra_info}
            for it in generate(spec, default_split=args.split)
        ]
    _write_rows(rows, out)
    print(f"wrote {len(rows)} {args.task} {args.split} rows to {out}  (spec: {spec})")
    if args.task == "lookup":
        print(f"corpus for the bm25 search backend: {args.corpus}")
    return 0


def _is_sft(spec_text: str) -> bool:
    from appo.data.sources import parse_spec, read_spec_rows

    spec = parse_spec(spec_text)
    if spec.kind == "synth":
        return spec.options.get("split") == "sft"
    row = read_spec_rows(spec)[0]
    return "messages" in row or "conversations" in row


def _inspect(args: argparse.Namespace) -> int:
    from collections import Counter

    from appo.data.rl import load_rl_data
    from appo.data.sft import load_conversations, show_loss_mask, tokenize_conversation
    from appo.data.sources import parse_spec, read_spec_rows
    from appo.errors import AppoError
    from appo.models import load_model

    spec = parse_spec(args.spec)
    tools = None if args.tools is None else [t for t in args.tools.split(",") if t]
    sft = args.sft or _is_sft(args.spec)
    if spec.kind == "file":
        rows = read_spec_rows(spec)
        print(f"{spec.target}: {len(rows)} rows")
        print("schema (first row):")
        for key, value in rows[0].items():
            print(f"  {key}: {_describe(value)}")
    template = args.template or _guess_template(spec)
    tokenizer = load_model(args.model).tokenizer
    if sft:
        convs = load_conversations(args.spec, template=template, tools=tools)
        print(f"{len(convs)} conversations; per data_source: "
              f"{dict(Counter(c.data_source for c in convs))}")
        if not 0 <= args.index < len(convs):
            raise AppoError(f"--index {args.index} out of range (0..{len(convs) - 1})")
        conv = convs[args.index]
        ex = tokenize_conversation(tokenizer, conv.messages, data_source=conv.data_source)
        print(f"\nexample {args.index}: {len(ex)} tokens, {sum(ex.loss_mask)} trained "
              f"(inside [[ ]]), tokenizer of {args.model}:\n")
        print(show_loss_mask(tokenizer, ex))
        return 0
    data = load_rl_data(args.spec, template=template, tools=tools)
    print(f"{len(data.examples)} RL examples; per data_source: {dict(data.stats.per_source)}; "
          f"per ability: {dict(data.stats.per_ability)}")
    if not 0 <= args.index < len(data.examples):
        raise AppoError(f"--index {args.index} out of range (0..{len(data.examples) - 1})")
    ex = data.examples[args.index]
    text = tokenizer.apply_chat_template(ex.prompt, tokenize=False, add_generation_prompt=True)
    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    print(f"\nexample {args.index} ({ex.data_source}/{ex.ability}): prompt of {n} tokens with "
          f"the chat template of {args.model}; loss mask all 0 (RL prompts are not trained on):\n")
    print(text)
    print(f"ground truth: {ex.ground_truth!r}")
    return 0


KNOWN_TOOLS = {"python": "appo.tools.python_tool.PythonTool",
               "search": "appo.tools.search_tool.SearchTool"}


def _check_template(args: argparse.Namespace) -> int:
    from appo.errors import AppoError
    from appo.models import load_model
    from appo.rollout.template_check import check_template
    from appo.tools.formats import function_schema
    from appo.tools.registry import tool_schemas

    names = [t for t in args.tools.split(",") if t]
    if not names:
        raise AppoError("--tools needs at least one tool name")
    unknown = [n for n in names if n not in KNOWN_TOOLS]
    if unknown:  # checking a made-up schema would answer "ok" for a tool that does not exist
        raise AppoError(f"--tools: unknown tool {unknown[0]!r} (known: "
                        f"{', '.join(sorted(KNOWN_TOOLS))})")
    known = {n: {"class_path": KNOWN_TOOLS[n]} for n in names}
    by_name = {s["function"]["name"]: s for s in tool_schemas({"tool_instances": known})}
    schemas = [by_name.get(n) or function_schema(n) for n in names]
    tokenizer = load_model(args.model).tokenizer
    print(check_template(tokenizer, args.format, schemas, names).line())
    return 0


def _describe(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return f"list[{_describe(value[0]) if value else ''}] (len {len(value)})"
    return type(value).__name__


def _guess_template(spec) -> str:
    if spec.kind == "synth":
        return "search" if spec.target == "lookup" else "math"
    return "math"
