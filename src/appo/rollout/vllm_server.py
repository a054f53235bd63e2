"""Server mode: wait for a `vllm serve` server, reload its weights, probe its extension.

The rollout engine in server mode is `appo.rollout.openai_engine.OpenAICompletionsEngine`
against the server; this module holds the control operations around it (how a sync picks
between them: `appo.rollout.server_sync`):

- `wait_for_server(base_url, timeout)`: poll `GET /v1/models` until the server answers
  (vLLM serves HTTP only once its engine is up), fail early when the server's process died.
- `reload_server_weights(base_url, weights_dir)`: make the server sample from new weights
  without a restart. vLLM's dev route `POST /collective_rpc` runs `reload_weights` on every
  worker with `kwargs={"weights_path": dir}`: the worker points its model config at `dir`
  and reads the weight files there through its default loader (`*.safetensors`, else
  `*.bin` / `*.pt`; sharded files are filtered by `model.safetensors.index.json` when there
  is one). `config.json` and the tokenizer are not read: the dir must hold weights for the
  served architecture, in checkpoint (Hugging Face) names and shapes. Then
  `POST /reset_prefix_cache` drops KV blocks computed with the old weights, so a cached
  prompt prefix is not reused across the update.

- `probe_extension(root, client)`: whether the server's workers run appo's worker extension
  (`appo.rollout.weight_group.WeightGroupExtension`), which takes weights by broadcast
  instead of a file, and on which device and dtype; `reset_prefix_cache` after either.

Both routes exist only when the server runs with `VLLM_SERVER_DEV_MODE=1`. vLLM's native
weight transfer (`/init_weight_transfer_engine`, `/update_weights`, backends nccl and ipc)
streams tensors from the trainer's GPUs and needs CUDA; the checkpoint dir works anywhere the
server can read the trainer's files (same machine or a shared filesystem).

Call the reload between rollouts: a request in flight during the reload would mix weights.
A reload that fails after it started (a truncated file, a wrong shape) can leave the
server's layers half loaded, so the dir is checked here first, and a failure says to
restart the server.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appo.errors import AppoError
from appo.http import HttpError, JsonClient, endpoint

# What vLLM's default loader reads from a local dir, in its order of preference.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
DEV_MODE_HINT = "start the server with VLLM_SERVER_DEV_MODE=1 to enable it"


def server_root(base_url: str) -> str:
    """The server's root URL: dev routes live beside `/v1`, not under it."""
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


@dataclass
class ReloadResult:
    weights_path: str  # the absolute path the server read
    seconds: float  # wall time of the reload request (including the prefix-cache reset)
    worker_results: list[Any]  # what each worker returned (None for vLLM's reload_weights)


def wait_for_server(base_url: str, timeout: float = 300.0, poll_s: float = 1.0,
                    process: subprocess.Popen | None = None) -> str:
    """Block until the server lists a model on `GET /v1/models`; return the first model id.

    `process`: the server's process, if this program started it; its exit ends the wait
    at once (a bad flag or an out-of-memory fails in seconds, not after `timeout`).
    """
    if timeout <= 0:
        raise AppoError(f"timeout must be > 0 seconds, got {timeout}")
    url = endpoint(base_url, "models")
    # One attempt per poll, each short: the loop is the retry.
    client = JsonClient(timeout=max(1.0, min(10.0, poll_s * 5)), retries=0)
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while True:
        if process is not None and process.poll() is not None:
            raise AppoError(f"the server at {base_url} exited with code {process.returncode} "
                            "before it was ready; see its log")
        try:
            data = client.call(url)
        except HttpError as e:
            last = str(e)
        else:
            models = data.get("data") or []
            if models and isinstance(models[0], dict) and "id" in models[0]:
                return str(models[0]["id"])
            last = f"{url} lists no models"
        if time.monotonic() >= deadline:
            raise AppoError(f"the server at {base_url} was not ready after {timeout:g} s "
                            f"({last})")
        time.sleep(poll_s)


def check_weights_dir(weights_dir: str | Path) -> Path:
    """The absolute path of a dir holding weight files vLLM's loader reads; AppoError if not.

    Checked before the request because vLLM treats a path that is not a local dir as a hub
    id (a download attempt), and an empty dir fails only after the reload began."""
    path = Path(weights_dir).expanduser().resolve()
    if not path.is_dir():
        raise AppoError(f"weights dir {weights_dir} is not a directory")
    for pattern in WEIGHT_PATTERNS:
        files = sorted(path.glob(pattern))
        if files:
            if any(f.stat().st_size == 0 for f in files):
                empty = next(f.name for f in files if f.stat().st_size == 0)
                raise AppoError(f"weights file {path / empty} is empty")
            return path
    raise AppoError(f"weights dir {path} holds no weight files "
                    f"({', '.join(WEIGHT_PATTERNS)}); save the model there first")


def _dev_call(client: JsonClient, url: str, payload: dict[str, Any], what: str,
              on_failure: str = "") -> dict[str, Any]:
    try:
        return client.call(url, payload, empty_ok=True)
    except HttpError as e:
        if e.status in (404, 405):
            raise AppoError(f"the server has no /{url.rsplit('/', 1)[-1]} route "
                            f"(HTTP {e.status}): {what} needs vLLM's dev mode; "
                            f"{DEV_MODE_HINT}") from None
        raise AppoError(f"{what} failed: {e}{on_failure}") from None


