"""How large on-policy recompute noise is in APPO's log-ratios, by dtype.

APPO's Future Value sums `lr = logp_current - logp_rollout` over the rest of a row. In this
project's trainer the scorer is the very policy that sampled, so `lr` is pure float noise:
the engine (batched, KV cache, lean forward) and `hf_score_fn` (one full forward) round
differently. `appo.rollout.scoring.LR_NOISE_TOL` must sit above that noise for each dtype,
or branch points get ranked by it. Prints, per dtype and sampling setting, the largest
|lr| over the sampled tokens and the spread of FV per row.

    .venv/bin/python benchmarks/appo_lr_noise.py                     # float32,bfloat16,float16
    .venv/bin/python benchmarks/appo_lr_noise.py --dtypes float32 --max-tokens 384
    .venv/bin/python benchmarks/appo_lr_noise.py --dtypes float32,float32+bf16w

`float32+bf16w`: a float32 model whose engine decodes with `rollout.cpu_weights=bfloat16`
(bfloat16 matmul weights), scored by the float32 model: how far the engine's behaviour
log-probs sit from the float32 trainer's.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from appo.data.templates import build_messages
    from appo.models import load_model
    from appo.rollout import RolloutPrompt, RolloutSettings, rollout
    from appo.rollout.hf_engine import HFEngine
    from appo.rollout.sampling import SamplingParams
    from appo.rollout.scoring import branching_scores, hf_score_fn

    samplings = {"plain": SamplingParams(),
                 "eval": SamplingParams(temperature=0.6, top_p=0.95, top_k=20,
                                        repetition_penalty=1.1)}
    print("| dtype | sampling | rows (tokens) | max abs lr | mean abs lr | "
          "FV spread per row, max / median |")
    print("| --- | --- | --- | --- | --- | --- |")
    for spec in args.dtypes.split(","):
        dtype, _, weights = spec.partition("+")
        cpu_weights = {"": "float32", "bf16w": "bfloat16"}[weights]
        lm = load_model(args.model, dtype=dtype, device="cpu")
        tok = lm.tokenizer
        prompts = [RolloutPrompt(f"q{i}", list(tok.apply_chat_template(
            build_messages(q, "math", []), add_generation_prompt=True, tokenize=True,
            return_dict=False))) for i, q in enumerate(["What is 17*23?", "Why is the sky blue?"])]
        for name, params in samplings.items():
            t0 = time.perf_counter()
            settings = RolloutSettings(n=4, initial_rollouts=4, sampling=params,
                                       max_response_length=args.max_tokens)
            batch = rollout(prompts, HFEngine(lm.model, tok, seed=0, cpu_weights=cpu_weights),
                            None, settings, strategy="grpo")
            current = hf_score_fn(lm.model, params)(batch.trajectories)
            spreads, worst, total, count = [], 0.0, 0.0, 0
            for traj, cur in zip(batch.trajectories, current, strict=True):
                mask = torch.tensor(traj.sampled_mask(), dtype=torch.bool)
                rollout_lp = torch.tensor(traj.logp_rollout)
                scores = branching_scores(torch.tensor(traj.entropy), cur, rollout_lp, mask,
                                          lr_noise_tol=0.0)
                spreads.append(float(scores.fv[mask].std(unbiased=False)))
                lr = (cur - rollout_lp)[mask]
                finite = lr[torch.isfinite(lr)].abs()
                worst = max(worst, float(finite.max()))
                total, count = total + float(finite.sum()), count + finite.numel()
            spreads.sort()
            tokens = sum(len(t.response_ids) for t in batch.trajectories)
            print(f"| {spec} | {name} | {len(spreads)} ({tokens}) | {worst:.2e} | "
                  f"{total / max(count, 1):.2e} | "
                  f"{spreads[-1]:.2e} / {spreads[len(spreads) // 2]:.2e} |  "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
