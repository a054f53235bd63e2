"""Data parallelism for the RL trainer: the process group and the few collectives it needs.

Under `accelerate launch` / torchrun (WORLD_SIZE > 1) each rank rolls out its share of the
prompts, trajectories are gathered so group advantages see whole groups, each rank trains
on the rows it generated, and gradients are summed once per optimizer step. Loss
normalisers are global (`appo.algos.LossAgg`), so the update equals the single-process one.
In one process every collective is a no-op.

Gradients under `trainer.parallel=ddp` are summed by torch's `DistributedDataParallel`
(`GradSync`): bucketed all-reduces that start while the backward is still running, the same
code path on CPU (gloo) as on GPUs (NCCL). Under FSDP, `fully_shard` reduces them
(`appo.trainer.fsdp`).

Devices: on CUDA each rank is pinned to its `LOCAL_RANK` device before the group exists
(`torch.cuda.set_device`, `init_process_group(device_id=...)`), and the group has two
backends, `cpu:gloo,cuda:nccl`: NCCL refuses CPU tensors, and the object collectives and
the small CPU all-reduces below (counts, normalisers) go through gloo. A rank's model lives
on `rank_device(...)`, whatever `model.device` says (`cuda` alone would put every rank on
`cuda:0`).
"""

from __future__ import annotations

import atexit
import inspect
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

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


class _MicroForward(torch.nn.Module):
    """What DDP wraps: a module whose one `forward` call runs a whole micro-batch forward.

    DDP's reducer arms its gradient hooks in the wrapper's forward (`prepare_for_backward`)
    and expects one forward per backward, but a micro-step's forward is not one
    `model(...)` call (the shared-prefix and tree forwards make one or more model calls, the
    head runs in chunks outside the model). So the closure that does all of it runs inside
    this module's forward, and `model` is a submodule, whose parameters DDP registers."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.run: Callable[[torch.nn.Module], Any] | None = None

    def forward(self) -> Any:
        assert self.run is not None, "GradSync.forward sets the micro-batch's forward"
        return self.run(self.model)


class GradSync:
    """torch's `DistributedDataParallel` around a model, for its updates' micro-steps.

    Built once, when the trainer starts (the constructor broadcasts rank 0's parameters and
    buffers): `device_ids=None` (no input moving: the micro-batch's forward places its own
    tensors), no buffer sync in the forwards (`forward_sync_buffers=False`, before torch 2.13
    `broadcast_buffers=False`: the only buffers are rotary tables, not state),
    torch's default buckets (25 MB) and `gradient_as_bucket_view=False` (what `appo plan`
    counts). Every rank syncs exactly once per optimizer step: micro-batches but the last
    run under `no_sync()` (gradients accumulate locally), the last one syncs, and a rank with
    no micro-batch in a mini-batch runs one empty synced pass (`idle`).

    DDP averages over ranks; appo's losses carry global normalisers, so the sum is wanted:
    callers scale the loss by `world` (`loss_scale`), as under FSDP.

    What DDP cannot see: a gradient written into `.grad` outside autograd (the LM head's
    in-place weight gradient, `actor.grads_in_place`) never fires its hook, and the sync would
    wait for it forever, so the update turns those off under DDP. `ignore`: trainable
    parameters the forward never uses (the critic's untied LM head), which DDP would
    otherwise wait for (`find_unused_parameters=False`: no graph walk per step)."""

    def __init__(self, model: torch.nn.Module, ignore: Iterable[torch.nn.Parameter] = ()):
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        self.model = model
        self._stage = _MicroForward(model)
        skip = {id(p) for p in ignore}
        if skip:
            names = [n for n, p in self._stage.named_parameters() if id(p) in skip]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                self._stage, names)
        # Buffers are not synced in the forwards (torch 2.13 renamed the flag).
        params = inspect.signature(DistributedDataParallel).parameters
        buffers = ("forward_sync_buffers" if "forward_sync_buffers" in params
                   else "broadcast_buffers")
        self.ddp = DistributedDataParallel(self._stage, device_ids=None, **{buffers: False})
        self.world = dist.get_world_size()

    @property
    def loss_scale(self) -> float:
        """The factor that turns DDP's average into the sum (x2 then /2 is exact in binary)."""
        return float(self.world)

    def forward(self, run: Callable[[torch.nn.Module], Any], sync: bool) -> Any:
        """`run(model)` (one micro-batch's whole forward) through DDP; its backward all-reduces
        the accumulated gradients when `sync`, else only accumulates them locally."""
        self._stage.run = run
        try:
            if sync:
                return self.ddp()
            with self.ddp.no_sync():
                return self.ddp()
        finally:
            self._stage.run = None

    def idle(self, run: Callable[[torch.nn.Module], torch.Tensor]) -> None:
        """One synced pass that adds nothing: `run(model)` must reach every synced parameter
        (any token through the whole model does); its output times 0 is backpropagated, so
        this rank's all-reduces match the other ranks' while contributing zeros."""
        out = self.forward(run, sync=True)
        (out.sum() * 0.0).backward()


def check_grad_sync(dp: DataParallel, fsdp: bool, sync: GradSync | None, what: str) -> None:
    """Several processes without FSDP need the model's `GradSync`: without it every rank
    would step on its own gradients."""
    if dp.enabled and dp.world > 1 and not fsdp and sync is None:
        from appo.errors import AppoError

        raise AppoError(f"{what}: {dp.world} processes without FSDP need the model's "
                        "DistributedDataParallel wrapper (appo.trainer.distributed.GradSync)")
