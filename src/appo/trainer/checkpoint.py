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
