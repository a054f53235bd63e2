"""Server-mode control (`appo.rollout.vllm_server`) against a scripted server on 127.0.0.1.

The weight reload calls vLLM's dev routes in order and names the fix when they are missing
(no dev mode) or fail; a bad weights dir is refused before any request; waiting for a
server ends on readiness, on timeout, or when the server's process dies. The same calls
against a real `vllm serve` are in tests/with_vllm/.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from eval_server import Reply, ScriptedServer

from appo.errors import AppoError
from appo.http import JsonClient
from appo.rollout.vllm_server import (
    check_weights_dir,
    reload_server_weights,
    server_root,
    wait_for_server,
)


@pytest.fixture
def server():
    s = ScriptedServer()
    yield s
    s.close()


@pytest.fixture
def weights(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\x08" + b"\0" * 15)  # contents are the server's
    return d


def client():
    return JsonClient(timeout=5.0, retries=0, backoff_s=0.0)


def test_reload_calls_the_dev_routes_in_order(server, weights):
    server.routes = {"/collective_rpc": lambda body: {"results": [None]},
                     "/reset_prefix_cache": lambda body: {"success": True}}
    result = reload_server_weights(server.url + "/v1", weights, client=client())
    paths = [r.path for r in server.requests]
    assert paths == ["/collective_rpc", "/reset_prefix_cache"]  # /v1 stripped: root routes
    assert server.requests[0].body == {"method": "reload_weights",
                                       "kwargs": {"weights_path": str(weights.resolve())}}
    assert result.weights_path == str(weights.resolve()) and result.worker_results == [None]


def test_reload_accepts_an_empty_reply_and_retries_a_busy_cache_reset(server, weights):
    resets = iter([{"success": False}, {"success": True}])
    server.routes = {"/collective_rpc": lambda body: Reply(200, ""),
                     "/reset_prefix_cache": lambda body: next(resets)}
    result = reload_server_weights(server.url, weights, client=client())
    assert [r.path for r in server.requests].count("/reset_prefix_cache") == 2
    assert result.worker_results == []


def test_reload_without_dev_mode_says_how_to_enable_it(server, weights):
    with pytest.raises(AppoError, match=r"no /collective_rpc route \(HTTP 404\).*"
                       "VLLM_SERVER_DEV_MODE=1"):
        reload_server_weights(server.url, weights, client=client())


def test_reload_failure_is_one_clear_line(server, weights):
    server.routes = {"/collective_rpc": lambda body: Reply(500, {"error": "shape mismatch"})}
    with pytest.raises(AppoError) as info:
        reload_server_weights(server.url, weights, client=client())
    message = str(info.value)
    assert "\n" not in message and "HTTP 500" in message and "shape mismatch" in message
    assert "restart it" in message
    assert [r.path for r in server.requests] == ["/collective_rpc"]  # no cache reset after


def test_reload_reports_a_cache_that_never_resets(server, weights):
    server.routes = {"/collective_rpc": lambda body: {"results": [None]},
                     "/reset_prefix_cache": lambda body: {"success": False}}
    with pytest.raises(AppoError, match="did not reset its prefix cache"):
        reload_server_weights(server.url, weights, client=client(), reset_attempts=2)


def test_bad_weights_dirs_are_refused_before_any_request(server, tmp_path, weights):
    (tmp_path / "empty").mkdir()
    (tmp_path / "zero").mkdir()
    (tmp_path / "zero" / "model.safetensors").write_bytes(b"")
    for path, message in [(tmp_path / "missing", "is not a directory"),
                          (tmp_path / "empty", "holds no weight files"),
                          (tmp_path / "zero", "is empty")]:
        with pytest.raises(AppoError, match=message):
            reload_server_weights(server.url, path, client=client())
    assert server.requests == []
    assert check_weights_dir(weights) == weights.resolve()
    # A path only the server can see: no local check, sent as given.
    server.routes = {"/collective_rpc": lambda body: {"results": [None]},
                     "/reset_prefix_cache": lambda body: {"success": True}}
    reload_server_weights(server.url, "/srv/ckpt/step_3", client=client(), check_local=False)
    assert server.requests[0].body["kwargs"] == {"weights_path": "/srv/ckpt/step_3"}


def test_server_root():
    assert server_root("http://h:1/v1/") == server_root("http://h:1") == "http://h:1"


def test_wait_for_server_returns_the_model(server):
    assert wait_for_server(server.url, timeout=5, poll_s=0.05) == "scripted-model"


def test_wait_for_server_times_out_with_the_last_error():
    with pytest.raises(AppoError, match=r"not ready after 0.3 s \(cannot reach"):
        wait_for_server("http://127.0.0.1:9", timeout=0.3, poll_s=0.05)


def test_wait_for_server_stops_when_the_process_dies():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(AppoError, match="exited with code 3 before it was ready"):
        wait_for_server("http://127.0.0.1:9", timeout=60, poll_s=0.05, process=proc)
