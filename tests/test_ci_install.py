"""`.ci/install.py`: pip's configuration carried over to uv, and the fallback to pip."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "install.py"
PIP_CONFIG = """\
global.cert='/etc/ssl/certs/ca.crt'
global.constraint='/etc/pip/constraints.txt'
global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'
global.find-links='/opt/wheels'
:env:.find-links='/opt/wheels /opt/more'
:env:.default-timeout='180'
"""


@pytest.fixture
def install(monkeypatch):
    spec = importlib.util.spec_from_file_location("ci_install", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls: list[list[str]] = []

    def run(cmd, **kw):
        calls.append(list(cmd))
        if cmd[1:4] == ["-m", "pip", "config"]:
            return subprocess.CompletedProcess(cmd, 0, PIP_CONFIG, "")
        if cmd[1:4] == ["-m", "uv", "--version"]:
            return subprocess.CompletedProcess(cmd, 0, "uv 0.13", "")
        if cmd[1:4] == ["-m", "uv", "pip"]:
            return subprocess.CompletedProcess(cmd, module.UV_RC, "", "error: no solution")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    module.UV_RC = 0
    monkeypatch.setattr(module.subprocess, "run", run)
    monkeypatch.delenv("APPO_INSTALLER", raising=False)
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("UV_HTTP_TIMEOUT", raising=False)
    module.calls = calls
    return module


def test_pip_config_lists_every_value_once(install):
    config = install.pip_config("py")
    assert config["find-links"] == ["/opt/wheels", "/opt/more"]
    assert config["extra-index-url"] == ["file:///opt/a/simple", "file:///opt/b/simple"]
    assert config["default-timeout"] == ["180"]


def test_uv_gets_pips_indexes_constraints_and_certificate(install):
    cmd, env = install.uv_command("py", "install", ["-q", "torch==2.13.0"])
    assert cmd[:6] == ["py", "-m", "uv", "pip", "install", "--python"]
    pairs = list(zip(cmd, cmd[1:], strict=False))
    for pair in [("--find-links", "/opt/wheels"), ("--find-links", "/opt/more"),
                 ("--extra-index-url", "file:///opt/b/simple"),
                 ("--constraint", "/etc/pip/constraints.txt"),
                 ("--index-strategy", "unsafe-best-match")]:
        assert pair in pairs, pair
    assert "--compile-bytecode" in cmd  # as pip: PYTHONDONTWRITEBYTECODE may be set
    assert cmd[-2:] == ["-q", "torch==2.13.0"]
    assert env["SSL_CERT_FILE"] == "/etc/ssl/certs/ca.crt" and env["UV_HTTP_TIMEOUT"] == "180"
    cmd, _ = install.uv_command("py", "uninstall", ["-q", "-y", "torchvision"])
    assert cmd[-2:] == ["-q", "torchvision"] and "--find-links" not in cmd
    assert "--compile-bytecode" not in cmd


def test_uv_runs_the_install_and_pip_is_not_called(install):
    assert install.main(["py", "install", "-q", "x"]) == 0
    assert [c[1:4] for c in install.calls][-1] == ["-m", "uv", "pip"]
    assert not any(c[1:4] == ["-m", "pip", "install"] for c in install.calls)


def test_a_failed_uv_install_falls_back_to_pip_with_one_line(install, capsys):
    install.UV_RC = 1
    assert install.main(["py", "install", "-q", "x"]) == 0
    assert install.calls[-1] == ["py", "-m", "pip", "install", "-q", "x"]
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["install.py: uv pip install failed (error: no solution); using pip"]


def test_appo_installer_pip_skips_uv(install, monkeypatch, capsys):
    monkeypatch.setenv("APPO_INSTALLER", "pip")
    assert install.main(["py", "uninstall", "-q", "-y", "x"]) == 0
    assert [c[1:3] for c in install.calls] == [["-m", "pip"]]
    assert install.calls[0][3:] == ["uninstall", "-q", "-y", "x"]
    assert capsys.readouterr().err == ""


def test_bad_usage_is_one_line(install, capsys):
    assert install.main(["py", "frobnicate"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
