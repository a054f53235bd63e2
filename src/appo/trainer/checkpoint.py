"""Checkpoints: a Hugging Face model directory plus the state needed to resume exactly.

Layout under `trainer.default_local_dir`:
    global_step_{N}/            loadable by transformers and vLLM as is (config, safetensors,
                                tokenizer, chat template)
    global_step_{N}/trainer_state.pt   optimizer, scheduler, RNG states, step, data order
    latest                      text file naming the newest complete checkpoint

A checkpoint is written to a temporary directory and renamed, so a crash mid-save never
leaves a half checkpoint behind `latest`.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from appo.errors import AppoError

STATE_FILE = "trainer_state.pt"


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: str | Path,
    step: int,
    model,
    tokenizer,
    optimizer=None,
    scheduler=None,
    extra: dict[str, Any] | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> Path:
    """Write `global_step_{step}`; `optimizer_state` replaces `optimizer.state_dict()` (FSDP
    passes the gathered whole-model state)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"global_step_{step}"
    tmp = root / f".tmp_global_step_{step}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save(
        {
            "step": step,
            "optimizer": optimizer_state if optimizer_state is not None else (
                optimizer.state_dict() if optimizer is not None else None),
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_state(),
            "extra": extra or {},
        },
        tmp / STATE_FILE,
    )
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    (root / "latest.tmp").write_text(final.name + "\n")
    os.replace(root / "latest.tmp", root / "latest")
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    marker = root / "latest"
    if not marker.is_file():
        return None
    path = root / marker.read_text().strip()
    if not (path / STATE_FILE).is_file():
        raise AppoError(f"checkpoint {path} named in {marker} is incomplete or missing")
    return path


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    try:
        # Our own file: optimizer state and RNG states need full unpickling.
        return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise AppoError(f"no {STATE_FILE} in {path}: not an appo checkpoint") from None


def check_keys(path: Any, missing: list[str], unexpected: list[str]) -> None:
    """A loaded state dict must match the model (tied weights are saved once)."""
    tied = {k for k in missing if "lm_head" in k}
    if set(missing) - tied or unexpected:
        raise AppoError(f"checkpoint {path} does not match the model "
                        f"(missing {sorted(set(missing) - tied)[:3]}, "
                        f"unexpected {sorted(unexpected)[:3]})")


def resume_training(root: str | Path, model, optimizer, scheduler, fsdp: bool = False,
                    rollout_model=None, announce: bool = True) -> int:
    """Load the latest checkpoint under `root` into the model, optimizer and scheduler;
    returns its step (0 when there is none). Under FSDP `model` is sharded and
    `rollout_model` is the whole replica the weights are loaded into first."""
    from safetensors.torch import load_file

    from appo.trainer.fsdp import load_full_states

    path = latest_checkpoint(root)
    if path is None:
        return 0
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    trainer_state = load_trainer_state(path)
    saved_fsdp = trainer_state["extra"].get("parallel") == "fsdp"
    if saved_fsdp != fsdp:
        saved = "fsdp" if saved_fsdp else "ddp"
        raise AppoError(f"checkpoint {path} was written by a {saved} run; resume it with "
                        f"trainer.parallel={saved} (optimizer states differ)")
    if fsdp:
        check_keys(path, *rollout_model.load_state_dict(state, strict=False))
        load_full_states(model, optimizer, rollout_model.state_dict(), trainer_state["optimizer"])
    else:
        check_keys(path, *model.load_state_dict(state, strict=False))
        optimizer.load_state_dict(trainer_state["optimizer"])
    scheduler.load_state_dict(trainer_state["scheduler"])
    step = int(trainer_state["step"])
    if announce:
        print(f"appo: resumed from {path} at step {step}")
    return step
