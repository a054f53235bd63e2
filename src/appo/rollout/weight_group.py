"""Weights from the trainer to a vLLM server without a file: a broadcast group of their own.

Server mode used to write the whole policy as a safetensors file each sync and have the
server reload it; this module is the file-free route, as TRL's `vllm serve` mode does it.
Both sides import it:

- `WeightGroup`: a standalone process group, trainer = rank 0, each server worker = rank
  1..N, rendezvous over a `TCPStore` the trainer hosts. Standalone (a `ProcessGroupGloo` /
  `ProcessGroupNCCL` object, never `init_process_group`) because the trainer may already
  hold the default group (DDP/FSDP) and a vLLM worker holds its own. gloo when the server's
  workers are on CPU, NCCL when they are on GPUs (`BACKENDS`).
- the manifest (`plan_buckets`): what the trainer is about to broadcast, in order: buckets of
  consecutive tensors of one dtype up to `bucket_bytes` (a tensor larger than that alone),
  each tensor under all its names (a tied weight is sent once). The trainer never holds
  more than one bucket beyond the model; neither does a worker.
- `WeightGroupExtension`: the vLLM worker extension (`vllm serve ...
  --worker-extension-cls appo.rollout.weight_group.WeightGroupExtension`), reached through
  the dev route `POST /collective_rpc`: `appo_weight_group_info` (the probe: device and
  dtype), `appo_join_weight_group`, `appo_receive_weights` (receives the buckets one by one
  and feeds them to the worker's `reload_weights`, vLLM's in-place reload that maps
  checkpoint names onto fused layers through the model's `load_weights`) and
  `appo_close_weight_group`.

The trainer's half (probe, join from a thread, broadcast) is `appo.rollout.server_sync`.
Only torch is imported here: the module is loaded inside vLLM's worker processes.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# A bucket's byte bound: large enough that a small model's norms and biases go in a few
# broadcasts, small enough to be noise beside the model on either side.
BUCKET_BYTES = 64 << 20
# The store key each server worker sets once it reached the trainer's store: the trainer
# waits for these before building the group, so a server that fails to join is seen at
# once (its HTTP call returns) instead of after gloo's own timeout.
READY_KEY = "appo/ready/{rank}"


@dataclass(frozen=True)
class TensorSpec:
    names: tuple[str, ...]  # every name the tensor goes by (tied weights: several)
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Bucket:
    dtype: str  # torch dtype name without the prefix: "float32", "bfloat16"
    tensors: tuple[TensorSpec, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a weight manifest")
    return dtype


def plan_buckets(specs: list[tuple[TensorSpec, str]], bucket_bytes: int = BUCKET_BYTES
                 ) -> list[Bucket]:
    """Group `(spec, dtype name)` pairs, in order, into buckets of one dtype and at most
    `bucket_bytes` (a tensor larger than that gets a bucket of its own)."""
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []
    current_dtype, current_bytes = "", 0
    for spec, dtype in specs:
        size = spec.numel * torch_dtype(dtype).itemsize
        if current and (dtype != current_dtype or current_bytes + size > bucket_bytes):
            buckets.append(Bucket(current_dtype, tuple(current)))
            current, current_bytes = [], 0
        current.append(spec)
        current_dtype, current_bytes = dtype, current_bytes + size
    if current:
        buckets.append(Bucket(current_dtype, tuple(current)))
    return buckets


def encode_manifest(buckets: list[Bucket]) -> str:
    """The manifest as a JSON string (vLLM's RPC route passes strings through untouched)."""
    return json.dumps([{"dtype": b.dtype, "tensors": [[list(t.names), list(t.shape)]
                                                      for t in b.tensors]} for b in buckets])


def decode_manifest(text: str) -> list[Bucket]:
    try:
        raw = json.loads(text)
        return [Bucket(str(b["dtype"]), tuple(TensorSpec(tuple(map(str, names)),
                                                         tuple(int(d) for d in shape))
                                              for names, shape in b["tensors"]))
                for b in raw]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"malformed weight manifest: {e}") from None


def split_bucket(flat: Any, bucket: Bucket) -> Iterator[tuple[str, Any]]:
    """`(name, view)` for every name of every tensor of a received bucket."""
    offset = 0
    for spec in bucket.tensors:
        view = flat[offset: offset + spec.numel].view(spec.shape)
        offset += spec.numel
        for name in spec.names:
            yield name, view


# ---------------------------------------------------------------- the group
def to_device(tensor: Any, device: Any, dtype: Any) -> Any:
    """`tensor` on the group's device in the wire dtype (a seam the CUDA fakes record)."""
    return tensor.to(device=device, dtype=dtype).contiguous()


def empty_on(numel: int, dtype: Any, device: Any) -> Any:
    """A receive buffer on the group's device (the same seam)."""
    import torch

    return torch.empty(numel, dtype=dtype, device=device)


def _gloo(store: Any, rank: int, size: int, timeout: datetime.timedelta, device: Any) -> Any:
    import torch.distributed as dist

    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _nccl(store: Any, rank: int, size: int, timeout: datetime.timedelta, device: Any) -> Any:
    import torch
    import torch.distributed as dist

    # NCCL picks the communicator's GPU from the current device.
    torch.cuda.set_device(device)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, opts)


