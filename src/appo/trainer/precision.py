"""Mixed precision for the trained model: float32 master weights, bfloat16 forwards.

verl's FSDP actor keeps its weights and optimizer states in float32 and computes in
bfloat16; its vLLM rollout runs in bfloat16. appo follows it when `model.dtype` is
`bfloat16` and `actor.fp32_master_weights` is true (the default): the trainer loads the
weights in float32, the training forwards (update, behaviour and reference log-probs) run
under `torch.autocast` in bfloat16, and the LM head's log-probs are computed from bfloat16
hidden states and weights (float32 softmax). Without it a bfloat16 weight of typical size
(|w| ~ 0.02, spacing ~1e-4) does not move under an AdamW step of lr 1e-6.
float16 is left as it is (no loss scaling here): its weights are trained in place.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["autocast", "head_inputs", "master_dtype", "train_compute_dtype"]


def train_compute_dtype(cfg: Any) -> torch.dtype | None:
    """The autocast dtype of the training forwards, or None (compute in the weights' dtype)."""
    return torch.bfloat16 if (cfg.model.dtype == "bfloat16"
                              and cfg.actor.fp32_master_weights) else None


def master_dtype(cfg: Any) -> str:
    """The dtype the trainer loads the trained weights in (a `model.dtype` value)."""
    return "float32" if train_compute_dtype(cfg) is not None else cfg.model.dtype


@contextlib.contextmanager
def autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    """`torch.autocast` in `dtype` on `device`; nothing when `dtype` is None."""
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def head_inputs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype | None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The LM head's inputs in the compute `dtype` (None: as they are). The casts are
    differentiable, so the float32 masters get float32 gradients; autocast cannot do this
    here, because the chunked head function recomputes its matmul in backward, outside it."""
    if dtype is None:
        return hidden, weight, bias
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)

