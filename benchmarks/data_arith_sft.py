"""Headroom check for `synth:arith`: a short SFT on level-1 gold demos, then accuracy per level
*with* the python tool.

The claim to check: SFT on level-1 demonstrations alone teaches SmolLM2-135M the tool format
and solves level 1, while the upper levels (word problems: pick the numbers and operations)
keep clear headroom for RL.

1. SFT (appo.trainer.sft.train_sft) on `synth:arith?split=sft&levels=1&n=160` (math
   template, python tool; results masked), a fixed number of optimizer steps.
2. Greedy tool-using generation on `synth:arith?split=eval&levels=L&n=N`: generate until
   `</python>` or EOS; on `</python>` run the last python block in the real sandboxed
   PythonTool and append `" <result>\\n{text}\\n</result>"` as tokens; at most `--calls`
   calls, `--max-new-tokens` per turn. A minimal loop for this measurement only (the real
   rollout lives in appo.rollout).
3. Score with the `math` reward (strict: last \\boxed{} inside <answer>).

    .venv/bin/python benchmarks/data_arith_sft.py --n 100 --steps 60
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import tempfile
import time
from pathlib import Path

RESULT_TEMPLATE = " <result>\n{text}\n</result>"


def tool_rollout(lm, prompts, tool, max_new_tokens: int, calls: int, batch: int) -> list[str]:
    """Greedy generation with python tool calls; returns decoded responses."""
    import torch

    tok = lm.tokenizer
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    prompt_ids = [tok(tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"] for p in prompts]
    responses: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    for turn in range(calls + 1):
        still = []
        for s in range(0, len(active), batch):
            rows = active[s : s + batch]
            seqs = [prompt_ids[i] + responses[i] for i in rows]
            width = max(map(len, seqs))
            ids = torch.tensor([[pad] * (width - len(q)) + q for q in seqs])
            attn = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in seqs])
            with torch.inference_mode():
                out = lm.model.generate(
                    input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
                    do_sample=False, temperature=None, top_p=None, top_k=None,
                    stop_strings=["</python>"], tokenizer=tok, pad_token_id=pad,
                    eos_token_id=eos,
                )
            for row, new in zip(rows, out[:, width:].tolist(), strict=True):
                kept = []
                for t in new:
                    kept.append(t)
                    if t == eos or "</python>" in tok.decode(kept[-8:]):
                        break
                responses[row] += kept
                text = tok.decode(kept)
                if kept[-1] != eos and text.rstrip().endswith("</python>") and turn < calls:
                    code = re.findall(r"<python>(.*?)</python>", tok.decode(responses[row]),
                                      re.DOTALL)[-1]
                    result = tool.execute(code).text
                    responses[row] += tok(RESULT_TEMPLATE.format(text=result),
                                          add_special_tokens=False)["input_ids"]
                    still.append(row)
        active = still
        if not active:
            break
    return [tok.decode(r, skip_special_tokens=True) for r in responses]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sft-n", type=int, default=160)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--sft-batch", type=int, default=8)
    parser.add_argument("--n", type=int, default=100, help="eval questions per level")
    parser.add_argument("--levels", default="1,2,3,4")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/data_arith_sft.json")
    args = parser.parse_args()

    import torch

    from appo.config import SFTConfig
    from appo.data import load_rl_data, load_sft_data
    from appo.models import load_model
    from appo.rewards import math_reward
    from appo.tools.python_tool import PythonTool
    from appo.trainer.sft import train_sft

    torch.set_num_threads(2)
    torch.manual_seed(0)
    lm = load_model(args.model)
    tool = PythonTool()
    sft = load_sft_data(f"synth:arith?split=sft&levels=1&n={args.sft_n}", lm.tokenizer,
                        template="math", tools=["python"], tool_instances={"python": tool})
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = train_sft(lm.model, lm.tokenizer, sft.examples,
                           SFTConfig(epochs=100, batch_size=args.sft_batch, lr=args.lr,
                                     warmup_ratio=0.1, max_steps=args.steps, output_dir=tmp),
                           progress=False)
    sft_seconds = time.perf_counter() - t0
    print(f"SFT: {result.steps} steps in {sft_seconds:.0f} s, loss {result.train_loss[0]:.3f} -> "
          f"{result.train_loss[-1]:.3f}", flush=True)
    summary: dict = {
        "model": args.model, "sft_examples": len(sft.examples), "sft_steps": result.steps,
        "sft_lr": args.lr, "sft_batch": args.sft_batch, "sft_seconds": round(sft_seconds, 1),
        "sft_loss_first_last": [round(result.train_loss[0], 4), round(result.train_loss[-1], 4)],
        "eval": "greedy, python tool, strict math reward", "n_per_level": args.n,
        "max_new_tokens_per_turn": args.max_new_tokens, "max_calls": args.calls, "levels": {},
    }
    samples = {}
    for level in [int(x) for x in args.levels.split(",")]:
        examples = load_rl_data(f"synth:arith?split=eval&levels={level}&n={args.n}",
                                template="math", tools=["python"]).examples
        t1 = time.perf_counter()
        replies = tool_rollout(lm, [e.prompt for e in examples], tool, args.max_new_tokens,
                               args.calls, args.batch)
        scores = [math_reward(r, e.ground_truth) for r, e in zip(replies, examples, strict=True)]
        acc = sum(s.score for s in scores) / len(scores)
        summary["levels"][level] = {
            "acc": acc,
            "format_ok": sum(s.format_ok for s in scores) / len(scores),
            "used_python": sum("</python>" in r for r in replies) / len(replies),
            "seconds": round(time.perf_counter() - t1, 1),
        }
        samples[level] = [{"q": e.question, "gold": e.ground_truth, "reply": r}
                          for e, r in zip(examples[:3], replies[:3], strict=True)]
        print(f"level {level}: acc {acc:.2f} {summary['levels'][level]}", flush=True)
    tool.close()
    summary["machine"] = f"{platform.machine()} CPU, torch {torch.__version__}"
    summary["date"] = time.strftime("%Y-%m-%d")
    summary["samples"] = samples
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main()
