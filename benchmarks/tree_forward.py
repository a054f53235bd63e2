"""The tree-shared update forward against today's prefix-only forward, on arpo steps.

Rolls out arpo steps (the `benchmarks/train_step.py` part 1 setting: 2 prompts of
`synth:arith` x 8 trajectories, 4 initial, the python tool, up to 256 response tokens), then
runs the same update (`appo.trainer.update.update_policy`, one optimizer step, AdamW) on
each step's batch from the same weights with `actor.tree_forward` off and on, alternating
the order, `--repeats` times each after one warm-up of each. Reports per step:
- tokens the forwards compute (the rows' tokens, prefix-only, tree) and the fraction of the
  prefix-only forward's tokens the tree no longer recomputes;
- the update-time ratio tree / prefix-only (medians, same process and run);
- the largest parameter difference between the two updated models (exactness in float32).

    .venv/bin/python benchmarks/tree_forward.py            # SmolLM2-135M
    .venv/bin/python benchmarks/tree_forward.py --quick    # tiny-test model
    .venv/bin/python benchmarks/tree_forward.py --batches /tmp/b.pt   # keep the rollouts
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def arpo_batches(model: str, steps: int, out: str, response_len: int,
                 saved: Path | None = None):
    """(trainer, [TrainBatch with advantages]) from `steps` arpo rollouts; with `saved`, the
    batches are read from that file when it exists and written to it otherwise."""
    import torch
    from train_step import appo_config

    from appo.trainer.batch import TrainBatch, compute_advantages
    from appo.trainer.loop import RLTrainer

    cfg = appo_config(model, True, response_len, "arpo", out)
    trainer = RLTrainer(cfg, progress=False)
    if saved is not None and saved.exists():
        trainer.tools.close()
        return trainer, torch.load(saved, weights_only=False)
    batches = []
    for step in range(steps):
        rollout, by_uid = trainer.rollout(trainer.batch_for_step(step), f"s{step}", step)
        trainer.score(rollout.trajectories, by_uid)
        batch, _ = compute_advantages(TrainBatch.collate(rollout.trajectories, trainer.pad_id),
                                      cfg.algorithm.adv_estimator, trainer.adv_params)
        batches.append(batch)
    trainer.tools.close()
    if saved is not None:
        torch.save(batches, saved)
    return trainer, batches


def timed_update(trainer, batch, tree: bool) -> tuple[float, dict, list]:
    import torch

    from appo.trainer.update import update_policy

    model = copy.deepcopy(trainer.model)
    actor = copy.deepcopy(trainer.cfg.actor)
    actor.tree_forward = tree
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    t0 = time.perf_counter()
    metrics = update_policy(model, opt, batch, actor, trainer.cfg.data.max_response_length,
                            temperature=trainer.train_temperature,
                            compute_dtype=trainer.compute_dtype)
    secs = time.perf_counter() - t0
    return secs, metrics, [p.detach() for p in model.parameters()]


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny-test model")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--steps", type=int, default=2, help="arpo rollouts (batches)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int,
                   help="actor.ppo_max_token_len_per_device (default: the config's)")
    p.add_argument("--batches", type=Path,
                   help="reuse the rollouts saved in this file (written if it is missing)")
    args = p.parse_args()
    torch.set_num_threads(2)
    model = "tiny-test" if args.quick else args.model
    with tempfile.TemporaryDirectory() as tmp:
        trainer, batches = arpo_batches(model, args.steps, tmp, args.response_len,
                                        args.batches)
    if args.max_tokens:
        trainer.cfg.actor.ppo_max_token_len_per_device = args.max_tokens
    results = []
    for k, batch in enumerate(batches):
        times: dict[bool, list[float]] = {False: [], True: []}
        metrics, params = {}, {}
        for r in range(args.repeats + 1):
            for tree in ((False, True) if r % 2 == 0 else (True, False)):
                secs, metrics[tree], params[tree] = timed_update(trainer, batch, tree)
                print(f"step {k} round {r} tree={tree}: {secs:.1f} s", flush=True)
                if r > 0:  # the first round warms up allocators
                    times[tree].append(secs)
        rows_tokens = int(batch.lengths[batch.trainable_rows()].sum())
        prefix_tokens = metrics[False]["actor/computed_tokens"]
        tree_tokens = metrics[True]["actor/computed_tokens"]
        diff = max((a - b).abs().max().item()
                   for a, b in zip(params[False], params[True], strict=True))
        res = {
            "step": k, "rows": len(batch), "trainable_rows": len(batch.trainable_rows()),
            "branches": sum(pid is not None for pid in batch.parent_ids),
            "rows_tokens": rows_tokens, "prefix_tokens": prefix_tokens,
            "tree_tokens": tree_tokens,
            "saved_vs_prefix": 1 - tree_tokens / prefix_tokens,
            "saved_vs_rows": 1 - tree_tokens / rows_tokens,
            "prefix_s": statistics.median(times[False]), "tree_s": statistics.median(times[True]),
            "prefix_runs": times[False], "tree_runs": times[True],
            "grad_norm": [metrics[False]["actor/grad_norm"], metrics[True]["actor/grad_norm"]],
            "max_param_diff": diff,
        }
        res["time_ratio"] = res["tree_s"] / res["prefix_s"]
        results.append(res)
        print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
