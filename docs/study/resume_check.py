"""Does a study pair resumed from its step-N checkpoint continue as the uninterrupted pair did?

Run from the study's directory (docs/study/README.md, "How it runs") while the pair trains:
first copy `runs/study/runs/VARIANT/seedS/global_step_N` and `run.json` into
`resume_check/VARIANT/seedS/` (before `keep_checkpoints: last` prunes it), then

    OMP_NUM_THREADS=1 PYTHONPATH=code/src python resume_check.py VARIANT S N

(one torch thread, as `--jobs 2` gives each worker). It resumes to step N + 1 with the study's
config in a fresh process and, once the study's own pair has logged step N + 1 (run it again
with `--compare` then), prints which of that step's metrics differ (times left out).
"""

import json
import sys
from pathlib import Path

from appo.compare.spec import load_spec


def step_row(path: Path, step: int) -> dict | None:
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    return next((r for r in rows if r.get("step") == step), None)


if __name__ == "__main__":
    variant, seed, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    spec = load_spec("spec.yaml")
    src = spec.run_dir(variant, seed)
    dst = Path("resume_check") / variant / f"seed{seed}"
    if "--compare" not in sys.argv:
        from appo.trainer.loop import RLTrainer

        if not (dst / f"global_step_{step}").is_dir():
            raise SystemExit(f"copy {src}/global_step_{step} and run.json to {dst} first")
        (dst / "latest").write_text(f"global_step_{step}\n")
        cfg = spec.config(variant, seed, resume=True)
        cfg.trainer.default_local_dir = str(dst)
        cfg.trainer.total_steps = step + 1
        cfg.trainer.save_freq = 0
        RLTrainer(cfg, progress=False).fit()
    mine = step_row(dst / "metrics.jsonl", step + 1)
    theirs = step_row(src / "metrics.jsonl", step + 1)
    if mine is None or theirs is None:
        raise SystemExit(f"step {step + 1} is not logged yet by both runs")
    keys = [k for k in mine if not k.startswith(("time/", "perf/", "memory/"))]
    diff = [k for k in keys if mine[k] != theirs.get(k)]
    print(f"step {step + 1}: {len(keys) - len(diff)} of {len(keys)} metrics equal")
    for k in diff:
        print(f"  {k}: resumed {mine[k]}, uninterrupted {theirs.get(k)}")
