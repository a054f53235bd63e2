"""The AdamW every trained part of appo uses (policy, critic, SFT), built in one place.

Which of torch's AdamW implementations runs is a speed choice, not a different optimizer:
the fused kernel updates each parameter in one pass over its moments, where the default
for-loop implementation makes about ten passes (one op each); the two agree up to float
rounding (`tests/trainer/test_optim.py`). `optim.fused` (`actor.optim.fused`,
`critic.optim.fused`, `sft.fused`): None picks the fused kernel when every parameter is a
plain CPU tensor (not FSDP's DTensors) and torch's own default otherwise; true or false
forces it. Timings in `benchmarks/RESULTS.md` ("Training step and memory").
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


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
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas),
                             fused=True if fused else None)
