"""Where the test suite's time goes, from pytest's JUnit XML (`--junitxml`), and the per-file
costs the suite is scheduled by (`tests/durations.json`).

    python benchmarks/suite_durations.py run.xml [more.xml ...]           # tables
    python benchmarks/suite_durations.py run.xml --write tests/durations.json

`tests/conftest.py` hands the files to pytest-xdist's workers longest first (the order of
`tests/durations.json`), so no long file starts last while the other worker idles. The figures
only rank the files: their scale does not matter, and a stale entry only costs balance. Rewrite
them from a full run (`make test` with `PYTEST_ADDOPTS=--junitxml=run.xml`, and the vLLM stage
the same way) when files are added or their cost changes a lot; several XML files are merged
(the same file in two of them: the larger figure).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def file_of(case: ET.Element) -> str:
    """`tests/a/test_b.py` of a JUnit testcase (`classname` is `tests.a.test_b[.Class]`)."""
    if case.get("file"):
        return case.get("file", "")
    parts = case.get("classname", "").split(".")
    while parts:
        path = "/".join(parts) + ".py"
        if (REPO / path).is_file():
            return path
        parts.pop()
    return case.get("classname", "?")


def per_test(xml: Path) -> list[tuple[str, str, float]]:
    """(file, test name, seconds) of every testcase in a JUnit XML file."""
    try:
        root = ET.parse(xml).getroot()
    except (OSError, ET.ParseError) as e:
        raise SystemExit(f"suite_durations: cannot read {xml}: {e}") from None
    return [(file_of(c), c.get("name", "?"), float(c.get("time") or 0.0))
            for c in root.iter("testcase")]


def per_file(xmls: list[Path]) -> dict[str, float]:
    """Seconds per test file (the sum of its tests), the largest over the XML files."""
    out: dict[str, float] = {}
    for xml in xmls:
        sums: dict[str, float] = defaultdict(float)
        for path, _, seconds in per_test(xml):
            sums[path] += seconds
        for path, seconds in sums.items():
            out[path] = max(out.get(path, 0.0), seconds)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("xml", nargs="+", type=Path)
    ap.add_argument("--write", type=Path, help="write the per-file costs (JSON) here")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    files = per_file(args.xml)
    tests = sorted((t for x in args.xml for t in per_test(x)), key=lambda t: -t[2])
    total = sum(files.values())
    print(f"{len(tests)} tests in {len(files)} files, {total:.0f} s of test time")
    print("\n| file | seconds |\n| --- | --- |")
    for path, seconds in list(files.items())[: args.top]:
        print(f"| `{path}` | {seconds:.1f} |")
    print("\n| test | seconds |\n| --- | --- |")
    for path, name, seconds in tests[: args.top]:
        print(f"| `{path}::{name}` | {seconds:.1f} |")
    if args.write:
        args.write.write_text(json.dumps({p: round(s, 1) for p, s in files.items()}, indent=0)
                              + "\n")
        print(f"\nwrote {args.write}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
