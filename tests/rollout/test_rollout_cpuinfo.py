"""`appo.rollout.cpu.cpuinfo.read`: vendor, model and flags of the first processor."""

from __future__ import annotations

import builtins

from appo.rollout.cpu import cpuinfo


def test_the_first_processors_fields_are_read(monkeypatch, tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC X\n"
                 "flags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nvendor_id\t: Other\n"
                 "model name\t: second\nflags\t\t: fpu\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **kw: real_open(
        f if path == "/proc/cpuinfo" else path, *a, **kw))
    info = cpuinfo.read()
    assert info["vendor"] == "AuthenticAMD" and info["model"] == "AMD EPYC X"
    assert info["flags"] == frozenset({"fpu", "avx2", "avx512f"})


def test_an_unreadable_file_gives_empty_fields(monkeypatch):
    def refuse(path, *a, **kw):
        raise OSError("no /proc here")

    monkeypatch.setattr(builtins, "open", refuse)
    info = cpuinfo.read()
    assert info["vendor"] == "" and info["flags"] == frozenset() and info["model"]
