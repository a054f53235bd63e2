"""`pip install` / `pip uninstall` into a venv, through uv where it can be had, else pip.

Usage: python .ci/install.py VENV_PYTHON install|uninstall ARGS...

Why: on the 2-core CI machine pip spent ~65 s installing the main venv and minutes on the
vLLM venv (which installs beside the default suite and so slows it); uv installs the same
packages in seconds (figures in docs/testing.md). The result must be what pip would have
installed, so uv gets pip's own configuration (`pip config list`: index and find-links
locations, constraints, certificate, timeout, from files and PIP_* variables) and pip's
resolution rule across several indexes (the best version from any of them). Anything uv
cannot do here (uv not installable, no network to fetch it, a resolution it refuses) falls
back to pip with the same arguments, after one line saying why; APPO_INSTALLER=pip asks for
pip outright.
"""

from __future__ import annotations

import os
import subprocess
import sys


def pip_config(python: str) -> dict[str, list[str]]:
    """pip's effective settings as {key: [values]} (`global.find-links='a b'` -> ['a', 'b'];
    the values of every scope that sets a key, in order, without repeats)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True,
                         text=True).stdout
    config: dict[str, list[str]] = {}
    for line in out.splitlines():
        name, sep, value = line.partition("=")
        if not sep:
            continue
        key = name.rsplit(".", 1)[-1]
        for v in value.strip().strip("'\"").split():
            if v not in config.setdefault(key, []):
                config[key].append(v)
    return config


# pip's key -> uv's option (each value of the key passed as one option)
OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url",
           "find-links": "--find-links", "constraint": "--constraint",
           "trusted-host": "--allow-insecure-host"}


def uv_command(python: str, verb: str, args: list[str]) -> tuple[list[str], dict[str, str]]:
    config = pip_config(python)
    cmd = [python, "-m", "uv", "pip", verb, "--python", python]
    env = dict(os.environ)
    if verb == "install":
        for key, option in OPTIONS.items():
            for value in config.get(key, []):
                cmd += [option, value]
        if "no-index" in config:
            cmd.append("--no-index")
        # pip takes the best version across all indexes; uv's default stops at the first
        # index that has the package at all
        cmd += ["--index-strategy", "unsafe-best-match"]
        # pip compiles every installed module to bytecode; uv does not by default, and where
        # PYTHONDONTWRITEBYTECODE is set (as on the CI machines) nothing caches it later:
        # every process (each test's subprocesses) would compile torch and transformers anew
        cmd.append("--compile-bytecode")
    if "cert" in config:
        env.setdefault("SSL_CERT_FILE", config["cert"][0])
    if "timeout" in config or "default-timeout" in config:
        env.setdefault("UV_HTTP_TIMEOUT", (config.get("timeout") or config["default-timeout"])[0])
    if verb == "uninstall":
        args = [a for a in args if a not in ("-y", "--yes")]  # uv never asks
    return cmd + args, env


def have_uv(python: str) -> str | None:
    """None when uv runs in this venv (installed now if need be), else why not."""
    probe = [python, "-m", "uv", "--version"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return None
    r = subprocess.run([python, "-m", "pip", "install", "-q", "uv"], capture_output=True,
                       text=True)
    if r.returncode != 0:
        return f"uv could not be installed ({(r.stderr.strip().splitlines() or ['?'])[-1]})"
    return None if subprocess.run(probe, capture_output=True).returncode == 0 else "uv does not run"


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in ("install", "uninstall"):
        print("usage: install.py VENV_PYTHON install|uninstall ARGS...", file=sys.stderr)
        return 2
    python, verb, args = argv[0], argv[1], argv[2:]
    why = "APPO_INSTALLER=pip" if os.environ.get("APPO_INSTALLER") == "pip" else have_uv(python)
    if why is None:
        cmd, env = uv_command(python, verb, args)
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode == 0:
            sys.stdout.write(r.stdout)
            return 0
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        why = f"uv pip {verb} failed ({tail})"
    if why != "APPO_INSTALLER=pip":
        print(f"install.py: {why}; using pip", file=sys.stderr)
    return subprocess.run([python, "-m", "pip", verb, *args]).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
