"""Run under `accelerate launch` (2 processes, FSDP): one actor update and the critic's values
and update on fixed batches, sharded, each rank with the rows of its own prompt groups (under
SGD: the test compares them with one process, see test_trainer_critic.with_sgd); then a
critic updated by its own AdamW, its checkpoint part saved (whole states gathered) and loaded
into a fresh sharded critic, and one more update of both. Rank 0 saves the results.

argv: output file, the tests/trainer directory, a directory for the critic's checkpoint part.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[2])  # the tests/trainer directory, for the shared fixed batches
from test_trainer_critic import fixed_critic_rows, make_critic, with_sgd  # noqa: E402
from test_trainer_rl import _fixed_rows  # noqa: E402

from appo.config import ActorConfig  # noqa: E402
from appo.models import load_model  # noqa: E402
from appo.trainer.distributed import DataParallel  # noqa: E402
from appo.trainer.fsdp import full_model_state, shard_model  # noqa: E402
from appo.trainer.update import update_policy  # noqa: E402

out, part_dir = sys.argv[1], Path(sys.argv[3])
dp = DataParallel.from_env()
assert dp.world == 2, dp.world


def mine(rows) -> list[int]:
    return [i for i, u in enumerate(rows.uids) if int(u[1:]) % dp.world == dp.rank]


# The actor, as ddp_update_worker.py's fsdp mode (uneven micro-batch counts over ranks).
lm = load_model("tiny-test")
rows = _fixed_rows(lm.tokenizer, n=8)
shard_model(lm.model, dp.world)
opt = torch.optim.SGD(lm.model.parameters(), lr=0.1)
actor_metrics = update_policy(lm.model, opt, rows.select(mine(rows)),
                              ActorConfig(ppo_mini_batch_size=4, ppo_max_token_len_per_device=64),
                              max_response_length=384, dp=dp, fsdp=True)
actor_params = full_model_state(lm.model)

# The critic: rank 1's rows are longer, so under the 48-token budget the ranks run different
# numbers of micro-batches (idle passes), in the values and in every mini-batch.
critic, tok = make_critic("critic.ppo_max_token_len_per_device=48", "critic.ppo_epochs=2",
                          fsdp=True)
with_sgd(critic)
crows = fixed_critic_rows(tok, n=8, branch_row=True)  # uids u0..u3, the branch row in u0
values = critic.values(crows, mine(crows), dp)
metrics = critic.update(crows.select(mine(crows)), dp)
critic_params = full_model_state(critic.model)

# Checkpoint round trip of a critic as the trainer builds it (AdamW: its moments and step
# are what a resume must restore): one update, gather (every rank), rank 0 writes, a fresh
# sharded critic loads.
critic, _ = make_critic("critic.ppo_max_token_len_per_device=48", "critic.ppo_epochs=2",
                        fsdp=True)
critic.update(crows.select(mine(crows)), dp)
trained_params = full_model_state(critic.model)
states = critic.part().gather()
if dp.is_main:
    states.save(part_dir)
dp.gather_objects([])  # a barrier: the files are written
fresh, _ = make_critic("critic.ppo_max_token_len_per_device=48", "critic.ppo_epochs=2",
                       fsdp=True)
fresh.part().load(part_dir, part_dir)
loaded_params = full_model_state(fresh.model)
# The next update from the original and from the loaded critic (optimizer and schedule too).


def next_update(c):
    rows = fixed_critic_rows(tok, n=8, branch_row=True)
    rows.values = c.values(rows, mine(rows), dp)
    return c.update(rows.select(mine(rows)), dp), full_model_state(c.model)


after, after_loaded = next_update(critic), next_update(fresh)
if dp.is_main:
    torch.save({"actor_params": actor_params, "actor_metrics": actor_metrics,
                "values": values, "metrics": metrics, "params": critic_params,
                "trained_params": trained_params, "loaded_params": loaded_params,
                "after": after, "after_loaded": after_loaded},
               out)
