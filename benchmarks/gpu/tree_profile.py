"""Where the tree forward's time goes on a GPU: `gpu_check.py`'s tree_forward setting (an
APPO rollout of the Qwen2.5-0.5B-shaped random model), one warm pass of the flat and of the
tree forward + backward under torch.profiler; the top ops by self CUDA time and by self CPU
time, model calls per pass, and each pass's wall time against its GPU busy time.

    python benchmarks/gpu/tree_profile.py --out OUT       # one CUDA device
    python benchmarks/gpu/tree_profile.py --device cpu --tiny --out OUT
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    import gpu_check as gc
    from torch.profiler import ProfilerActivity, profile

    from appo.trainer.batch import TrainBatch
    from appo.trainer.update import response_logprobs

    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.arch = gc.TINY if args.tiny else gc.QWEN25_05B
    args.device_name = "cuda:0" if args.device == "cuda" else "cpu"
    args.prompts, args.n = (2, 4) if args.tiny else (8, 4)
    args.response_len = 16 if args.tiny else 128
    cuda = args.device == "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        gc.write_data(root, 4 * args.prompts)
        trainer = gc.trainer_for(args, gc.make_config(args, root, "tree", "rollout.strategy=appo"))
        rollout, by_uid = trainer.rollout(trainer.batch_for_step(0), "s0", 13)
        trainer.score(rollout.trajectories, by_uid)
        trainer.tools.close()
        batch = TrainBatch.collate(rollout.trajectories, trainer.pad_id)
        model = trainer.model
        model.train()
        groups = [[i for i, u in enumerate(batch.uids) if u == uid]
                  for uid in dict.fromkeys(batch.uids)]
        calls = {"n": 0}
        model.model.register_forward_pre_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))

        def one_pass(tree: bool) -> None:
            for idx in groups:
                mini = batch.select(idx)
                logp, _, mask = response_logprobs(model, mini, 128, False, share_prefix=tree,
                                                  tree=tree, compute_dtype=trainer.compute_dtype)
                (-(logp * mask).sum()).backward()
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()

        for tree in (False, True):  # warm both
            one_pass(tree)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        for name, tree in (("flat", False), ("tree", True)):
            calls["n"] = 0
            t0 = time.perf_counter()
            one_pass(tree)
            wall = time.perf_counter() - t0
            n_calls = calls["n"]
            with profile(activities=acts) as prof:
                one_pass(tree)
            ka = prof.key_averages()
            gpu = sum(e.self_device_time_total for e in ka) / 1e6 if cuda else 0.0
            lines += [f"## {name}: wall {wall:.3f} s (unprofiled), model calls {n_calls}, "
                      f"GPU busy {gpu:.3f} s", ""]
            key = "self_device_time_total" if cuda else "self_cpu_time_total"
            lines.append(ka.table(sort_by=key, row_limit=12, max_name_column_width=48))
            lines.append(ka.table(sort_by="self_cpu_time_total", row_limit=8,
                                  max_name_column_width=48))
    text = "\n".join(lines)
    (out / "tree_profile.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
