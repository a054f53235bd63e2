"""`appo compare SPEC.yaml [--report] [--dry-run] [--jobs N]` (appo.compare)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def _write_report(spec) -> Path:
    from appo.compare.report import write_report
    from appo.compare.runner import held_lock, lock_path

    # Processes of one spec (--jobs) finish pairs at any time: one report writer at a time.
    with held_lock(lock_path(spec, "report"), wait=True):
        path = write_report(spec)
    return path


def _die_with(parent: int):
    """For a worker, run in the child before it starts: on Linux the kernel sends it
    SIGTERM when `parent` dies (`PR_SET_PDEATHSIG`), however the parent ends (SIGKILL
    included), so a killed `appo compare --jobs` never leaves workers running the study on
    in the background. Elsewhere, nothing (the `finally` in `_run_jobs` still ends them on
    an interrupt)."""
    def setup() -> None:
        if not sys.platform.startswith("linux"):
            return
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call took effect
            os._exit(1)

    return setup


def _run_jobs(args: argparse.Namespace, spec) -> int:
    """`--jobs N`: N `appo compare` processes on the spec, each running the pairs nobody
    holds (runner.py: pair locks), torch threads split between them; then the report."""
    from appo.compare.runner import pair_state

    env = dict(os.environ)
    # Small models decode faster as N one-thread processes than as one N-thread process.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.jobs)))
    cmd = [sys.executable, "-m", "appo.cli", "compare", str(args.spec), "--worker"]
    procs = [subprocess.Popen(cmd, env=env, preexec_fn=_die_with(os.getpid()))
             for _ in range(args.jobs)]
    try:
        codes = [p.wait() for p in procs]
    except BaseException:  # interrupted (Ctrl-C, an exception): the workers end with us
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()
        raise
    path = _write_report(spec)
    print(f"appo compare: report {path}")
    if any(codes):
        left = [f"{v}/seed{s}" for v, s in spec.pairs() if pair_state(spec, v, s) != "done"]
        print(f"appo compare: {sum(c != 0 for c in codes)} of {args.jobs} jobs failed "
              f"(exit codes {codes}); unfinished: {', '.join(left) or 'none'}", file=sys.stderr)
        return 1
    return 0


def _compare(args: argparse.Namespace) -> int:
    from appo.compare.runner import (
        check_definitions,
        check_eval_sets,
        pair_state,
        run_comparison,
    )
    from appo.compare.spec import load_spec
    from appo.errors import AppoError

    spec = load_spec(args.spec)
    if args.jobs < 1:
        raise AppoError(f"--jobs {args.jobs}: give a number of processes >= 1")
    # Pairs that ran under another definition: never resumed or reported as this one's.
    check_definitions(spec)
    if not args.report and not args.worker:
        sizes = check_eval_sets(spec)
        print("appo compare: eval sets " + ", ".join(f"{k} ({n} questions)"
                                                     for k, n in sizes.items()))
    if args.dry_run:
        print(f"appo compare: {len(spec.variants)} variants x {len(spec.seeds)} seeds, "
              f"output {spec.output_dir}")
        for v in spec.variants:
            if not v.train:
                print(f"  {v.name}: the base config's model, evaluated without training")
                continue
            budget = ", ".join(f"{k}={x}" for k, x in spec.budgets[v.name].items())
            print(f"  {v.name}: {' '.join(v.overrides) or '(base)'} [{budget}]")
        for v, s in spec.pairs():
            print(f"  {v} seed {s}: {pair_state(spec, v, s)} ({spec.run_dir(v, s)})")
        return 0
    if not args.report and args.jobs > 1:
        return _run_jobs(args, spec)
    if not args.report:
        ran, held = run_comparison(spec, after_each=lambda: _write_report(spec),
                                   progress=not args.worker)
        if held:
            print(f"appo compare: ran {len(ran)} pair(s); {len(held)} held by other processes "
                  "(they write the report as theirs finish)")
        else:
            print(f"appo compare: ran {len(ran)} pair(s); every pair is done")
    path = _write_report(spec)
    print(f"appo compare: report {path}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("compare", help="compare methods at an equal budget over seeds "
                                       "(runs what is missing, then a report)")
    p.add_argument("spec", metavar="SPEC.yaml", help="comparison spec (see docs/compare.md)")
    p.add_argument("--report", action="store_true",
                   help="only write the report from the pairs finished so far")
    p.add_argument("--dry-run", action="store_true",
                   help="check the spec (budgets) and show each pair's state; run nothing")
    p.add_argument("--jobs", type=int, default=1,
                   help="run pairs in N processes at once (torch threads split between "
                        "them unless OMP_NUM_THREADS is set); default 1")
    # A process started by --jobs: no progress bars (they would interleave), no eval-set check.
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(handler=_compare)
