"""tests/cli_runner.py: `run_cli` in this process gives what the subprocess gives, sees what
a fresh process would (warnings, logging, C-level output), and leaves no state behind."""

from __future__ import annotations

import logging
import os
import random
import warnings

import torch

import appo.cli
from cli_runner import run_cli


def test_in_process_equals_the_subprocess():
    """The same command lines both ways: status, stdout and stderr, a success with a
    warning line and a user error."""
    for args in (("config", "show", "rollout.n=5"), ("config", "show", "rollout.nn=3")):
        here, child = run_cli(*args), run_cli(*args, subprocess=True)
        assert (here.returncode, here.stdout, here.stderr) == (
            child.returncode, child.stdout, child.stderr), args
    assert here.returncode == 2 and here.stderr.startswith("error: unknown config key")


def test_what_a_fresh_process_would_show_is_captured(monkeypatch):
    """Output that does not pass through `print`: a Python warning (pytest would record it,
    and a second test would not see it again), appo's logger (pytest's handlers would take
    it), bytes written to fd 2 (C code, a child process)."""

    def noisy(argv):
        print("out", argv)
        warnings.warn("careful", UserWarning, stacklevel=1)
        logging.getLogger("appo.x").warning("logged")
        os.write(2, b"raw\n")
        return 3

    monkeypatch.setattr(appo.cli, "main", noisy)
    for _ in range(2):  # the warning again: a fresh process each time
        r = run_cli("a", "b")
        assert r.returncode == 3 and r.stdout == "out ['a', 'b']\n"
        assert "UserWarning: careful" in r.stderr
        assert "logged" in r.stderr and r.stderr.endswith("raw\n")


def test_no_state_leaks_out_of_a_call(monkeypatch, tmp_path):
    seen = []

    def meddling(argv):
        seen.append(os.environ.get("ONLY"))
        os.environ["APPO_LEAK"] = "1"
        os.chdir(tmp_path)
        torch.manual_seed(123)
        random.seed(123)
        torch.set_num_threads(1)
        logging.getLogger("appo").setLevel(logging.CRITICAL)
        raise SystemExit(4)

    monkeypatch.setattr(appo.cli, "main", meddling)
    cwd, threads = os.getcwd(), torch.get_num_threads()
    level = logging.getLogger("appo").level
    torch.manual_seed(0)
    random.seed(0)
    expected = torch.rand(3), random.random()
    torch.manual_seed(0)
    random.seed(0)
    assert run_cli("x").returncode == 4  # SystemExit's code, as at a child's exit
    got = torch.rand(3), random.random()
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]
    assert "APPO_LEAK" not in os.environ
    assert os.getcwd() == cwd and torch.get_num_threads() == threads
    assert logging.getLogger("appo").level == level
    assert run_cli("x", env={"ONLY": "this"}).returncode == 4
    assert seen == [None, "this"]  # `env` replaced the environment for the call
    assert "ONLY" not in os.environ and "PATH" in os.environ
