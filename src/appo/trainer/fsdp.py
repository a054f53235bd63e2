"""FSDP for the RL trainer: torch's `fully_shard` (FSDP2), chosen by `trainer.parallel`.

`trainer.parallel=auto` (the default) shards whenever several processes run on CUDA, and on
CPU when the process group was started by `accelerate launch` with an FSDP config (accelerate
sets `ACCELERATE_USE_FSDP=true`); `fsdp` / `ddp` force the choice. Each decoder layer is one FSDP unit and the root module
(embeddings, final norm, tied head) another, sharded over all ranks; nccl on GPUs, gloo on
CPU (the tests run it on CPU).

How the trainer differs under FSDP (and why):
- The rollout engine needs whole weights; it runs on a full replica of the policy, refreshed
  from the shards (one all-gather) before every rollout that follows an update. On GPUs
  with vLLM this is the weight sync every such system does.
- Each rank's loss already carries the global normalisers, so the gradient wanted is the
  sum over ranks; FSDP averages (as torch's DDP does, `appo.trainer.distributed.GradSync`),
  so the loss is scaled by the world size (`set_gradient_divide_factor(1)` would say the same but needs PREMUL_SUM, which gloo
  lacks).
- Every rank must run the same number of forward/backward passes (each one gathers
  shards), so ranks with fewer micro-batches run empty ones, and the shared-prefix forward
  (one or two model calls depending on the rows) is off.
- Checkpoints gather full model and optimizer states to rank 0, so an FSDP checkpoint is
  the same Hugging Face directory as any other, and resuming loads it on any layout.
- LoRA (`appo.models.lora`): PEFT's layers sit inside the decoder layers, so each unit
  holds its frozen base weights and its adapter (FSDP2 shards parameters one by one, mixed
  `requires_grad` within a unit is fine; only the adapter has gradients and optimizer
  states). The merged rollout copy is built whole before sharding and merged unit by unit
  (`unshard`, merge, `reshard`); checkpoints gather only the adapter and its states.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from appo.errors import AppoError

PARALLEL_MODES = ("auto", "ddp", "fsdp")


def fsdp_requested(parallel: str, distributed: bool) -> bool:
    if parallel not in PARALLEL_MODES:
        raise AppoError(f"trainer.parallel must be one of {', '.join(PARALLEL_MODES)}, "
                        f"got {parallel!r}")
    if parallel == "fsdp":
        if not distributed:
            raise AppoError("trainer.parallel=fsdp needs several processes: start the run with "
                            "`accelerate launch` (or torchrun)")
        return True
    env = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("1", "true", "yes")
    # Several CUDA processes shard by default: a whole float32 replica plus AdamW states
    # (16 bytes a parameter) on every GPU does not fit a 7B model on an 80 GB card.
    return parallel == "auto" and distributed and (env or torch.cuda.is_available())


def fsdp_offload(section: Any) -> bool:
    """verl's `fsdp_config.param_offload` / `optimizer_offload` of a config section: FSDP2
    offloads parameters, gradients and optimizer states together (`CPUOffloadPolicy`), so
    either one turns it on."""
    fc = getattr(section, "fsdp_config", None)
    return bool(fc is not None and (getattr(fc, "param_offload", False)
                                    or getattr(fc, "optimizer_offload", False)))


def decoder_layers(model) -> list[torch.nn.Module]:
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise AppoError(f"FSDP: cannot find the decoder layers of {type(model).__name__} "
                        "(expected model.model.layers)")
    return list(layers)


def shard_model(model, world: int, decoder=None, compute_dtype: torch.dtype | None = None,
                offload: bool = False) -> None:
    """Shard `model` in place over `world` ranks: one unit per decoder layer, plus the root.
    `decoder`: the causal LM inside `model` whose layers are the units (the critic's
    backbone: its root unit then holds the rest of the backbone and the value head, and the
    critic's forwards are calls of that root, so its hooks gather the shards); default
    `model` itself.

    `compute_dtype` (bfloat16 training over float32 master weights): FSDP2's
    `MixedPrecisionPolicy` all-gathers the parameters in that dtype (half the traffic and
    the unsharded memory) and reduces gradients in float32, as verl's FSDP mixed precision
    does. `offload`: `CPUOffloadPolicy`, the sharded parameters, gradients and optimizer
    states live in pinned CPU memory and the optimizer steps there (verl's
    `fsdp_config.param_offload` / `optimizer_offload`)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (world,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if compute_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype,
                                                   reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for layer in decoder_layers(model if decoder is None else decoder):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def sync_replica(sharded, replica) -> None:
    """Copy the sharded model's current weights into its whole `replica` (the rollout
    engine's copy), one parameter at a time: each `full_tensor()` is one all-gather (every
    rank calls them in the same order) and is freed before the next, so the sync never holds
    a second whole copy of the model; the copy casts to the replica's dtype."""
    from appo.errors import AppoError

    mine = dict(replica.named_parameters())
    mine.update(dict(replica.named_buffers()))
    seen = set()
    with torch.no_grad():
        for name, value in list(sharded.named_parameters()) + list(sharded.named_buffers()):
            target = mine.get(name)
            if target is None:
                raise AppoError(f"FSDP weight sync: the rollout copy has no {name!r}")
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            target.copy_(full)
            seen.add(name)
            del full
    missing = set(dict(replica.named_parameters())) - seen
    if missing:
        raise AppoError(f"FSDP weight sync: {len(missing)} rollout weights not in the policy, "
                        f"e.g. {sorted(missing)[0]!r}")


def full_model_state(model, rank0_cpu: bool = False) -> dict[str, torch.Tensor]:
    """Whole (unsharded) weights on every rank (a collective: all ranks must call it);
    `rank0_cpu`: on CPU and on rank 0 only (the others get an empty dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=rank0_cpu))


def full_optimizer_state(model, optimizer) -> dict[str, Any]:
    """The optimizer state of the whole model, on CPU, on rank 0 (a collective)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def keyed_by_name(optimizer_state: dict[str, Any]) -> bool:
    """Whether an optimizer state dict is the whole-model one keyed by parameter name
    (`full_optimizer_state`, which any layout loads), not `Optimizer.state_dict()`'s
    positions (which only the same layout loads)."""
    groups = optimizer_state.get("param_groups") or [{}]
    return any(isinstance(k, str) for k in optimizer_state.get("state", {})) or any(
        isinstance(p, str) for g in groups for p in g.get("params", []))


def load_optimizer_state(model, optimizer, state: dict[str, Any]) -> None:
    """A saved optimizer state into `optimizer` (of `model`, sharded or not): name-keyed
    states through torch's state-dict API (they reshard), positional ones as they are."""
    if keyed_by_name(state):
        load_full_states(model, optimizer, None, state)
    else:
        optimizer.load_state_dict(state)


def load_full_states(model, optimizer, model_state: dict | None,
                     optimizer_state: dict | None) -> None:
    """Load whole-model states (as saved by any layout) into the sharded model/optimizer;
    None: leave that one as it is (a LoRA adapter is loaded by `appo.models.lora`)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    if model_state is not None:
        set_model_state_dict(model, model_state, options=opts)
    if optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=opts)


def to_float(value) -> float:
    """A scalar that may be a DTensor (e.g. the grad norm of sharded gradients)."""
    if hasattr(value, "full_tensor"):
        value = value.full_tensor()
    return float(value)


def idle_step(model) -> None:
    """A forward/backward that contributes nothing, to keep ranks' collectives in step (any
    token does: the loss is multiplied by 0)."""
    device = next(model.parameters()).device
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    out = model(input_ids=ids, logits_to_keep=1)
    (out.logits.sum() * 0.0).backward()


@torch.no_grad()
def idle_forward(model) -> None:
    """A forward without gradients that contributes nothing (no-grad log-prob passes of a
    sharded model: the old policy's, the KL reference's), to keep ranks' gathers in step."""
    device = next(model.parameters()).device
    model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), logits_to_keep=1)


def meta_skeleton(model):
    """`model`'s architecture on the meta device (no memory): the stand-in for the rollout
    copy when vLLM takes the weights straight from the shards; a checkpoint saves through it
    (`save_pretrained(state_dict=...)`) and a resume's whole weights pass through it."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model.config)
    return skeleton.eval().requires_grad_(False)
