"""`appo.hugepages`: `import appo` turns on torch's huge-page allocation unless told not to,
and the user's own setting stands."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appo import hugepages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def test_enable_sets_torch_switch_and_respects_the_users():
    env: dict[str, str] = {}
    assert hugepages.enable(env) is True
    assert env == {"THP_MEM_ALLOC_ENABLE": "1"}
    env = {"THP_MEM_ALLOC_ENABLE": "0"}  # the user's choice stands
    assert hugepages.enable(env) is False
    assert env == {"THP_MEM_ALLOC_ENABLE": "0"}
    env = {"APPO_HUGEPAGES": "0"}  # appo's own switch off: nothing set
    assert hugepages.enable(env) is False
    assert env == {"APPO_HUGEPAGES": "0"}


def _child(code: str, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("THP_MEM_ALLOC_ENABLE", "APPO_HUGEPAGES")}
    done = subprocess.run([sys.executable, "-c", code], env={**environ, **env},
                          capture_output=True, text=True, check=True, timeout=120)
    return done.stdout.strip()


def test_import_appo_sets_it_in_a_fresh_process():
    show = "import os, appo; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    assert _child(show) == "1"
    assert _child(show, APPO_HUGEPAGES="0") == "None"


@pytest.mark.skipif(not THP_MODE.exists() or "[never]" in THP_MODE.read_text()
                    or "[always]" in THP_MODE.read_text(),
                    reason="needs the kernel's THP mode `madvise` (where `always`, every "
                           "large buffer gets huge pages anyway)")
def test_a_large_tensor_lands_on_huge_pages_after_import_appo():
    measure = ("import appo, torch\n"
               "x = torch.ones(64 * 2**20 // 4)\n"
               "print(next(int(l.split()[1]) for l in open('/proc/self/smaps_rollup')"
               " if l.startswith('AnonHugePages')))")
    assert int(_child(measure)) >= 32 * 1024  # kB: most of the 64 MB
    assert int(_child(measure, APPO_HUGEPAGES="0")) == 0
