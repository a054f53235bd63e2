"""Run under `accelerate launch` (2 processes): one update on a fixed batch, rank 0 saves params.

Each rank takes the rows of its own prompt groups, as the trainer does after a rollout.
argv: output file, the tests/trainer directory, and the layouts, comma-separated (`ddp`,
`fsdp` or `ddp,fsdp`: one launch for both, each on a freshly loaded model); the output maps
each layout to its parameters and metrics.
"""

import sys

import torch

sys.path.insert(0, sys.argv[2])  # the tests/trainer directory, for the shared fixed batch
from test_trainer_rl import _fixed_rows  # noqa: E402

from appo.config import ActorConfig  # noqa: E402
from appo.models import load_model  # noqa: E402
from appo.trainer.distributed import DataParallel, GradSync  # noqa: E402
from appo.trainer.fsdp import full_model_state, shard_model  # noqa: E402
from appo.trainer.update import update_policy  # noqa: E402

dp = DataParallel.from_env()
assert dp.world == 2, dp.world


def one_update(mode: str) -> dict:
    lm = load_model("tiny-test")
    rows = _fixed_rows(lm.tokenizer, n=8)  # uids u0..u3
    # Rank 0's rows are shorter: under the 64-token budget it gets 3 micro-batches and rank 1
    # gets 4, so FSDP's idle pass (keeping the ranks' collectives in step) runs.
    mine = [i for i, u in enumerate(rows.uids) if int(u[1:]) % dp.world == dp.rank]
    actor = ActorConfig(ppo_mini_batch_size=4, ppo_max_token_len_per_device=64)
    if mode == "fsdp":
        shard_model(lm.model, dp.world)
    # SGD, not AdamW: the test compares the weights with a single process summing in another
    # order, which only SGD keeps within float32 rounding (test_trainer_critic.with_sgd).
    opt = torch.optim.SGD(lm.model.parameters(), lr=0.1)
    # DDP: torch's DistributedDataParallel, built once as the trainer does.
    sync = GradSync(lm.model) if mode == "ddp" else None
    metrics = update_policy(lm.model, opt, rows.select(mine), actor, max_response_length=384,
                            dp=dp, fsdp=mode == "fsdp", ddp=sync)
    params = ([v for v in full_model_state(lm.model).values()] if mode == "fsdp"
              else [p.detach() for p in lm.model.parameters()])
    names = (list(full_model_state(lm.model)) if mode == "fsdp"
             else [n for n, _ in lm.model.named_parameters()])
    return {"params": dict(zip(names, params, strict=True)), "metrics": metrics}


results = {mode: one_update(mode) for mode in sys.argv[3].split(",")}
if dp.is_main:
    torch.save(results, sys.argv[1])
