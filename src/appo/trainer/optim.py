"""The AdamW every trained part of appo uses (policy, critic, SFT), built in one place.

Which of torch's AdamW implementations runs is a speed choice, not a different optimizer:
the fused kernel updates each parameter in one pass over its moments, where the default
for-loop implementation makes about ten passes (one op each); the two agree up to float
rounding (`tests/trainer/test_optim.py`). The fused one is given a hook that bumps the
parameters' version counters after each step, as the loop's in-place ops do (the fused
kernel does not). `optim.fused` (`actor.optim.fused`, `critic.optim.fused`, `sft.fused`):
None picks the fused kernel when every parameter is a plain CPU tensor (not FSDP's
DTensors) and torch's own default otherwise; true or false forces it. Timings in
`benchmarks/RESULTS.md` ("Training step and memory").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.autograd.graph import increment_version


def fused_by_default(params: list[nn.Parameter]) -> bool:
    """The fused kernel where it is known to pay off and to apply: plain CPU tensors."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(
        p.device.type == "cpu" and not isinstance(p.data, DTensor) for p in params)


def adamw(params: Iterable[nn.Parameter], lr: float, weight_decay: float = 0.0,
          betas: tuple[float, float] = (0.9, 0.999),
          fused: bool | None = None) -> torch.optim.AdamW:
    """`torch.optim.AdamW` over `params`; `fused` None: `fused_by_default`."""
    params = list(params)
    if fused is None:
        fused = fused_by_default(params)
    # Not fused: torch's own choice (the for-loop on the CPU, foreach on CUDA).
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay,
                                  betas=tuple(betas), fused=True if fused else None)
    if fused:
        optimizer.register_step_post_hook(_bump_versions)
    return optimizer


def _bump_versions(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """The fused kernel writes the parameters without bumping their version counters
    (torch 2.13, CPU), which is how the hf engine's weight copies and packed panels learn
    that a weight changed (`appo.rollout.cpu.lean`, `appo.rollout.cpu.panels`): without
    this, a decode after an optimizer step would run on the old weights."""
    increment_version([p for group in optimizer.param_groups for p in group["params"]])