# Backend name -> a standalone process group over the given store.
BACKENDS: dict[str, Callable[..., Any]] = {"gloo": _gloo, "nccl": _nccl}


def backend_for(device: str) -> str:
    """gloo for workers on CPU, NCCL for workers on GPUs."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


class WeightGroup:
    """One side of the trainer-to-server broadcast group (rank 0 hosts the store)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str,
                 device: Any, timeout_s: float,
                 ready: Callable[[WeightGroup], None] | None = None):
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ValueError(f"unknown weight-transfer backend {backend!r}; "
                             f"known: {', '.join(BACKENDS)}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        self.backend, self.device = backend, device
        # The trainer's store listens before any server is asked to join; port 0 lets the
        # system pick a free one (self.port says which).
        self.store = dist.TCPStore(host, port, None, rank == 0, timeout,
                                   wait_for_workers=False)
        self.port = int(self.store.port)
        if rank > 0:
            self.store.set(READY_KEY.format(rank=rank), "1")
        elif ready is not None:
            ready(self)  # the trainer asks the workers to join, waits for their keys
        self.pg = BACKENDS[backend](self.store, rank, world_size, timeout, device)

    def broadcast(self, tensor: Any) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()

    def send(self, buckets: list[Bucket], tensors: Iterator[Any]) -> int:
        """Rank 0: broadcast `tensors` (in manifest order) bucket by bucket; returns the
        bytes sent."""
        import torch

        sent = 0
        for bucket in buckets:
            dtype = torch_dtype(bucket.dtype)
            parts = [to_device(next(tensors), self.device, dtype).reshape(-1)
                     for _ in bucket.tensors]
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)
            del parts
            self.broadcast(flat)
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(self, bucket: Bucket) -> Any:
        """A worker: the next bucket, as one flat tensor on this worker's device."""
        flat = empty_on(bucket.numel, torch_dtype(bucket.dtype), self.device)
        self.broadcast(flat)
        return flat

    def close(self) -> None:
        pg, self.pg = getattr(self, "pg", None), None
        shutdown = getattr(pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # noqa: BLE001 - closing a group whose peer is gone
                pass
        self.store = None


# ---------------------------------------------------------------- the vLLM worker side
class _Receiver:
    """The iterator a worker's `reload_weights` consumes; counts what it received, so the
    rest can be drained when loading stops early (the trainer is still broadcasting)."""

    def __init__(self, group: WeightGroup, buckets: list[Bucket]):
        self.group, self.buckets, self.next_bucket = group, buckets, 0
        self.bytes = 0

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        while self.next_bucket < len(self.buckets):
            bucket = self.buckets[self.next_bucket]
            flat = self.group.receive(bucket)
            self.next_bucket += 1
            self.bytes += flat.numel() * flat.element_size()
            yield from split_bucket(flat, bucket)

    def drain(self) -> None:
        while self.next_bucket < len(self.buckets):
            self.group.receive(self.buckets[self.next_bucket])
            self.next_bucket += 1


class WeightGroupExtension:
    """Methods vLLM adds to each of its workers (`--worker-extension-cls`), called by the
    trainer through `POST /collective_rpc`. Names start with `appo_`: vLLM refuses an
    extension whose attributes collide with the worker's."""

    def appo_weight_group_info(self) -> dict[str, Any]:
        """The probe: where this worker's weights live and in which dtype."""
        return {"device": str(self.device), "rank": int(self.rank),
                "dtype": dtype_name(self.model_config.dtype),
                "joined": getattr(self, "_appo_group", None) is not None,
                "source": __file__}  # which appo the server imported

    def appo_join_weight_group(self, host: str, port: int, world_size: int,
                               timeout_s: float = 120.0) -> dict[str, Any]:
        """Join the trainer's group as rank 1 + this worker's rank; a group left by an
        earlier trainer is closed first. Blocks until the trainer joins too."""
        self.appo_close_weight_group()
        device = self.device
        self._appo_group = WeightGroup(str(host), int(port), 1 + int(self.rank),
                                       int(world_size), backend_for(str(device)), device,
                                       float(timeout_s))
        return {"rank": self._appo_group.rank, "backend": self._appo_group.backend}

    def appo_receive_weights(self, manifest: str) -> dict[str, Any]:
        """Receive the buckets the manifest lists and load them in place (vLLM's
        `reload_weights` over them, checkpoint names). If loading fails, the remaining
        buckets are still received (the trainer finishes its broadcast and sees the
        error) before the error is raised."""
        group = getattr(self, "_appo_group", None)
        if group is None:
            raise RuntimeError("no weight-transfer group: call appo_join_weight_group first")
        receiver = _Receiver(group, decode_manifest(manifest))
        try:
            self.reload_weights(weights_iterator=iter(receiver), is_checkpoint_format=True)
        finally:
            receiver.drain()
        return {"buckets": receiver.next_bucket, "bytes": receiver.bytes}

    def appo_close_weight_group(self) -> None:
        group = getattr(self, "_appo_group", None)
        self._appo_group = None
        if group is not None:
            group.close()
