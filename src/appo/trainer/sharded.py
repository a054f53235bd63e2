"""Sharded checkpoints (`trainer.sharded_checkpoint=true`): torch.distributed.checkpoint.

A whole-state checkpoint (the default, `appo.trainer.checkpoint`) gathers the float32 weights
and AdamW states on rank 0 and writes them there: for a 7B-14B policy that is 90-170 GB
through one process's memory at every save. With `trainer.sharded_checkpoint` every rank
writes its own shards of the policy's (and the critic's) weights and optimizer states through
torch's distributed checkpoint (DCP) into `global_step_N/shards/`, and resume reads them back
through DCP, which reshards: a run saved by N processes resumes on M (one included), in any
layout. Rank 0 adds what is small: the model's `config.json`, the tokenizer, the trainer state
(scheduler, RNG states, step; the optimizer lives in the shards) and the manifest.

Only the run's last checkpoint also holds the whole model as a Hugging Face directory; any
other is turned into one by `appo export CHECKPOINT OUT` (`export_hf`), offline and in one
process, reading only the weights from the shards.

Not with LoRA (an adapter checkpoint is small and whole already): refused at load.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from appo.errors import AppoError

SHARDS_DIR = "shards"


def is_sharded(checkpoint: Path) -> bool:
    return (Path(checkpoint) / SHARDS_DIR).is_dir()


def _states(trained: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]) -> dict[str, Any]:
    """DCP's state: each trained module's weights and optimizer state (torch's state-dict
    API: DTensor shards under FSDP, keyed by parameter name), under `model` / `optimizer`
    for the policy and `<part>.model` / `<part>.optimizer` for a part (the critic)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out: dict[str, Any] = {}
    for name, (module, optimizer) in trained.items():
        prefix = f"{name}." if name else ""
        model_sd, optim_sd = get_state_dict(module, optimizer)
        out[f"{prefix}model"], out[f"{prefix}optimizer"] = model_sd, optim_sd
    return out


def check_finite_shards(modules: list[torch.nn.Module], step: int, dp) -> None:
    """No checkpoint with a NaN / inf weight (`appo.trainer.guards`): each rank checks its
    own shards, and all ranks agree before any of them writes (a collective)."""
    bad = 0
    for module in modules:
        for p in module.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if local.is_floating_point() and not bool(torch.isfinite(local).all()):
                bad = 1
                break
    if dp.max_int(bad):
        raise AppoError(f"step {step}: the model holds a NaN or inf weight; no checkpoint "
                        "written (see the step's actor/grad_norm and loss in metrics.jsonl)")


def save_shards(path: Path, trained: dict[str, tuple[torch.nn.Module, Any]]) -> None:
    """Every rank writes its shards of `trained` into `path/shards` (a collective; DCP's
    coordinator, rank 0, writes the metadata once every rank's files are written)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_states(trained), checkpoint_id=str(Path(path) / SHARDS_DIR))


def load_shards(path: Path, trained: dict[str, tuple[torch.nn.Module, Any]]) -> None:
    """Load `path/shards` into `trained`'s modules and optimizers, whatever layout and world
    size wrote them (DCP reads each rank's part of every tensor)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    states = _states(trained)
    try:
        dcp.load(states, checkpoint_id=str(Path(path) / SHARDS_DIR))
    except Exception as e:  # noqa: BLE001 - DCP's errors (a missing key, a shape) as one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AppoError(f"checkpoint {path} does not match this run's model: {first[:200]}"
                        ) from e
    for name, (module, optimizer) in trained.items():
        prefix = f"{name}." if name else ""
        set_state_dict(module, optimizer, model_state_dict=states[f"{prefix}model"],
                       optim_state_dict=states[f"{prefix}optimizer"])


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """A sharded checkpoint's policy as a Hugging Face directory `out` (config, safetensors,
    tokenizer), loadable by transformers and vLLM. One process, no process group; reads
    only the policy's weights (not the optimizer's states) from the shards."""
    import shutil

    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint, out = Path(checkpoint), Path(out)
    if not checkpoint.is_dir():
        raise AppoError(f"appo export: {checkpoint} is not a directory")
    if not is_sharded(checkpoint):
        if any(checkpoint.glob("*.safetensors")):
            raise AppoError(f"appo export: {checkpoint} is already a Hugging Face directory "
                            "(a whole-state checkpoint): load it as it is")
        raise AppoError(f"appo export: {checkpoint} has no {SHARDS_DIR}/ (not a sharded "
                        "appo checkpoint)")
    if out.exists() and any(out.iterdir()):
        raise AppoError(f"appo export: {out} exists and is not empty")
    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.to_empty(device="cpu")
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = {"model": get_model_state_dict(model)}
    try:
        dcp.load(state, checkpoint_id=str(checkpoint / SHARDS_DIR), no_dist=True)
    except Exception as e:  # noqa: BLE001 - one line, not DCP's traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise AppoError(f"appo export: cannot read {checkpoint / SHARDS_DIR}: {first[:200]}"
                        ) from e
    model.load_state_dict(state["model"], strict=False)  # the same tensors: a no-op copy
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for f in checkpoint.iterdir():  # the tokenizer and chat template, as saved
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in (
                "special_tokens_map.json", "chat_template.jinja", "vocab.json",
                "merges.txt", "generation_config.json")):
            shutil.copy2(f, out / f.name)
    print(f"appo: exported {checkpoint} to {out}", file=sys.stderr)
    return out
