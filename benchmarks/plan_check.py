"""The memory plan (appo.trainer.plan) against measured allocations, on one device.

A random-weight model shaped like Qwen2.5-0.5B (its published sizes, tied embeddings) in
float32 master weights, bfloat16 autocast, as the trainer runs it without FSDP: the weights,
gradients and AdamW states, then one update forward and backward (`response_logprobs`, the
chunked LM head) over padded rows, with and without gradient checkpointing. Measured: the
most bytes autograd holds for the backward during the forward (saved-tensor hooks), and on
CUDA the allocator's peak over the forward and backward. Needs only torch, transformers and
appo's trainer modules (no config files, no download):

    python benchmarks/plan_check.py [--device cuda] [--fsdp] [--rows 4] [--row 1024] [--out FILE]

`--fsdp`: FSDP2 over one rank (NCCL on CUDA, gloo on CPU) with a bfloat16
`MixedPrecisionPolicy`, the sharding the plan assumes for `trainer.parallel=fsdp`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from appo.trainer.plan import (  # noqa: E402
    PlanInputs,
    activation_bytes,
    model_shape,
    plan_memory,
    weight_cast_bytes,
)

GIB = 2**30


def qwen25_05b_config(tiny: bool = False):
    from transformers import Qwen2Config

    if tiny:  # the same layout, small enough for a CPU
        return Qwen2Config(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                           max_position_embeddings=4096, tie_word_embeddings=True)
    return Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                       max_position_embeddings=32768, tie_word_embeddings=True,
                       rope_theta=1000000.0, rms_norm_eps=1e-6)


def shard(model, device) -> None:
    """FSDP2 over one rank, as the plan assumes it: each decoder layer a unit and the root
    another, bfloat16 parameters in the all-gather, float32 gradient reduction."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


class _Rows:
    def __init__(self, ids, lengths, prompt):
        self.input_ids, self.lengths = ids, lengths
        self.prompt_lens = torch.full_like(lengths, prompt)
        self.response_lens = lengths - prompt

    def __len__(self):
        return len(self.input_ids)


def update_step(model, rows, compute_dtype, hooks: bool):
    """One update forward and backward; the peak of bytes saved for the backward (hooks)."""
    import contextlib

    from appo.trainer.memory import peak_saved_bytes
    from appo.trainer.update import response_logprobs

    state = {"peak": 0}
    ctx = peak_saved_bytes(model) if hooks else contextlib.nullcontext(state)
    with ctx as state:
        logp, _, valid = response_logprobs(model, rows, 128, with_entropy=True,
                                           share_prefix=False, compute_dtype=compute_dtype)
        loss = -(logp * valid).sum() / valid.sum()
    loss.backward()
    return state["peak"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--row", type=int, default=1024)
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 over one rank, bf16 units")
    ap.add_argument("--tiny", action="store_true", help="a small model of the same layout")
    ap.add_argument("--out")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    config = qwen25_05b_config(args.tiny)
    shape = model_shape(config, name="qwen2.5-0.5b-shaped")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device).train()
    if args.fsdp:
        shard(model, device)
    cuda = device.type == "cuda"
    results: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu",
                     "parallel": "fsdp (one rank)" if args.fsdp else "single",
                     "rows": args.rows, "row": args.row, "checks": {}}
    tokens = args.rows * args.row
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab, (args.rows, args.row), generator=gen)
    lengths = torch.tensor([args.row - 37 * k for k in range(args.rows)])
    rows = _Rows(ids, lengths, prompt=64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for ckpt in (False, True):
        if ckpt:
            model.gradient_checkpointing_enable()
        inputs = PlanInputs(gpus=1, parallel="fsdp" if args.fsdp else "single",
                            device=device.type, master_bytes=4,
                            autocast=True, rollout="openai", token_budget=tokens, sdpa_gqa=False,
                            sequence_tokens=args.row, gradient_checkpointing=ckpt)
        plan = plan_memory(inputs, shape)
        saved, working = activation_bytes(inputs, shape)
        planned_saved = saved + weight_cast_bytes(inputs, shape)
        got = update_step(model, rows, torch.bfloat16, hooks=True)
        optimizer.step()  # the states exist from here on, as in every update but the first
        check = {"saved_measured_gb": got / GIB, "saved_planned_gb": planned_saved / GIB,
                 "saved_ratio": planned_saved / got}
        if cuda:
            if not args.fsdp:  # appo allocates the gradients before the backward
                for p in model.parameters():
                    p.grad = torch.zeros_like(p)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            update_step(model, rows, torch.bfloat16, hooks=False)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            resident = sum(plan.term(k).update for k in ("params", "optimizer")) + (
                0 if args.fsdp else plan.term("grads").update)
            planned = sum(t.update for t in plan.terms if t.key != "cuda_reserve")
            check.update({
                "resident_measured_gb": base / GIB, "resident_planned_gb": resident / GIB,
                "peak_measured_gb": peak / GIB, "peak_planned_gb": planned / GIB,
                "peak_ratio": planned / peak,
                "transient_measured_gb": (peak - base) / GIB,
                "transient_planned_gb": (planned - resident) / GIB})
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()
        results["checks"][f"ckpt={ckpt}"] = check
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
