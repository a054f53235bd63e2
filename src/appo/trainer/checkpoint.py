"""Checkpoints: a Hugging Face model directory plus the state needed to resume exactly.

Layout under `trainer.default_local_dir`:
    global_step_{N}/            loadable by transformers and vLLM as is (config, safetensors,
                                tokenizer, chat template)
    global_step_{N}/trainer_state.pt   optimizer, scheduler, RNG states, step, data order
    global_step_{N}/<part>/     a trained part besides the policy (`TrainedPart`, e.g. the
                                critic): model.safetensors and state.pt (optimizer, scheduler)
    global_step_{N}/manifest.json      size and sha256 of every file, written last
    latest                      text file naming the newest checkpoint written
Under LoRA (`model.lora_rank` > 0) `global_step_{N}` holds the adapter in PEFT's format
(`adapter_model.safetensors`, `adapter_config.json`) instead of the model, and with
`model.lora_save_merged` a `merged/` Hugging Face directory (base weights + adapter, base
parameter names) that transformers and vLLM load without appo or PEFT.

A checkpoint is built under a temporary name and swapped in by `appo.fsutil.atomic_dir`:
an existing `global_step_N` (resuming a finished run rewrites it) is removed only after the
new one is in place. A failed write (a full disk) removes the temporary directory and
becomes one line naming the path. Resume takes the newest checkpoint whose files match its
manifest and says which ones it skipped and why, so a truncated file never reaches
`torch.load` as an internal error.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from appo.errors import AppoError
from appo.fsutil import atomic_dir, atomic_write_text, is_write_failure, write_error
from appo.trainer.guards import check_finite_weights

STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: the checkpoint holds a LoRA adapter
MERGED_DIR = "merged"
PART_WEIGHTS = "model.safetensors"
PART_STATE = "state.pt"


@dataclass
class PartStates:
    """A trained part's whole states, ready to write (`TrainedPart.gather`)."""

    model: dict[str, torch.Tensor]  # tied weights under one name only
    optimizer: dict[str, Any]
    scheduler: dict[str, Any] | None

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        path.mkdir()
        save_file({k: v.contiguous() for k, v in self.model.items()}, str(path / PART_WEIGHTS),
                  metadata={"format": "pt"})
        torch.save({"optimizer": self.optimizer, "scheduler": self.scheduler}, path / PART_STATE)


