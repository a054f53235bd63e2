"""What `appo.cli.entry`'s collect-and-freeze before exit saves: the same commands started
the old way (`sys.exit(main(...))`, the interpreter's usual finalisation) and through
`entry` (`python -m appo.cli`), alternating, in one run of this script.

Per command and way: median wall seconds and median CPU seconds (user + system of the
child, `RUSAGE_CHILDREN`) over `--repeats` runs, and the ratio new / old. Commands:
`config show` (loads torch and transformers, runs nothing) and a 1-step tiny-test `train`
(the kind of run the test suite starts dozens of times).

    python benchmarks/cli_exit.py [--repeats 5]

Writes benchmarks/results/cli_exit.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OLD = "import sys; from appo.cli import main; sys.exit(main(sys.argv[1:]))"


def toy_train_args(tmp: Path) -> list[str]:
    data = tmp / "toy.jsonl"
    with data.open("w") as f:
        for i in range(4):
            # A system message of its own: the default one explains the tools at length.
            f.write(json.dumps({"prompt": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": f"q{i}?"}],
                                "answer": "7", "data_source": "toy"}) + "\n")
    reward = tmp / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, "
                      "extra_info=None):\n    return float(len(solution_str or '') > 3)\n")
    return ["train", "model.path=tiny-test", f"data.train_files=[{data}]", "data.val_files=[]",
            "data.train_batch_size=2", "data.max_response_length=8", "rollout.n=2",
            "rollout.initial_rollouts=1", f"custom_reward_function.path={reward}",
            "actor.ppo_mini_batch_size=2",
            "trainer.total_steps=1", "trainer.logger=[jsonl]",
            f"trainer.default_local_dir={tmp / 'run'}", "trainer.overwrite=true"]


def timed(cmd: list[str]) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cli_exit_"))
    commands = {"config show": ["config", "show"], "train 1 step (tiny-test)": toy_train_args(tmp)}
    ways = {"old: sys.exit(main())": [sys.executable, "-c", OLD],
            "new: python -m appo.cli (entry)": [sys.executable, "-m", "appo.cli"]}
    rows = []
    for name, cargs in commands.items():
        samples: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
        timed([*ways[next(iter(ways))], *cargs])  # warm the page cache, not counted
        for _ in range(args.repeats):
            for w, prefix in ways.items():  # alternate: drifts of the machine hit both
                samples[w].append(timed([*prefix, *cargs]))
        med = {w: (statistics.median(s[0] for s in v), statistics.median(s[1] for s in v))
               for w, v in samples.items()}
        (old_w, old_c), (new_w, new_c) = med.values()
        rows.append({"command": name, "repeats": args.repeats,
                     "old_wall_s": old_w, "new_wall_s": new_w, "old_cpu_s": old_c,
                     "new_cpu_s": new_c, "cpu_ratio": new_c / old_c,
                     "wall_ratio": new_w / old_w, "samples": samples})
        print(f"{name}: wall {old_w:.2f} -> {new_w:.2f} s ({new_w / old_w:.2f}x), "
              f"cpu {old_c:.2f} -> {new_c:.2f} s ({new_c / old_c:.2f}x)", flush=True)
    out = HERE / "results" / "cli_exit.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
