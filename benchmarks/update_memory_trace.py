"""Resident memory within the update, micro-batch by micro-batch (issue 20, part 1).

Two arpo updates (`appo.trainer.update.update_policy`, one model and one AdamW, so the second
runs with the moments allocated, as every step after the first does) on saved rollouts of
part (1) of `train_step.py`; a sampler thread reads the RSS every 3 ms and keeps, per label
(each micro-batch's forward, its backward, the AdamW step), the RSS at the label's start and
its peak. Where `benchmarks/memory.py` gives one figure per trainer phase, this shows which
micro-batch sets the update's peak and how much of it comes in the backward.

    .venv/bin/python benchmarks/tree_forward.py --steps 2 --batches /tmp/b.pt   # the rollouts
    .venv/bin/python benchmarks/update_memory_trace.py --batches /tmp/b.pt
    .venv/bin/python benchmarks/update_memory_trace.py --batches /tmp/b.pt \
        --set ppo_max_token_len_per_device=640        # an actor key (JSON value)
    MALLOC_MMAP_THRESHOLD_=2097152 .venv/bin/python benchmarks/update_memory_trace.py ...

Figures: benchmarks/HISTORY.md ("The update's peak, micro-batch by micro-batch").
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=Path, required=True,
                   help="rollouts saved by tree_forward.py --batches (written if missing)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="an actor config value, e.g. ppo_max_token_len_per_device=640")
    p.add_argument("--freeze-embeddings", action="store_true")
    args = p.parse_args()

    import torch
    from tree_forward import arpo_batches

    from appo.trainer import update
    from appo.trainer.memory import rss_bytes, trim_freed_memory

    trainer, batches = arpo_batches(args.model, 2, tempfile.mkdtemp(), 256, args.batches)
    for kv in args.set:
        key, value = kv.split("=", 1)
        setattr(trainer.cfg.actor, key, json.loads(value))
    model, actor = trainer.model, trainer.cfg.actor
    if args.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-6)

    label, peaks, stop = ["load"], {}, threading.Event()

    def sample() -> None:
        while not stop.is_set():
            mb, name = rss_bytes() / 2**20, label[0]
            start_peak = peaks.setdefault(name, [mb, mb])
            start_peak[1] = max(start_peak[1], mb)
            time.sleep(0.003)

    step, count = [0], [0]
    micro, logprobs, adam = update._micro_step, update.response_logprobs, opt.step

    def traced_micro(model, mb, *a, **k):
        count[0] += 1
        label[0] = (f"step {step[0]} mb {count[0]} forward ({int(mb.lengths.sum())} row "
                    f"tokens, {len(mb)} rows)")
        out = micro(model, mb, *a, **k)
        label[0] = f"step {step[0]} after mb {count[0]}"
        return out

    def traced_logprobs(*a, **k):
        out = logprobs(*a, **k)
        label[0] = label[0].replace("forward", "backward")  # the loss is cheap: backward next
        return out

    def traced_adam(*a, **k):
        label[0] = f"step {step[0]} AdamW"
        return adam(*a, **k)

    update._micro_step, update.response_logprobs, opt.step = (traced_micro, traced_logprobs,
                                                              traced_adam)
    trim_freed_memory()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for i, batch in enumerate(batches, 1):
        step[0], count[0] = i, 0
        label[0] = f"step {i} start"
        t0 = time.perf_counter()
        update.update_policy(model, opt, batch, actor, trainer.cfg.data.max_response_length,
                             temperature=trainer.train_temperature,
                             compute_dtype=trainer.compute_dtype)
        label[0] = f"step {i} end ({time.perf_counter() - t0:.1f} s)"
        time.sleep(0.05)
        trim_freed_memory()
    stop.set()
    sampler.join()
    print(f"actor.ppo_max_token_len_per_device={actor.ppo_max_token_len_per_device}; "
          f"overrides {args.set}; embeddings frozen: {args.freeze_embeddings}")
    print("| label | RSS at start MB | peak MB |\n| --- | ---: | ---: |")
    for name, (start, peak) in peaks.items():
        print(f"| {name} | {start:.0f} | {peak:.0f} |")
    print(f"ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
