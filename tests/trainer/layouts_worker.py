"""Run under `accelerate launch` (2 processes, FSDP): two toy GAE runs of 2 steps in one
launch (a launch pays two interpreter starts and imports before any work), one saving whole
states, one sharded (`trainer.sharded_checkpoint`), for test_resume_layouts.py.
argv: the toy directory (data and reward, from make_toy) and the tests/trainer directory."""

import sys
from pathlib import Path

sys.path.insert(0, sys.argv[2])  # the tests/trainer directory, for the toy config
from test_resume_layouts import GAE  # noqa: E402
from test_trainer_rl import toy_config  # noqa: E402

from appo.trainer.loop import RLTrainer  # noqa: E402

root = Path(sys.argv[1])
toy = {"data": root / "toy.jsonl", "reward": root / "reward.py", "dir": root}
for name, extra in (("whole", []), ("sharded", ["trainer.sharded_checkpoint=true"])):
    cfg = toy_config(toy, *GAE, "trainer.parallel=fsdp", "trainer.total_steps=2",
                     "trainer.save_freq=1", f"trainer.default_local_dir={root / name}", *extra)
    RLTrainer(cfg, progress=False).fit()
