"""Run under `accelerate launch` (2 processes): several `appo` command lines one after the
other in the same two processes, so that one launch (two interpreter starts, the torch and
transformers imports, the process group) serves several runs.

argv: a JSON file holding a list of command lines (each a list of `appo` arguments). Every
rank runs them in order; a run that does not end with status 0 stops the worker with that
status. Before each run the global RNGs are seeded anew (with the run's index), so that a
run cannot profit from the state an earlier run left behind (a resume that forgot to
restore an RNG state still differs from the uninterrupted run, as in a fresh process).
"""

import json
import random
import sys

import numpy as np
import torch

from appo.cli import main
from appo.trainer.distributed import DataParallel

dp = DataParallel.from_env()
assert dp.world == 2, dp.world

with open(sys.argv[1]) as f:
    runs = json.load(f)
for i, argv in enumerate(runs):
    torch.manual_seed(7919 + i)
    random.seed(7919 + i)
    np.random.seed(7919 + i)
    code = main(argv)
    if code != 0:
        print(f"worker: run {i} ({' '.join(argv)}) ended with status {code}", file=sys.stderr)
        sys.exit(code)
