"""The non-finite guard of the training loops (issue 41): the first NaN or infinite loss or
gradient norm stops the run with one line, before the optimizer step that would write it
into the weights, so no checkpoint with a non-finite weight is ever written.

Called where each loop has the step's gradient norm in hand, just before `optimizer.step()`
(the RL actor in `appo.trainer.update`, the critic, SFT). The norm is the one over all ranks
(after the gradient all-reduce, or FSDP's sharded norm), so every rank stops together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from appo.errors import AppoError

_STOPPED = "stopped before the optimizer step; nothing of this step was saved"
HINT = f"{_STOPPED} (lower actor.optim.lr, or check actor.*'s loss coefficients and the rewards)"
CRITIC_HINT = f"{_STOPPED} (lower critic.optim.lr, or check the rewards)"
SFT_HINT = f"{_STOPPED} (lower sft.lr, or check the data)"


class NonFiniteError(AppoError):
    """A loss or gradient norm that is NaN or infinite; `step` is None where the raising
    loop does not know the run's step (the RL update): the command adds it (`at_step`)."""

    def __init__(self, what: str, step: int | None = None):
        self.what = what
        self.step = step
        super().__init__(f"step {step}: {what}" if step is not None else what)

    def at_step(self, step: int) -> NonFiniteError:
        return self if self.step is not None else NonFiniteError(self.what, step)


def check_finite(step: int | None = None, hint: str = HINT, **named_values: float) -> None:
    """Raise `NonFiniteError` naming the first of `named_values` (metric name -> value,
    e.g. `**{"actor/grad_norm": norm}`) that is NaN or infinite."""
    for name, value in named_values.items():
        value = float(value)
        if not math.isfinite(value):
            raise NonFiniteError(f"{name} is {value}: {hint}", step)


def check_finite_weights(params: Iterable, step: int | None = None) -> None:
    """Raise `NonFiniteError` when a weight is NaN or infinite (e.g. a finite gradient times
    a learning rate beyond float range), before a checkpoint would save it."""
    import torch

    for p in params:
        if not bool(torch.isfinite(p.detach()).all()):
            raise NonFiniteError("a weight is not finite after the optimizer step: stopped "
                                 "before saving it (lower the learning rate)", step)
