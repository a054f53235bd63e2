"""A full disk under every command that writes a user's output (issue 41, class 2): one line
naming the output and the cause, and nothing half-written left behind (no partial file, no
temporary), an older version of the output left as it was.

The disk is real: a 48 KiB tmpfs mounted for the test (root only; elsewhere these skip), so
the failure comes from the writer's own `write()`, wherever in the file it happens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli_runner import run_cli
from mounts import small_tmpfs


@pytest.fixture
def full(tmp_path):
    """A directory on a 48 KiB tmpfs: large outputs do not fit."""
    with small_tmpfs(tmp_path / "full") as mnt:
        yield mnt


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    return lines[0]


def _corpus(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": str(i), "title": "t", "text": f"word{i} text"})
                            + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_data_synth_on_a_full_disk(full, suffix):
    out = full / f"items{suffix}"
    out.write_text("the old file")
    result = run_cli("data", "synth", "arith", "--n", "2000", "--out", str(out))
    assert _one_error_line(result) == f"error: could not write {out}: no space left on device"
    assert sorted(p.name for p in full.iterdir()) == [out.name]  # no temporary left
    assert out.read_text() == "the old file"


def test_data_synth_lookup_leaves_no_half_file(full):
    # The corpus fits; the items do not (the corpus is complete and reusable).
    (full / "pad").write_bytes(b"x" * 4096)
    result = run_cli("data", "synth", "lookup", "--n", "200", "--out", str(full / "l.jsonl"))
    line = _one_error_line(result)
    assert line == f"error: could not write {full / 'l.jsonl'}: no space left on device", line
    assert not (full / "l.jsonl").exists()
    assert not [p.name for p in full.iterdir() if p.name.startswith(".")]


def test_search_index_on_a_full_disk_keeps_the_old_index(full, tmp_path):
    small = _corpus(tmp_path / "small.jsonl", 2)
    index = full / "idx"
    assert run_cli("search", "index", str(small), "--out", str(index)).returncode == 0
    before = {p.name: p.read_bytes() for p in index.iterdir()}
    big = _corpus(tmp_path / "big.jsonl", 3000)
    result = run_cli("search", "index", str(big), "--out", str(index))
    assert _one_error_line(result) == f"error: could not write {index}: no space left on device"
    assert {p.name: p.read_bytes() for p in index.iterdir()} == before
    assert sorted(p.name for p in full.iterdir()) == ["idx"]


def test_search_index_never_replaces_a_directory_that_is_not_an_index(tmp_path):
    own = tmp_path / "notes"
    own.mkdir()
    (own / "todo.txt").write_text("mine")
    result = run_cli("search", "index", str(_corpus(tmp_path / "c.jsonl", 2)), "--out", str(own))
    assert "holds files that are not a search index (todo.txt" in _one_error_line(result)
    assert (own / "todo.txt").read_text() == "mine"


def test_rollout_dump_on_a_full_disk(full):
    (full / "pad").write_bytes(b"x" * 45056)  # 4 KiB left: less than two trajectories
    out = full / "r.jsonl"
    result = run_cli("rollout", "--model", "tiny-test", "rollout.n=2", "rollout.initial_rollouts=2",
                     "data.max_prompt_length=1024", "data.max_response_length=96",
                     "What is 17*23?", "-o", str(out))
    line = [x for x in result.stderr.splitlines() if x.strip()][-1]
    assert result.returncode == 2 and line == (
        f"error: could not write {out}: no space left on device"), result.stderr
    assert sorted(p.name for p in full.iterdir()) == ["pad"]
