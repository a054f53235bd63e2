"""The published study's per-pair files (docs/study/runs/) are what the report reads and what
a restart on an empty machine copies back as finished pairs, so each must be a valid result of
`docs/study/spec.yaml`: a pair the spec names, in the directory of its own variant and seed,
evaluated on the spec's set as it stands (file spec and k), with every trained step logged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appo.compare.report import has_set, read_curve
from appo.compare.runner import RESULT_FILE, PairResult
from appo.compare.spec import load_spec

STUDY = Path(__file__).resolve().parents[2] / "docs" / "study"
RESULTS = sorted((STUDY / "runs").glob(f"*/seed*/{RESULT_FILE}"))


def test_some_pairs_are_published():
    # The study was restarted on 2026-11-26 and its first pairs are committed; an empty
    # directory would mean the copy into docs/study/runs/ was lost.
    assert RESULTS, f"no {RESULT_FILE} under {STUDY / 'runs'}"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_published_pair_is_a_result_of_the_spec(path: Path):
    spec = load_spec(STUDY / "spec.yaml")
    result = PairResult.from_dict(json.loads(path.read_text()))
    variant, seed_dir = path.parent.parent.name, path.parent.name
    assert (result.variant, f"seed{result.seed}") == (variant, seed_dir)
    assert result.seed in spec.seeds
    trained = spec.variant(variant).train  # StopIteration: a variant the spec lacks
    total_steps = 4  # trainer.total_steps in the spec's base overrides
    assert f"trainer.total_steps={total_steps}" in spec.base_overrides
    assert result.steps == (total_steps if trained else 0)
    for name, files in spec.eval.sets.items():
        assert has_set(spec, result, name), f"{path}: set {name} is not the spec's {files}"
        s = result.sets[name]
        n = int(files.rsplit("n=", 1)[1])  # the spec's question count (`...&n=102`)
        assert len(s.greedy) == len(s.sampled_correct) == len(s.tool_calls) == n
        assert all(0 <= c <= s.k for c in s.sampled_correct)
    curve = read_curve(path.parent)
    assert curve.steps == (list(range(1, total_steps + 1)) if trained else [])