@dataclass
class TrainedPart:
    """A module trained beside the policy (the critic), with its optimizer and scheduler;
    saved in `global_step_N/<name>/` and restored on resume. `sharded`: the module is
    sharded by FSDP; its whole states are gathered to save (the same files as unsharded,
    except that the optimizer state is keyed by parameter name, as the policy's is) and
    loaded into the shards."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    sharded: bool = False

    def gather(self) -> PartStates:
        """The states to save; under FSDP a collective (every rank calls it) whose states are
        on rank 0 only."""
        from appo.trainer.fsdp import full_model_state, full_optimizer_state

        model = (full_model_state(self.module, rank0_cpu=True) if self.sharded
                 else self.module.state_dict())
        # keyed by parameter name in every layout: any layout / world size resumes it
        optimizer = full_optimizer_state(self.module, self.optimizer)
        aliases = _tied_aliases(self.module)
        return PartStates({k: v.detach() for k, v in model.items() if k not in aliases},
                          optimizer, self.scheduler.state_dict() if self.scheduler else None)

    def save(self, path: Path) -> None:
        self.gather().save(path)

    def load(self, path: Path, checkpoint: Path) -> None:
        from safetensors.torch import load_file

        if not (path / PART_WEIGHTS).is_file():
            raise AppoError(f"checkpoint {checkpoint} has no {path.name} (written by a run "
                            f"without one); resume it with the same algorithm settings")
        weights = load_file(str(path / PART_WEIGHTS))
        for alias, name in _tied_aliases(self.module).items():  # stored under one name
            if name in weights or alias in weights:
                weights.setdefault(alias, weights.get(name))
                weights.setdefault(name, weights[alias])
        expected = set(self.module.state_dict())
        check_keys(path, sorted(expected - set(weights)), sorted(set(weights) - expected))
        state = torch.load(path / PART_STATE, map_location="cpu", weights_only=False)
        from appo.trainer.fsdp import load_full_states, load_optimizer_state

        if self.sharded:
            load_full_states(self.module, self.optimizer, weights, None)
        else:
            self.module.load_state_dict(weights)
        load_optimizer_state(self.module, self.optimizer, state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])


def _tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """`{alias: name}` for every parameter reachable under two names (tied embeddings):
    `name` is the one `named_parameters` reports."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


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
    parts: dict[str, TrainedPart | PartStates] | None = None,
    lora: Any = None,
    merged: Any = None,
    model_state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `global_step_{step}`; `model_state` replaces `model`'s own weights (FSDP passes
    the gathered float32 masters; `model` is then the engine's replica, maybe bfloat16, or a
    meta-device skeleton); `optimizer_state` replaces `optimizer.state_dict()` (FSDP passes
    the gathered whole-model state); `parts` go to their own subdirectories (under
    FSDP as `TrainedPart.gather` returned them on rank 0). `lora` (an
    `appo.models.lora.LoraPolicy`, or under FSDP the `AdapterSnapshot` every rank gathered):
    save its adapter instead of `model`; `merged`: a model also saved (with the tokenizer) to
    `merged/`."""
    root = Path(root)
    final = root / f"global_step_{step}"
    # Never a NaN / inf weight: what is written (under FSDP the gathered `model_state`).
    if lora is None:
        check_finite_weights(model.parameters() if model_state is None else
                             [t for t in model_state.values() if t.is_floating_point()], step)
    if merged is not None:
        check_finite_weights(merged.parameters(), step)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with atomic_dir(final) as tmp:  # removes tmp on any failure
            try:
                if lora is not None:
                    lora.save(tmp)
                else:
                    model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
                tokenizer.save_pretrained(tmp)
                if merged is not None:
                    merged.save_pretrained(tmp / MERGED_DIR, safe_serialization=True)
                    tokenizer.save_pretrained(tmp / MERGED_DIR)
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
                for name, part in (parts or {}).items():
                    part.save(tmp / name)
                write_manifest(tmp, step)
            except Exception as e:
                # Named while the partial files still fill the disk (write_error's docstring).
                if is_write_failure(e):
                    raise write_error(e, final, "save checkpoint") from e
                raise
        atomic_write_text(root / "latest", final.name + "\n")
    except OSError as e:
        raise write_error(e, final, "save checkpoint") from e
    return final


def _file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(path: Path, step: int) -> None:
    """Size and sha256 of every file in the checkpoint directory (sha256 runs at ~1 GB/s:
    about 0.5 s for SmolLM2's 538 MB)."""
    files = {}
    for f in sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST):
        files[f.relative_to(path).as_posix()] = {"size": f.stat().st_size,
                                                 "sha256": _file_digest(f)}
    atomic_write_text(path / MANIFEST, json.dumps({"format": 1, "step": step, "files": files},
                                                  indent=1))


def verify_checkpoint(path: Path) -> str | None:
    """None when `path` is a complete checkpoint, else why not (one phrase). A checkpoint
    without a manifest (an older appo) is checked when it is loaded."""
    if not (path / STATE_FILE).is_file():
        return f"no {STATE_FILE}"
    if not (path / MANIFEST).is_file():
        return None
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"unreadable {MANIFEST}"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{name} truncated ({size} of {want['size']} bytes)" if size < want[
                "size"] else f"{name} has {size} bytes, {want['size']} expected"
        if _file_digest(f) != want["sha256"]:
            return f"{name} fails its checksum"
    return None


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    found = []
    for p in root.glob("global_step_*") if root.is_dir() else []:
        tail = p.name[len("global_step_"):]
        if p.is_dir() and tail.isdigit():
            found.append((int(tail), p))
    return sorted(found, reverse=True)


def _read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    from appo.trainer.sharded import is_sharded

    state: dict[str, torch.Tensor] = {}
    if is_sharded(path):  # the weights are read from the shards, each rank its own part
        return state, load_trainer_state(path)
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state, load_trainer_state(path)


