"""Core sub-commands: `appo config show`, `appo config explain`, `appo models`,
`appo generate`.

Heavy imports happen inside handlers only. The argparse helpers every area's commands share
are in `appo.cli_args` (re-exported here for modules that still import them from here).
"""

from __future__ import annotations

import argparse

from appo.cli_args import (  # noqa: F401 - re-exported
    add_config_args,
    add_model_option,
    add_plugin_option,
    config_from_args,
    load_plugin_args,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    probability,
    split_overrides,
)


def _config_show(args: argparse.Namespace) -> int:
    from pathlib import Path

    from omegaconf import OmegaConf

    from appo.config import load_config, to_yaml
    from appo.errors import AppoError

    # `appo config show [FILE] key=value ...`: the file is the one item without "=", wherever
    # it stands (or --config, as for every other command). An item that is no file but a
    # config key (`appo config show rollout.n`) shows that key only.
    files = [i for i in args.items if "=" not in i]
    overrides = [i for i in args.items if "=" in i]
    keys = [i for i in files if not Path(i).exists() and _is_config_key(i)]
    files = [i for i in files if i not in keys]
    for item in files:
        if not Path(item).exists() and "." in item and "/" not in item and not item.endswith(
                (".yaml", ".yml")):  # meant as a key: say which keys are near
            from appo.config import unknown_key_error

            raise AppoError(f"{item!r} is no config file, and "
                            + str(unknown_key_error(item)).replace("unknown config key", "no "
                                                                  "config key", 1))
    if args.config is not None:
        files.insert(0, args.config)
    if len(files) > 1:
        raise AppoError(f"give one config file, got {len(files)}: {', '.join(files)}")
    cfg = load_config(files[0] if files else None, overrides)
    if not keys:
        text = to_yaml(cfg)
        if args.comments:
            from appo.reference.config_doc import annotate_yaml

            text = annotate_yaml(text)
        print(text, end="")
    for key in keys:
        value = OmegaConf.select(cfg, key)
        if OmegaConf.is_config(value):
            body = "".join("  " + line + "\n" for line in to_yaml(value).splitlines())
            print(f"{key}:\n{body}", end="")
        else:
            print(OmegaConf.to_yaml({key: value}), end="")
    return 0


def _config_explain(args: argparse.Namespace) -> int:
    from appo.reference.config_doc import explain

    print("\n".join(explain(key) for key in args.keys), end="")
    return 0


def _is_config_key(item: str) -> bool:
    from omegaconf import OmegaConf

    from appo.config import AppoConfig

    if not item or item.startswith(("/", ".")) or item.endswith((".yaml", ".yml")):
        return False
    try:
        node = OmegaConf.select(OmegaConf.structured(AppoConfig), item,
                                throw_on_missing=False, default=KeyError)
    except Exception:  # noqa: BLE001 - not a key path OmegaConf can read
        return False
    return node is not KeyError


def _models(args: argparse.Namespace) -> int:
    from appo.models.loader import ALIASES, cached_models, converted_dir, smollm2_gguf_path

    print("aliases:")
    for name, what in ALIASES.items():
        status = ""
        if name == "smollm2-135m":
            try:
                gguf = smollm2_gguf_path()
                status = f" [gguf: {gguf}]"
            except Exception as e:  # noqa: BLE001 - shown, not raised
                status = f" [not installed: {e}]"
            if (converted_dir(name) / ".complete").is_file():
                status += " [converted]"
        print(f"  {name:14s} {what}{status}")
    rows = cached_models()
    print("cache:" if rows else "cache: (empty)")
    for name, path, size in rows:
        print(f"  {name:14s} {size:8.1f} MB  {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from appo.models import load_model
    from appo.models.generate import generate_chat

    prompt = " ".join(args.prompt).strip()
    if not prompt:
        from appo.errors import AppoError

        raise AppoError("give a prompt, e.g. appo generate \"What is 17*23?\"")
    lm = load_model(args.model, dtype=args.dtype, device=args.device)
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": prompt})
    [reply] = generate_chat(
        lm,
        [messages],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    print(reply)
    return 0


def register(sub) -> None:
    p = sub.add_parser("config", help="show the resolved configuration, explain a key")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = csub.add_parser("show", help="print the resolved config (defaults <- FILE <- overrides)")
    show.add_argument("items", nargs="*", metavar="[FILE] key=value",
                      help="a YAML config file and dotted overrides, in any order")
    show.add_argument("--config", "-c", metavar="FILE", help="YAML config file")
    add_plugin_option(show)
    show.add_argument("--comments", action="store_true",
                      help="each key's meaning as a comment above it (appo config explain)")
    show.set_defaults(handler=_config_show)
    explain = csub.add_parser(
        "explain", help="what a key means: type, default, allowed values, verl's name",
        description="Print a config key's entry of docs/reference/config.md; a section or "
                    "group (actor, actor.optim) prints all of its keys.")
    explain.add_argument("keys", nargs="+", metavar="KEY", help="a dotted config key")
    explain.set_defaults(handler=_config_explain)

    p = sub.add_parser("models", help="list model aliases and what is cached")
    p.set_defaults(handler=_models)

    p = sub.add_parser("generate", help="reply to one prompt through the model's chat template")
    p.add_argument("prompt", nargs="+", help="the user message")
    p.add_argument("--model", "-m", default="smollm2-135m", help="any appo.models spec")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=probability, default=1.0)
    p.add_argument("--top-k", type=nonneg_int, default=0, help="0 = off")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto")
    p.set_defaults(handler=_generate)
