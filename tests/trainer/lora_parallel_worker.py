"""Run under `accelerate launch` (2 processes): one LoRA update on a fixed batch, each rank
with the rows of its own prompt groups; rank 0 saves the whole adapter, the whole base
weights and the merged rollout model.

argv: output file, the tests/trainer directory, and the layouts, comma-separated (`ddp`,
`fsdp` or `ddp,fsdp`: one launch for both, each from a fresh set-up); the output maps each
layout to its results.
"""

import sys

import torch

sys.path.insert(0, sys.argv[2])  # the tests/trainer directory, for the shared set-up
from test_trainer_lora_parallel import lora_update_setup  # noqa: E402

from appo.trainer.distributed import DataParallel, GradSync  # noqa: E402
from appo.trainer.fsdp import full_model_state, shard_model  # noqa: E402
from appo.trainer.update import update_policy  # noqa: E402

dp = DataParallel.from_env()
assert dp.world == 2, dp.world


def one_update(mode: str) -> dict:
    lora, rows, actor = lora_update_setup()
    lora.rollout_model()  # built before sharding, as the trainer does
    mine = [i for i, u in enumerate(rows.uids) if int(u[1:]) % dp.world == dp.rank]
    if mode == "fsdp":
        shard_model(lora.model, dp.world)
    opt = torch.optim.SGD(lora.trainable(), lr=0.1)  # as the test's single process (see there)
    # DDP: torch's DistributedDataParallel (only the adapter's parameters require grads).
    sync = GradSync(lora.model) if mode == "ddp" else None
    metrics = update_policy(lora.model, opt, rows.select(mine), actor, max_response_length=384,
                            dp=dp, fsdp=mode == "fsdp", ddp=sync)
    # Every rank (under FSDP these are collectives): merge, gather the adapter and the model.
    merged = {n: p.detach().clone() for n, p in lora.rollout_model().named_parameters()}
    adapter = lora.adapter_state()
    state = full_model_state(lora.model) if mode == "fsdp" else {
        n: p.detach() for n, p in lora.model.named_parameters()}
    return {"params": state, "adapter": adapter, "merged": merged, "metrics": metrics}


results = {mode: one_update(mode) for mode in sys.argv[3].split(",")}
if dp.is_main:
    torch.save(results, sys.argv[1])
