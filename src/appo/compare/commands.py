"""`appo compare SPEC.yaml [--report] [--dry-run]` (appo.compare)."""

from __future__ import annotations

import argparse


def _compare(args: argparse.Namespace) -> int:
    from appo.compare.report import write_report
    from appo.compare.runner import check_eval_sets, pair_state, run_comparison
    from appo.compare.spec import load_spec

    spec = load_spec(args.spec)
    if not args.report:
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
    if not args.report:
        ran = run_comparison(spec, after_each=lambda: write_report(spec))
        print(f"appo compare: ran {len(ran)} pair(s); every pair is done")
    path = write_report(spec)
    print(f"appo compare: report {path}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("compare", help="compare methods at an equal budget over seeds "
                                       "(runs what is missing, then a report)")
    p.add_argument("spec", metavar="SPEC.yaml", help="comparison spec (see README)")
    p.add_argument("--report", action="store_true",
                   help="only write the report from the pairs finished so far")
    p.add_argument("--dry-run", action="store_true",
                   help="check the spec (budgets) and show each pair's state; run nothing")
    p.set_defaults(handler=_compare)