def find_checkpoint(root: str | Path, load: bool = False):
    """The newest checkpoint under `root` that verifies: `(path, loaded or None, skipped)`,
    `skipped` naming each newer one passed over and why. `load=True` also reads its tensors
    and trainer state (a file that fails to load counts as corrupt, for checkpoints written
    before manifests). `(None, None, skipped)` when none is usable."""
    skipped: list[str] = []
    for _step, path in _step_dirs(Path(root)):
        reason = verify_checkpoint(path)
        loaded = None
        if reason is None and load:
            try:
                loaded = _read_checkpoint(path)
            except AppoError:
                raise
            except Exception as e:  # noqa: BLE001 - any unreadable file means: skip it
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                reason = f"unreadable ({first[:120]})"
        if reason is None:
            return path, loaded, skipped
        skipped.append(f"{path.name}: {reason}")
    return None, None, skipped


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under `root` that verifies; None when there is none at all."""
    path, _, skipped = find_checkpoint(root)
    if path is None and skipped:
        raise AppoError(no_valid_message(root, skipped))
    return path


def no_valid_message(root: str | Path, skipped: list[str]) -> str:
    return (f"no valid checkpoint in {root} ({'; '.join(skipped)}); "
            "start a new run in another directory, or trainer.overwrite=true to replace it")


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
                    rollout_model=None, announce: bool = True,
                    config: dict[str, Any] | None = None,
                    parts: dict[str, TrainedPart] | None = None, lora: Any = None) -> int:
    """Load the newest valid checkpoint under `root` into the model, optimizer and
    scheduler; returns its step (0 when there is none). Under FSDP `model` is sharded and
    `rollout_model` is the whole replica the weights are loaded into first. `config` (the
    run's config as a dict) is compared with the checkpoint's: one warning per changed key.
    `parts` (e.g. the critic) are restored from their subdirectories.
    `lora` (an `appo.models.lora.LoraPolicy`): the checkpoint's adapter is loaded into it
    (the base weights are those of `model.path`, which the adapter was trained on)."""
    path, loaded, skipped = find_checkpoint(root, load=True)
    for note in skipped if announce else []:
        print(f"appo: skipped checkpoint {Path(root) / note}", file=sys.stderr)
    if path is None or loaded is None:
        if skipped:
            raise AppoError(no_valid_message(root, skipped))
        if announce:
            print(f"appo: trainer.resume=true but {root} holds no checkpoint yet: "
                  "starting at step 0")
        return 0
    state, trainer_state = loaded
    if trainer_state["extra"].get("sharded"):
        step = _resume_sharded(path, trainer_state, model, optimizer, scheduler, fsdp,
                               rollout_model, parts or {}, lora)
    else:
        step = _resume_whole(path, state, trainer_state, model, optimizer, scheduler, fsdp,
                             rollout_model, parts or {}, lora)
    if announce:
        print(f"appo: resumed from {path} at step {step}")
        saved_config = trainer_state["extra"].get("config")
        if config is not None and saved_config is not None:
            for line in config_changes(saved_config, config):
                print(f"appo: warning: resuming with a changed config: {line}", file=sys.stderr)
    return step


def _resume_sharded(path: Path, trainer_state: dict[str, Any], model, optimizer, scheduler,
                    fsdp: bool, rollout_model, parts: dict[str, TrainedPart],
                    lora: Any) -> int:
    """A sharded checkpoint (`appo.trainer.sharded`): DCP reads each rank's part."""
    from appo.trainer.fsdp import sync_replica
    from appo.trainer.sharded import load_shards

    if lora is not None:
        raise AppoError(f"checkpoint {path} holds a full model in shards; resume it with "
                        "model.lora_rank=0")
    saved_parts = trainer_state.get("parts") or {}
    if set(saved_parts) != set(parts):
        raise AppoError(f"checkpoint {path} holds {sorted(saved_parts) or 'no part'} beside "
                        f"the policy, this run trains {sorted(parts) or 'none'}; resume it "
                        "with the same algorithm settings")
    trained = {"": (model, optimizer)}
    trained.update({name: (p.module, p.optimizer) for name, p in parts.items()})
    load_shards(path, trained)
    if fsdp and rollout_model is not None and rollout_model is not model and not any(
            p.is_meta for p in rollout_model.parameters()):
        sync_replica(model, rollout_model)  # the engine's whole copy, from the loaded shards
    scheduler.load_state_dict(trainer_state["scheduler"])
    for name, part in parts.items():
        if part.scheduler is not None and saved_parts[name] is not None:
            part.scheduler.load_state_dict(saved_parts[name])
    return int(trainer_state["step"])


def _resume_whole(path: Path, state: dict[str, torch.Tensor], trainer_state: dict[str, Any],
                  model, optimizer, scheduler, fsdp: bool, rollout_model,
                  parts: dict[str, TrainedPart], lora: Any) -> int:
    """A whole-state checkpoint: the Hugging Face weights plus `trainer_state.pt`."""
    from appo.trainer.fsdp import keyed_by_name, load_full_states, load_optimizer_state

    saved_fsdp = trainer_state["extra"].get("parallel") == "fsdp"
    optimizer_state = trainer_state["optimizer"]
    # Name-keyed optimizer states (every checkpoint since they were) load into any layout and
    # world size; an older positional one only into the layout that wrote it.
    if saved_fsdp != fsdp and not keyed_by_name(optimizer_state):
        saved = "fsdp" if saved_fsdp else "ddp"
        raise AppoError(f"checkpoint {path} was written by a {saved} run; resume it with "
                        f"trainer.parallel={saved} (optimizer states differ)")
    saved_lora = (path / ADAPTER_CONFIG).is_file()
    if saved_lora != (lora is not None):
        raise AppoError(f"checkpoint {path} holds {'a LoRA adapter' if saved_lora else 'a full model'}"
                        f"; resume it with model.lora_rank "
                        f"{'> 0 as it was trained' if saved_lora else '= 0'}")
    if lora is not None:
        lora.load_adapter_state(state, path)
        load_optimizer_state(model, optimizer, optimizer_state)
    elif fsdp:
        check_keys(path, *rollout_model.load_state_dict(state, strict=False))
        # The shards from the saved float32 weights themselves (the replica may be
        # bfloat16), with each tied alias named as FSDP's state dict names it.
        full = dict(state)
        for alias, name in _tied_aliases(rollout_model).items():
            full.setdefault(alias, state[name])
        load_full_states(model, optimizer, full, None)
        load_optimizer_state(model, optimizer, optimizer_state)
    else:
        check_keys(path, *model.load_state_dict(state, strict=False))
        load_optimizer_state(model, optimizer, optimizer_state)
    scheduler.load_state_dict(trainer_state["scheduler"])
    for name, part in parts.items():
        part.load(path / name, path)
    return int(trainer_state["step"])


# Keys that are expected to differ on resume: extending a run, the resume switches.
RESUME_KEYS_IGNORED = frozenset({"trainer.resume", "trainer.overwrite", "trainer.total_steps",
                                 "trainer.total_epochs", "trainer.default_local_dir"})


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`key old -> new` for every setting that differs (dotted keys, sorted)."""
    from appo.config import flatten

    a, b = flatten(old), flatten(new)
    missing = object()
    lines = []
    ignored = set(RESUME_KEYS_IGNORED)
    # A memory target or activation share rewrites the token budget at start-up (the saved
    # config holds the derived value, the new one the key's own): compare the targets only.
    if any(c.get(k) is not None for c in (a, b)
           for k in ("actor.max_memory_gb", "actor.activation_memory_gb")):
        ignored.add("actor.ppo_max_token_len_per_device")
    for key in sorted(set(a) | set(b)):
        if key in ignored:
            continue
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:
            show = [("(unset)" if v is missing else repr(v) if isinstance(v, str) else str(v))
                    for v in (va, vb)]
            lines.append(f"{key} {show[0]} -> {show[1]}")
    return lines
