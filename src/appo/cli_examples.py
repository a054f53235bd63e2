"""One or more example lines for every `appo` sub-command, shown at the end of its `--help`
(and in docs/reference/cli.md). Kept in one table rather than in each area's `register` so
that a new sub-command without an example fails `tests/test_cli_consistency.py`, which also
parses every line here with the real parser: an example that no longer parses fails too.

Keys are the sub-command's words (`search cache stats`); values are command lines.
"""

from __future__ import annotations

EXAMPLES: dict[str, tuple[str, ...]] = {
    "config show": ("appo config show configs/demo.yaml rollout.n=8",
                    "appo config show actor.optim", "appo config show --comments"),
    "config explain": ("appo config explain actor.clip_ratio_high", "appo config explain sft"),
    "models": ("appo models",),
    "generate": ('appo generate --model tiny-test --max-new-tokens 16 "What is 17*23?"',),
    "reference": ("appo reference --out docs/reference",),
    "search index": ("appo search index --out index/ corpus.jsonl",),
    "search query": ('appo search query --backend bm25 --index-dir index/ "capital of France"',),
    "search cache import": ("appo search cache import results.jsonl",),
    "search cache export": ("appo search cache export --backend brightdata entries.jsonl",),
    "search cache stats": ("appo search cache stats",),
    "search pages build": ("appo search pages build --out pages/ corpus.jsonl",),
    "tool python": ('appo tool python "print(17 * 23)"',),
    "data synth": ("appo data synth arith --n 64 --out arith.jsonl",),
    "data inspect": ("appo data inspect examples/reverse_train.jsonl --model tiny-test",),
    "data check-template": ("appo data check-template --model tiny-test --format hermes",),
    "rollout": ('appo rollout --model tiny-test rollout.n=4 rollout.initial_rollouts=2 '
                'data.max_prompt_length=1024 "What is 17*23?"',),
    "export": ("appo export runs/appo-20260101-120000/global_step_20 exported/",),
    "plan": ("appo plan configs/arpo_qwen2.5_7b_reasoning.yaml --gpus 8",),
    "sft": ("appo sft --model tiny-test sft.max_steps=2",),
    "train": ("appo train --config examples/tutorial.yaml",
              "appo train --model tiny-test trainer.total_steps=1 rollout.n=4 "
              "rollout.initial_rollouts=2 data.max_prompt_length=1024 "
              "data.max_response_length=64",
              "appo train --plugin examples/fixed_split.py rollout.strategy=fixed_split "
              "--model tiny-test trainer.total_steps=1 data.max_prompt_length=1024"),
    "demo": ("appo demo", "appo demo --print-config"),
    "eval": ("appo eval --model tiny-test --data 'arith=synth:arith?split=eval' --limit 8",),
    "view": ("appo view runs/eval/arith/trajectories.jsonl --model tiny-test",),
    "compare": ("appo compare spec.yaml --dry-run",),
}


def epilog(words: str) -> str | None:
    """The `--help` epilog of a sub-command: its examples, or None when it has none."""
    lines = EXAMPLES.get(words)
    if not lines:
        return None
    return "examples:\n" + "\n".join("  " + line for line in lines)
