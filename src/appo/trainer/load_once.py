"""Weights read once under several processes: rank 0 reads them, the others receive them.

Every rank used to read the whole float32 checkpoint from disk (8 GPUs of a node: eight
reads of ~30 GB for a 7B model, and eight whole copies in host memory at once). Here, for a
Hugging Face model directory (`model.path`, `critic.model.path`), only rank 0 reads the
weights (`appo.models.load_model`); every other rank reads the small files (config,
tokenizer), builds the architecture on the meta device (no memory, no initialisation),
allocates it empty on its device and receives every parameter and buffer from rank 0 by
broadcast (non-persistent buffers such as rotary tables included, so the copies are exact).
Under FSDP the whole model is then sharded as before (`appo.trainer.fsdp.shard_model`).

Other specs (the `tiny-test` and `smollm2-135m` aliases, GGUF files, LoRA checkpoints
merged into their base, hub ids) load on every rank as before: the aliases are built in
code or from a small local cache, the others are rare for multi-GPU runs.

A spec rank 0 cannot load must not leave the other ranks waiting in a broadcast: every rank
reports how its own part went (one object gather) before any weights move, and all raise
the first rank's error line together.
"""

from __future__ import annotations

from pathlib import Path

import torch

from appo.errors import AppoError
from appo.trainer.distributed import DataParallel


def reads_once(spec: str, dp: DataParallel) -> bool:
    """Whether `spec` is read by rank 0 alone: several processes and a local Hugging Face
    model directory."""
    path = Path(spec).expanduser()
    return dp.enabled and dp.world > 1 and path.is_dir() and (path / "config.json").is_file()


def load_once(spec: str, dp: DataParallel, dtype: str = "float32", device: str = "auto",
              trust_remote_code: bool = False):
    """`load_model(spec, dtype, device)` on every rank, the weights read from disk by rank 0
    only when `reads_once` (module docstring). Returns an `appo.models.LoadedModel`."""
    from appo.models import load_model  # looked up at each call (tests replace it)

    if not reads_once(spec, dp):
        return load_model(spec, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    lm, error = None, None
    try:
        lm = (load_model(spec, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
              if dp.is_main else _skeleton(spec, dtype, device, trust_remote_code))
    except AppoError as e:
        error = str(e)
    # Every rank's error (or None) and tensor list, before any broadcast: ranks whose lists
    # differ would wait in mismatched collectives forever.
    layouts = dp.gather_objects([(error, None if lm is None else _layout(lm.model))])
    errors = [e for e, _ in layouts if e is not None]
    if errors:
        raise AppoError(errors[0])
    if any(layout != layouts[0][1] for _, layout in layouts):
        raise AppoError(f"{spec}: the model built from its config.json differs from the one "
                        "loaded with its weights (parameters or buffers); cannot share rank 0's "
                        "weights")
    assert lm is not None
    _broadcast_from_rank0(lm.model)
    return lm


def _tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (a tied one once) and buffers, in the module's order."""
    return list(model.named_parameters()) + list(model.named_buffers())


def _layout(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in _tensors(model)]


def _skeleton(spec: str, dtype: str, device: str, trust_remote_code: bool):
    """`spec`'s model with the architecture and tokenizer of the directory but no weights
    read: built on the meta device, then allocated (uninitialised) on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from appo.models.loader import LoadedModel, check_chat_template, resolve_device, resolve_dtype

    path = str(Path(spec).expanduser())
    device = resolve_device(device)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                            trust_remote_code=trust_remote_code)
        config = AutoConfig.from_pretrained(path, local_files_only=True,
                                            trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(
                config, dtype=resolve_dtype(dtype, device), trust_remote_code=trust_remote_code)
    except Exception as e:  # as load_model's: one line naming the directory
        raise AppoError(f"cannot load model from {path}: {type(e).__name__}: {e}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    check_chat_template(tok, path)
    try:  # what from_pretrained reads besides the weights (eos ids for the engines)
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    except OSError:  # the directory has none: from_config's default, as from_pretrained's
        pass
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own tensor: tie them again
    model.eval()
    return LoadedModel(model=model, tokenizer=tok, name=spec, source=f"{path} (from rank 0)",
                       chat_template=tok.chat_template, extra={"weights_from_rank0": True})


@torch.no_grad()
def _broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Every parameter and buffer of `model` set to rank 0's, one broadcast each, in the
    order every rank shares (the same architecture). Tied weights are one parameter."""
    import torch.distributed as dist

    for _, tensor in _tensors(model):
        dist.broadcast(tensor.data, src=0)
