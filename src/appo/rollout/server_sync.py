"""Server mode's weight sync: the policy to every server after an update, by group or by file.

`ServerWeightSync` decides per server how the weights go (`rollout.weight_transfer`):
- `group`: broadcast through a process group the trainer forms with the server's workers
  (`appo.rollout.weight_group`: gloo for a CPU server, NCCL for a GPU one), tensor by tensor
  in bounded buckets, in the server's dtype: no file, no whole second copy. The server must
  run appo's worker extension (`--worker-extension-cls
  appo.rollout.weight_group.WeightGroupExtension`) and reach this machine on the group's
  port; a server on a GPU needs the policy on a GPU (NCCL).
- `file`: the whole state as safetensors in `rollout.weights_dir`, reloaded by every server
  (`appo.rollout.vllm_server.reload_server_weights`); servers that share the filesystem.
- `auto` (the default): `group` for a server on this machine that has the extension and
  whose device the policy can reach; `file` otherwise, with one line saying why. A remote
  server is not joined on `auto`: its firewall and routes are unknown here, and a join
  that cannot complete costs a timeout each run; `group` asks for it explicitly.
After either, the server's prefix cache is reset (its KV came from the old weights).

`GroupLink` is the trainer's end of one server's group: it hosts the rendezvous store,
asks the server's workers to join (`POST /collective_rpc` from a thread: the server's call
returns only once the trainer has joined too), and per push sends the manifest the same way
before broadcasting the buckets it lists. Every failure is one line: a server without the
extension (asked for `group`), a port in use, a join that times out, a load that fails.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from appo.errors import AppoError
from appo.http import HttpError, JsonClient
from appo.rollout.vllm_server import (
    EXTENSION_HINT,
    WEIGHT_TRANSFERS,
    address_towards,
    is_local_host,
    probe_extension,
    reload_server_weights,
    reset_prefix_cache,
    save_state,
    server_root,
)


def weight_specs(model: Any, dtype: str) -> tuple[list[Any], list[Any]]:
    """The policy's state-dict tensors for the manifest: `(TensorSpec, dtype name)` pairs
    (floating tensors in the server's `dtype`), and the tensors in the same order; a tensor
    under several names (tied weights) once, with all its names."""
    from appo.rollout.weight_group import TensorSpec, dtype_name

    tensors = dict(model.named_buffers(remove_duplicate=False))
    tensors.update(model.named_parameters(remove_duplicate=False))
    names: dict[int, list[str]] = {}
    order: list[Any] = []
    for name in model.state_dict().keys():
        value = tensors[name]
        if id(value) not in names:
            names[id(value)] = []
            order.append(value)
        names[id(value)].append(name)
    specs = [(TensorSpec(tuple(names[id(t)]), tuple(t.shape)),
              dtype if t.is_floating_point() else dtype_name(t.dtype)) for t in order]
    return specs, order


class GroupLink:
    """The trainer's end of one server's broadcast group: joined at the first push, kept
    open across pushes."""

    def __init__(self, root: str, workers: list[dict[str, Any]], device: Any,
                 port: int = 0, join_timeout_s: float = 120.0,
                 transfer_timeout_s: float = 1800.0, bucket_bytes: int | None = None):
        from appo.rollout.weight_group import BUCKET_BYTES, backend_for

        self.root, self.workers, self.device = root, workers, device
        self.backend = backend_for(str(workers[0]["device"]))
        self.dtype = str(workers[0]["dtype"])
        self.port, self.join_timeout_s = port, join_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.bucket_bytes = bucket_bytes or BUCKET_BYTES
        self.group: Any = None
        self.last_bytes = 0

    def _rpc_in_thread(self, method: str, kwargs: dict[str, Any], timeout_s: float):
        """POST /collective_rpc from a thread: the server's call returns only when the
        trainer's side of the collective is done, which this thread's caller does."""
        import threading

        box: dict[str, Any] = {}
        client = JsonClient(timeout=timeout_s, retries=0)

        def run() -> None:
            try:
                box["reply"] = client.call(f"{self.root}/collective_rpc",
                                           {"method": method, "kwargs": kwargs}, empty_ok=True)
            except HttpError as e:
                box["error"] = e

        thread = threading.Thread(target=run, name=f"appo-{method}", daemon=True)
        thread.start()
        return thread, box

    def join(self) -> None:
        from appo.rollout.weight_group import READY_KEY, WeightGroup

        host = address_towards(_host(self.root))
        world = 1 + len(self.workers)
        state: dict[str, Any] = {}

        def ask_and_wait(group: WeightGroup) -> None:
            # The store listens now: ask the workers to join, then wait for each to reach
            # it, or for the server's call to fail (it returns only after the join).
            thread, box = self._rpc_in_thread(
                "appo_join_weight_group", {"host": host, "port": group.port,
                                           "world_size": world,
                                           "timeout_s": self.join_timeout_s},
                self.join_timeout_s + 60)
            state.update(thread=thread, box=box)
            keys = [READY_KEY.format(rank=r) for r in range(1, world)]
            deadline = time.monotonic() + self.join_timeout_s
            while not group.store.check(keys):
                if "error" in box:
                    raise AppoError(f"the server at {self.root} could not join the weight-"
                                    f"transfer group on {host}:{group.port}: {box['error']}")
                if time.monotonic() > deadline:
                    raise AppoError(f"the server at {self.root} did not join the weight-"
                                    f"transfer group on {host}:{group.port} within "
                                    f"{self.join_timeout_s:g} s (can it reach this machine "
                                    "there? rollout.weight_transfer=file avoids the group)")
                time.sleep(0.05)

        try:
            self.group = WeightGroup(host, self.port, 0, world, self.backend,
                                     self.device, self.join_timeout_s, ready=ask_and_wait)
        except AppoError:
            raise
        except Exception as e:  # noqa: BLE001 - torch's store/gloo errors, as one line
            text = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "EADDRINUSE" in str(e) or "address already in use" in str(e):
                text = f"port {self.port} is in use"
            raise AppoError(f"the weight-transfer group with {self.root} failed to start: "
                            f"{text}") from None
        thread, box = state["thread"], state["box"]
        thread.join(self.join_timeout_s + 60)
        if "error" in box or thread.is_alive():
            self.close()
            raise AppoError(f"the server at {self.root} failed to join the weight-transfer "
                            f"group: {box.get('error', 'no answer')}")
        reply = box.get("reply")
        backends = [r.get("backend") for r in (reply or {}).get("results") or []
                    if isinstance(r, dict)]
        if backends != [self.backend] * len(self.workers):  # every worker, on our backend
            self.close()
            raise AppoError(f"the server at {self.root} joined the weight-transfer group "
                            f"with backends {backends}, expected {self.backend} for each of "
                            f"its {len(self.workers)} workers")

    def push(self, model: Any) -> int:
        """Broadcast `model`'s weights to the server's workers, which load them in place;
        returns the bytes sent."""
        import torch

        from appo.rollout.weight_group import encode_manifest, plan_buckets

        if self.group is None:
            self.join()
        specs, tensors = weight_specs(model, self.dtype)
        buckets = plan_buckets(specs, self.bucket_bytes)
        thread, box = self._rpc_in_thread("appo_receive_weights",
                                          {"manifest": encode_manifest(buckets)},
                                          self.transfer_timeout_s)
        try:
            with torch.no_grad():
                self.last_bytes = self.group.send(buckets, (t.detach() for t in tensors))
        except Exception as e:  # noqa: BLE001 - a broken group, as one line
            thread.join(5)
            cause = box.get("error") or (str(e).splitlines() or [type(e).__name__])[0]
            self.close()
            raise AppoError(f"sending the weights to {self.root} failed: {cause}; the "
                            "server's weights may be partly replaced: restart it") from None
        thread.join(self.transfer_timeout_s)
        if "error" in box or thread.is_alive():
            raise AppoError(f"the server at {self.root} failed to load the weights: "
                            f"{box.get('error', 'no answer')}; its weights may be partly "
                            "replaced: restart it")
        return self.last_bytes

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            try:
                JsonClient(timeout=30.0, retries=0).call(
                    f"{self.root}/collective_rpc", {"method": "appo_close_weight_group"},
                    empty_ok=True)
            except HttpError:
                pass  # a server that is gone has no group to close
            group.close()


def policy_device(model: Any) -> Any:
    """The device of the policy's weights (decides whether NCCL can reach a GPU server)."""
    return next(model.parameters()).device


def _host(root: str) -> str:
    """The host part of a server's root URL."""
    from urllib.parse import urlsplit

    return urlsplit(root).hostname or ""


class ServerWeightSync:
    """Push the policy to every server after an update (see the module docstring)."""

    def __init__(self, base_urls: list[str], weights_dir: str | None, mode: str = "auto",
                 client: JsonClient | None = None, port: int = 0,
                 join_timeout_s: float = 120.0, bucket_bytes: int | None = None):
        if mode not in WEIGHT_TRANSFERS:
            raise AppoError(f"rollout.weight_transfer must be one of "
                            f"{', '.join(WEIGHT_TRANSFERS)}, got {mode!r}")
        self.roots = [server_root(u) for u in base_urls]
        self.weights_dir, self.mode = weights_dir, mode
        self.client = client or JsonClient(timeout=1800.0, retries=0)
        self.port, self.join_timeout_s, self.bucket_bytes = port, join_timeout_s, bucket_bytes
        self.routes: dict[str, str] = {}  # root -> "group" | "file", decided at first push
        self.links: dict[str, GroupLink] = {}
        self.seconds: dict[str, float] = {}  # root -> the last push's wall time
        self.bytes_sent: dict[str, int] = {}  # root -> the last push's bytes (group)

    def _route(self, root: str, device: Any) -> str:
        if self.mode == "file":
            return "file"
        workers = probe_extension(root, self.client)
        reason = None
        if workers is None:
            reason = f"the server has no appo worker extension ({EXTENSION_HINT})"
        elif str(workers[0]["device"]).startswith("cuda") and device.type != "cuda":
            reason = (f"the server's workers are on {workers[0]['device']} and the policy on "
                      f"{device}: NCCL needs the trainer's tensors on a GPU")
        elif self.mode == "auto" and not is_local_host(_host(root)):
            reason = "the server is on another host (rollout.weight_transfer=group joins it)"
        if reason is not None:
            if self.mode == "group":
                raise AppoError(f"rollout.weight_transfer=group: {root}: {reason}; or use "
                                "rollout.weight_transfer=file")
            print(f"appo: weights to {root} go through a file: {reason}", file=sys.stderr,
                  flush=True)
            return "file"
        # gloo sends CPU tensors; NCCL the policy's own GPU's
        link_device = device if str(workers[0]["device"]).startswith("cuda") else "cpu"
        self.links[root] = GroupLink(root, workers, link_device, port=self.port,
                                     join_timeout_s=self.join_timeout_s,
                                     bucket_bytes=self.bucket_bytes)
        return "group"

    def sync(self, model: Any) -> None:
        """The policy `model` (a whole Hugging Face module) to every server."""
        device = policy_device(model)
        saved = False
        for root in self.roots:
            start = time.perf_counter()
            if root not in self.routes:
                self.routes[root] = self._route(root, device)
            if self.routes[root] == "group":
                self.bytes_sent[root] = self.links[root].push(model)
                reset_prefix_cache(self.client, root)
            else:
                if self.weights_dir is None:
                    raise AppoError("the openai engine has no weights_dir to save the policy "
                                    "to for its servers (rollout.weights_dir)")
                if not saved:  # one file for all the servers that read it
                    save_state(model, self.weights_dir)
                    saved = True
                reload_server_weights(root, self.weights_dir, client=self.client)
            self.seconds[root] = time.perf_counter() - start

    def close(self) -> None:
        """Leave every group (the servers close their side too)."""
        links, self.links = self.links, {}
        self.routes = {}
        for link in links.values():
            link.close()
