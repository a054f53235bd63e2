"""Run under `accelerate launch` (2 processes): the critic's values and one update on a fixed
batch, each rank with the rows of its own prompt groups; rank 0 saves the results.

argv: output file, the tests/trainer directory.
"""

import sys

import torch

sys.path.insert(0, sys.argv[2])  # the tests/trainer directory, for the shared fixed batch
from test_trainer_critic import fixed_critic_rows, make_critic, with_sgd  # noqa: E402

from appo.trainer.distributed import DataParallel  # noqa: E402

dp = DataParallel.from_env()
assert dp.world == 2, dp.world
# Rank 1's rows are longer: under the 48-token budget the ranks run different numbers of
# micro-batches, and both ranks see several mini-batches (2 prompts each, 1 per rank).
critic, tok = make_critic("critic.ppo_max_token_len_per_device=48", "critic.ppo_epochs=2")
with_sgd(critic)  # compared with one process summing in another order (see with_sgd)
rows = fixed_critic_rows(tok, n=8, branch_row=True)  # uids u0..u3, the branch row in u0
mine = [i for i, u in enumerate(rows.uids) if int(u[1:]) % dp.world == dp.rank]
values = critic.values(rows, mine, dp)  # every row's value, each rank computing its own
metrics = critic.update(rows.select(mine), dp)
if dp.is_main:
    torch.save({"values": values, "metrics": metrics,
                "params": {n: p.detach() for n, p in critic.model.named_parameters()}},
               sys.argv[1])