def reload_server_weights(base_url: str, weights_dir: str | Path,
                          client: JsonClient | None = None, check_local: bool = True,
                          reset_attempts: int = 5) -> ReloadResult:
    """Make the vLLM server at `base_url` load the weights saved in `weights_dir`.

    `weights_dir` is read by the server, so it must be a path on the server's filesystem;
    `check_local=False` skips the local checks for a server that sees other files than
    this process. `client` defaults to one without retries: a reload is not idempotent
    enough to repeat blindly, and its time scales with the model (no short timeout).
    """
    if check_local:
        path = str(check_weights_dir(weights_dir))
    else:
        path = str(weights_dir)
    client = client or JsonClient(timeout=1800.0, retries=0)
    root = server_root(base_url)
    start = time.perf_counter()
    reply = _dev_call(client, f"{root}/collective_rpc",
                      {"method": "reload_weights", "kwargs": {"weights_path": path}},
                      f"reloading weights from {path}",
                      "; the server's weights may be partly replaced: restart it")
    results = reply.get("results") if isinstance(reply, dict) else None
    reset_prefix_cache(client, root, reset_attempts)
    return ReloadResult(path, time.perf_counter() - start,
                        list(results) if isinstance(results, list) else [])


def save_state(model: Any, weights_dir: str) -> None:
    """Every entry of `model.state_dict()` to `weights_dir/model.safetensors`, tied ones
    included (`save_pretrained` drops a tied `lm_head.weight`; a server told to reload then
    kept a stale LM head), written to a temporary file first so a reload never reads half a
    file."""
    import os
    from pathlib import Path

    from safetensors.torch import save_file

    out = Path(weights_dir)
    out.mkdir(parents=True, exist_ok=True)
    seen: set[int] = set()
    state = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        # safetensors refuses tensors that share memory: copy all but the first of a tie
        state[name] = t.clone().contiguous() if t.data_ptr() in seen else t.contiguous()
        seen.add(t.data_ptr())
    tmp = out / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")


# ---------------------------------------------------------------- weights without a file
# rollout.weight_transfer: how the policy reaches the servers after an update.
WEIGHT_TRANSFERS = ("auto", "file", "group")
EXTENSION = "appo.rollout.weight_group.WeightGroupExtension"
EXTENSION_HINT = f"start it with --worker-extension-cls {EXTENSION}"


def reset_prefix_cache(client: JsonClient, root: str, attempts: int = 5) -> None:
    """Drop the server's cached KV blocks (computed with the old weights). vLLM answers
    success=false while blocks are still held by running requests and asks to retry."""
    for attempt in range(max(1, attempts)):
        done = _dev_call(client, f"{root}/reset_prefix_cache", {},
                         "resetting the prefix cache after a weight update")
        if done.get("success", True):
            return
        if attempt == max(1, attempts) - 1:
            raise AppoError(f"the server at {root} took the new weights but did not reset its "
                            "prefix cache (requests still running?); cached prefixes may "
                            "hold old-weight KV")
        time.sleep(0.5 * (attempt + 1))


def probe_extension(root: str, client: JsonClient, method: str = "appo_weight_group_info"
                    ) -> list[dict[str, Any]] | None:
    """Each server worker's `{device, dtype, rank}` from appo's worker extension; None when
    the server runs without it (vLLM fails the call: no such method on the worker)."""
    url = f"{root}/collective_rpc"
    try:
        reply = client.call(url, {"method": method}, empty_ok=True)
    except HttpError as e:
        if e.status in (404, 405):
            raise AppoError(f"the server has no /collective_rpc route (HTTP {e.status}): "
                            f"weight updates need vLLM's dev mode; {DEV_MODE_HINT}") from None
        # vLLM's words for a method no worker has: the worker's AttributeError, or (through
        # `run_method`, vllm/v1/serial_utils.py) "Method 'x' is not implemented."; which one
        # comes back depends on the executor's path, so both mean: no extension.
        if (f"has no attribute '{method}'" in str(e)
                or f"Method '{method}' is not implemented" in str(e)):
            return None
        raise AppoError(f"probing the server at {root} for appo's worker extension "
                        f"failed: {e}") from None
    results = reply.get("results") if isinstance(reply, dict) else None
    if not isinstance(results, list) or not results or not all(
            isinstance(r, dict) and {"device", "dtype", "rank"} <= set(r) for r in results):
        return None
    return results


def is_local_host(host: str) -> bool:
    """Whether `host` names this machine (a loopback or one of its own addresses)."""
    import ipaddress
    import socket

    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    own = {"127.0.0.1", "::1"}
    try:
        own |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in own for a in addrs)


def address_towards(host: str) -> str:
    """This machine's address on the route to `host`: what the server dials to join."""
    import socket

    if is_local_host(host):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))  # UDP: no packet is sent, the kernel only picks a route
        return str(s.getsockname()[0])
