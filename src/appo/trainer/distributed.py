"""Data parallelism for the RL trainer: the process group and the few collectives it needs.

Under `accelerate launch` / torchrun (WORLD_SIZE > 1) each rank rolls out its share of the
prompts, trajectories are gathered so group advantages see whole groups, each rank trains
on the rows it generated, and gradients are summed once per optimizer step. Loss
normalisers are global (`appo.algos.LossAgg`), so the update equals the single-process one.
In one process every collective is a no-op.

Devices: on CUDA each rank is pinned to its `LOCAL_RANK` device before the group exists
(`torch.cuda.set_device`, `init_process_group(device_id=...)`), and the group has two
backends, `cpu:gloo,cuda:nccl`: NCCL refuses CPU tensors, and the object collectives and
the small CPU all-reduces below (counts, normalisers) go through gloo. A rank's model lives
on `rank_device(...)`, whatever `model.device` says (`cuda` alone would put every rank on
`cuda:0`).
"""

from __future__ import annotations

import atexit
import os
import sys
import time

import torch


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # A colocated vLLM engine (external launcher) made its groups inside this world: take
        # them down first, or vLLM's own exit hook later finds them destroyed and raises.
        vllm_state = sys.modules.get("vllm.distributed.parallel_state")
        if vllm_state is not None:
            try:
                vllm_state.destroy_model_parallel()
                vllm_state.destroy_distributed_environment()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        if dist.is_initialized():
            dist.destroy_process_group()
    # gloo's worker threads drop a finished collective's tensors after the caller has
    # returned, and dropping a tensor's Python object takes the GIL. A thread that asks for
    # the GIL once finalisation has begun is ended by Python inside that C++ destructor,
    # and std::terminate aborts the rank (seen in a core dump: ~AsyncAllreduceWork ->
    # decref_pyobject -> take_gil -> pthread_exit). Sleeping hands the GIL to any such
    # pending release while the interpreter is still whole.
    time.sleep(0.05)


def local_rank() -> int:
    """This process's index on its node (torchrun / accelerate set LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def backend_for(cuda: bool) -> str:
    """The process group's backends: gloo for CPU tensors and objects, NCCL for CUDA ones."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def init_process_group(cuda: bool | None = None, **kwargs) -> None:
    """Start the default process group for this rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT
    from the environment, or in `kwargs`). On CUDA the rank's device is set first and
    passed as `device_id`, so NCCL binds its communicator to it (eagerly) and every
    collective runs there, not on `cuda:0`."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available() if cuda is None else cuda
    if cuda:
        device = torch.device("cuda", local_rank())
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend=backend_for(cuda), **kwargs)


def rank_device(requested: str, distributed: bool) -> str:
    """The device a rank's model goes on: with several processes on CUDA, this rank's
    `cuda:LOCAL_RANK` whatever `model.device` says (`auto`, `cuda` or another index), unless
    it asks for the CPU; otherwise `requested` as it is."""
    if distributed and torch.cuda.is_available() and requested != "cpu":
        return f"cuda:{local_rank()}"
    return requested


class DataParallel:
    """Rank / world size and the few collectives the loop needs (no-ops in one process)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.enabled = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.enabled else 0
        self.world = dist.get_world_size() if self.enabled else 1

    @classmethod
    def from_env(cls) -> DataParallel:
        """Join the process group when started by `accelerate launch` / torchrun (WORLD_SIZE,
        RANK, MASTER_ADDR set): see `init_process_group`."""
        import torch.distributed as dist

        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            init_process_group()
            # Leave the group while the interpreter is still whole: a process that exits
            # with the group alive tears gloo's worker threads down during finalisation,
            # which now and then aborts a rank ("terminate called without an active
            # exception", SIGABRT) after its work is done.
            atexit.register(_leave_process_group)
        return cls()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def gather_objects(self, items: list) -> list:
        if not self.enabled:
            return list(items)
        parts: list[list] = [None] * self.world  # type: ignore[list-item]
        self.dist.all_gather_object(parts, items)
        return [x for part in parts for x in part]

    def max_int(self, value: int) -> int:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return int(t.item())

    def sum_floats(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        self.dist.all_reduce(t)
        return t.tolist()

    def average_gradients(self, params: list[torch.nn.Parameter],
                          bucket_mb: float = 25.0) -> None:
        """Sum gradients over ranks. Losses carry global normalisers, so the sum is the
        gradient of the global loss (each rank's loss is its share of it).

        Coalesced as torch's DDP reducer does: gradients of one dtype and device are
        flattened into buckets of about `bucket_mb` MB, one all-reduce per bucket (a few
        collectives a step instead of one per parameter), then copied back."""
        if not self.enabled:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in grad_buckets([p.grad for p in params], int(bucket_mb * 2**20)):
            flat = torch.cat([g.reshape(-1) for g in bucket]) if len(bucket) > 1 else (
                bucket[0].reshape(-1))
            self.dist.all_reduce(flat)
            if len(bucket) > 1:
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
            elif flat.data_ptr() != bucket[0].data_ptr():  # reshape copied: write it back
                bucket[0].copy_(flat.view_as(bucket[0]))


def grad_buckets(grads: list[torch.Tensor], limit_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients grouped by (device, dtype) into buckets of at most
    `limit_bytes` (a larger tensor is a bucket of its own), in the parameters' order, which
    every rank shares."""
    buckets: list[list[torch.Tensor]] = []
    open_: dict[tuple, tuple[list[torch.Tensor], int]] = {}
    for g in grads:
        if g.is_sparse:
            raise ValueError("average_gradients: sparse gradients are summed densely; "
                             "densify them first")
        key = (g.device, g.dtype)
        bucket, size = open_.get(key, ([], 0))
        nbytes = g.numel() * g.element_size()
        if bucket and size + nbytes > limit_bytes:
            buckets.append(bucket)
            bucket, size = [], 0
        bucket.append(g)
        open_[key] = (bucket, size + nbytes)
    buckets.extend(b for b, _ in open_.values() if b)
    return buckets
