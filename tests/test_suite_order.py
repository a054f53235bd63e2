"""The suite's scheduling aids: files handed to pytest-xdist longest first (tests/conftest.py,
from tests/durations.json) and the per-file costs read from JUnit XML
(benchmarks/suite_durations.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load(path: Path, name: str):
    """A module by path, under its own name (`conftest` may name another conftest here)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


conftest = _load(REPO / "tests" / "conftest.py", "appo_tests_root_conftest")
suite_durations = _load(REPO / "benchmarks" / "suite_durations.py", "appo_suite_durations")


class Item:
    def __init__(self, path: str, name: str):
        self.path = REPO / path
        self.name = name


def order(items: list[Item], costs: dict | None, monkeypatch, tmp_path) -> list[str]:
    table = tmp_path / "durations.json"
    if costs is not None:
        table.write_text(json.dumps(costs))
    monkeypatch.setattr(conftest, "DURATIONS", table)
    conftest.pytest_collection_modifyitems(None, items)
    return [f"{Path(i.path).name}::{i.name}" for i in items]


def test_files_go_longest_first_and_keep_their_tests_order(monkeypatch, tmp_path):
    items = [Item("tests/a.py", "1"), Item("tests/a.py", "2"), Item("tests/b.py", "1"),
             Item("tests/c.py", "1"), Item("tests/c.py", "2"), Item("tests/d.py", "1")]
    costs = {"tests/a.py": 3.0, "tests/b.py": 50.0, "tests/c.py": 10.0, "tests/d.py": 10.0}
    assert order(items, costs, monkeypatch, tmp_path) == [
        "b.py::1", "c.py::1", "c.py::2", "d.py::1", "a.py::1", "a.py::2"]


def test_a_file_missing_from_the_table_goes_first(monkeypatch, tmp_path):
    items = [Item("tests/a.py", "1"), Item("tests/new.py", "1"), Item("tests/b.py", "1")]
    costs = {"tests/a.py": 1.0, "tests/b.py": 99.0}
    assert order(items, costs, monkeypatch, tmp_path) == ["new.py::1", "b.py::1", "a.py::1"]


@pytest.mark.parametrize("text", [None, "not json", "[1, 2]"])
def test_no_readable_table_keeps_pytests_order(monkeypatch, tmp_path, text):
    items = [Item("tests/b.py", "1"), Item("tests/a.py", "1")]
    table = tmp_path / "durations.json"
    if text is not None:
        table.write_text(text)
    monkeypatch.setattr(conftest, "DURATIONS", table)
    conftest.pytest_collection_modifyitems(None, items)
    assert [Path(i.path).name for i in items] == ["b.py", "a.py"]


def test_the_committed_table_reads_and_names_test_files():
    costs = conftest.file_costs()
    assert len(costs) > 50
    assert all(p.startswith("tests/") and p.endswith(".py") and s >= 0 for p, s in costs.items())


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_config" name="test_a" time="1.5"/>
<testcase classname="tests.test_config" name="test_b" time="2.25"/>
<testcase classname="tests.trainer.test_plan.TestPlan" name="test_c" time="7.0"/>
<testcase classname="tests.test_config" name="test_d" time="0.25"><skipped/></testcase>
</testsuite></testsuites>"""


def test_per_file_sums_each_files_tests_and_takes_the_larger_of_two_runs(tmp_path):
    one, two = tmp_path / "one.xml", tmp_path / "two.xml"
    one.write_text(JUNIT)
    two.write_text(JUNIT.replace('time="7.0"', 'time="3.0"').replace('time="1.5"', 'time="9.5"'))
    assert suite_durations.per_file([one]) == {"tests/trainer/test_plan.py": 7.0,
                                                "tests/test_config.py": 4.0}
    assert suite_durations.per_file([one, two]) == {"tests/test_config.py": 12.0,
                                                     "tests/trainer/test_plan.py": 7.0}


def test_an_unreadable_xml_is_one_line(tmp_path):
    bad = tmp_path / "bad.xml"
    bad.write_text("<testsuites>")
    with pytest.raises(SystemExit, match=r"cannot read .*bad\.xml"):
        suite_durations.per_file([bad])
