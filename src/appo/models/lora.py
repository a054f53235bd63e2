"""LoRA adapters through PEFT (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language
Models"), under verl's keys: `model.lora_rank` (0: full fine-tuning), `model.lora_alpha`,
`model.target_modules` ("all-linear" or a list of module names), `model.lora_dropout`.

`LoraPolicy` wraps a loaded causal LM:
- `model`: the Hugging Face model itself with PEFT's LoRA layers injected (the trainer's
  forwards use it as before); only the adapter parameters require grad, so the optimizer
  holds states for them alone.
- `disabled()`: the base model (the adapter switched off), the reference policy of a KL
  term without a second copy of the weights.
- `rollout_model()`: a plain model of the base architecture whose adapted linear layers
  hold merged weights `W + (alpha / r) B A` and which shares every other tensor (embeddings,
  norms) with the policy. The rollout engines sample from it, the vllm/openai engines sync
  it (base parameter names), and it is the merged Hugging Face checkpoint. `merge()`
  refreshes it after an update: one pass over the adapted matrices.
Deviation from verl (which merges the adapter into the base weights in place before a weight
sync, then unmerges): in-place merge/unmerge adds and subtracts the same product, which is
not exact in floating point, so the base weights would drift step by step; a separate
merged copy keeps them bit-identical and resume exact.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from appo.errors import AppoError

ADAPTER = "default"  # PEFT's adapter name; appo trains one adapter

__all__ = ["AdapterSnapshot", "LoraPolicy", "apply_lora", "lora_enabled"]


def lora_enabled(model_cfg: Any) -> bool:
    """`model.lora_rank > 0` (checked: a negative rank is an error)."""
    rank = int(getattr(model_cfg, "lora_rank", 0) or 0)
    if rank < 0:
        raise AppoError(f"model.lora_rank must be >= 0 (0: full fine-tuning), got {rank}")
    return rank > 0


def _target_modules(value: Any) -> str | list[str]:
    if isinstance(value, str) and value.strip():
        return value.strip()
    if isinstance(value, Sequence) and len(value) and all(  # a list or OmegaConf ListConfig
            isinstance(v, str) and v for v in value):
        return [str(v) for v in value]
    raise AppoError(f"model.target_modules must be 'all-linear' or a list of module names "
                    f"(e.g. [q_proj,v_proj]), got {value!r}")


class LoraPolicy:
    """A causal LM with one trainable LoRA adapter (see module docstring)."""

    def __init__(self, peft_model: Any):
        self.peft = peft_model
        self.model = peft_model.base_model.model  # the HF model, LoRA layers injected
        from peft.tuners.lora import LoraLayer

        self.layers: dict[str, Any] = {name: m for name, m in self.model.named_modules()
                                       if isinstance(m, LoraLayer)}
        self._rollout: torch.nn.Module | None = None
        self.merge_seconds = 0.0  # the last merge's wall time

    # ------------------------------------------------------------------ policy / reference
    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Inside: `model` computes the base model (adapter off); the reference policy."""
        with self.peft.disable_adapter():
            yield

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ merged weights
    def rollout_model(self) -> torch.nn.Module:
        """The merged model (built on first use), merged from the adapter as it is now."""
        if self._rollout is None:
            self._rollout = self._merged_structure()
        self.merge()
        return self._rollout

    def _merged_structure(self) -> torch.nn.Module:
        # Share every tensor but the adapted layers' weights (deepcopy returns memo
        # entries as they are), then replace each LoRA layer by its (copied) base layer.
        adapted = {id(layer.get_base_layer().weight) for layer in self.layers.values()}
        memo: dict[int, Any] = {}
        for p in self.model.parameters():
            if id(p) not in adapted and not p.requires_grad:
                memo[id(p)] = p
        for b in self.model.buffers():
            memo[id(b)] = b
        # PEFT's own bookkeeping on the model must not follow the copy (a merged model is
        # a plain Hugging Face model, saved with base names).
        merged = copy.deepcopy(self.model, memo)
        for name in self.layers:
            merged.set_submodule(name, merged.get_submodule(name).get_base_layer())
        for attr in ("peft_config", "_hf_peft_config_loaded"):
            merged.__dict__.pop(attr, None)
        return merged.eval().requires_grad_(False)

    @torch.no_grad()
    def merge(self) -> float:
        """Refresh the merged model from the current adapter (`W + delta` per adapted layer);
        returns the seconds it took (also kept as `merge_seconds`). Under FSDP a collective
        (every rank calls it): each FSDP unit holding adapted layers is gathered whole for
        its layers' merge, then sharded again (`_fsdp_units`)."""
        if self._rollout is None:
            return 0.0  # nothing merged yet: `rollout_model()` builds and merges
        t0 = time.perf_counter()
        for unit, names in self._fsdp_units():
            if unit is not None:
                unit.unshard()  # whole W, A and B of this unit's layers, on every rank
            for name in names:
                layer = self.layers[name]
                base = layer.get_base_layer().weight
                out = self._rollout.get_submodule(name).weight
                out.copy_(base + layer.get_delta_weight(ADAPTER).to(base.dtype))
            if unit is not None:
                unit.reshard()
        self.merge_seconds = time.perf_counter() - t0
        return self.merge_seconds

    def _fsdp_units(self) -> list[tuple[Any, list[str]]]:
        """The adapted layers grouped by the FSDP unit (`fully_shard`ed module) that holds
        their parameters, in module order (the same on every rank); one group with unit
        None when the model is not sharded."""
        from torch.distributed.fsdp import FSDPModule

        units = [n for n, m in self.model.named_modules() if isinstance(m, FSDPModule)]
        if not units:
            return [(None, list(self.layers))]
        groups: dict[str, list[str]] = {}
        for name in self.layers:  # the innermost unit around a layer holds its parameters
            owner = max((u for u in units if u == "" or name.startswith(u + ".")), key=len)
            groups.setdefault(owner, []).append(name)
        return [(self.model.get_submodule(u), names) for u, names in groups.items()]

    # ------------------------------------------------------------------ checkpoints
    def snapshot(self) -> AdapterSnapshot:
        """The adapter as it is now, whole tensors, to save. Under FSDP a collective (every
        rank calls it; then rank 0 saves): the sharded adapter parameters are gathered."""
        whole = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v)
                 for k, v in self.peft.state_dict().items() if "lora_" in k}
        return AdapterSnapshot(self.peft, whole)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """PEFT's adapter state dict (the keys of `adapter_model.safetensors`), whole tensors;
        under FSDP a collective, as `snapshot`."""
        from peft import get_peft_model_state_dict

        # save_embedding_layers=False: as in `AdapterSnapshot.save` (no Hub look-up)
        return get_peft_model_state_dict(self.peft, state_dict=self.snapshot().state,
                                         save_embedding_layers=False)

    def adapter_keys(self) -> set[str]:
        """The keys of `adapter_state()`, without gathering anything under FSDP (the names
        depend on the model's structure only)."""
        from peft import get_peft_model_state_dict

        local = {k: v for k, v in self.peft.state_dict().items() if "lora_" in k}
        return set(get_peft_model_state_dict(self.peft, state_dict=local,
                                             save_embedding_layers=False))

    def load_adapter_state(self, state: dict[str, torch.Tensor], source: Any) -> None:
        """Load a PEFT adapter state dict (`adapter_model.safetensors`) saved by `save`.
        Under FSDP a collective; every rank passes the whole state (each keeps its shard)."""
        from peft import set_peft_model_state_dict
        from torch.distributed.tensor import DTensor, distribute_tensor

        sharded = {n.replace(f".{ADAPTER}.", "."): p for n, p in self.peft.named_parameters()
                   if isinstance(p, DTensor)}  # by their key in PEFT's file
        if sharded:  # copy this rank's shard of each tensor (no communication)
            state = {k: (distribute_tensor(v, sharded[k].device_mesh, sharded[k].placements,
                                           src_data_rank=None) if k in sharded else v)
                     for k, v in state.items()}
        self._check_saved_shape(state, source)
        result = set_peft_model_state_dict(self.peft, state)
        expected = self.adapter_keys()
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected or set(state) != expected:
            missing = sorted(expected - set(state))
            raise AppoError(f"adapter in {source} does not match model.lora_* (missing "
                            f"{missing[:3]}, unexpected {sorted(set(state) - expected)[:3]})")

    def _check_saved_shape(self, state: dict[str, torch.Tensor], source: Any) -> None:
        """A saved adapter of another rank is a changed setting, named as one (both values),
        not a size mismatch inside PEFT's loader."""
        import json

        now = int(self.peft.peft_config[ADAPTER].r)
        saved = None
        try:
            saved = int(json.loads((Path(source) / "adapter_config.json").read_text())["r"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if saved is None:  # no readable config: the rank from A's shape (rank x in)
            saved = next((int(v.shape[0]) for k, v in state.items() if "lora_A" in k), now)
        if saved != now:
            raise AppoError(f"checkpoint {source} holds an adapter of model.lora_rank={saved}; "
                            f"this run has model.lora_rank={now}: resume with "
                            f"model.lora_rank={saved}, or start a new run")

    def save(self, path: str | Path) -> None:
        """`adapter_model.safetensors` + `adapter_config.json` (PEFT's format). Under FSDP
        every rank takes `snapshot()` and rank 0 saves that instead."""
        self.snapshot().save(path)


@dataclass
class AdapterSnapshot:
    """A LoRA adapter's whole tensors at one moment (`LoraPolicy.snapshot`), which one rank
    can save alone."""

    peft: Any  # the PeftModel (its adapter config)
    state: dict[str, torch.Tensor]  # the PeftModel's state-dict keys, adapter entries only

    def save(self, path: str | Path) -> None:
        """`adapter_model.safetensors` + `adapter_config.json` (PEFT's format)."""
        # save_embedding_layers="auto" would look the base up on the Hub (network); the base
        # embeddings never change here (frozen, never resized), so there is nothing to add.
        self.peft.save_pretrained(str(path), safe_serialization=True,
                                  save_embedding_layers=False, state_dict=self.state)


def apply_lora(model: torch.nn.Module, model_cfg: Any) -> LoraPolicy | None:
    """Inject a LoRA adapter into `model` (in place) per `model.*`; None when
    `model.lora_rank` is 0. The base weights are frozen; PEFT initialises A randomly
    (from the torch generator: seed before) and B to zero, so the adapted model starts as
    the base model. A target PEFT would ignore, cannot train here, or a rank no layer can
    hold is refused before anything is injected (`check_targets`)."""
    if not lora_enabled(model_cfg):
        return None
    from peft import LoraConfig, get_peft_model

    alpha = float(model_cfg.lora_alpha)
    dropout = float(model_cfg.lora_dropout)
    if not 0.0 <= dropout < 1.0:
        raise AppoError(f"model.lora_dropout must be in [0, 1), got {dropout}")
    config = LoraConfig(r=int(model_cfg.lora_rank), lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=_target_modules(model_cfg.target_modules),
                        bias="none", task_type="CAUSAL_LM")
    check_targets(model, config)
    try:
        with _quiet_peft():
            peft_model = get_peft_model(model, config)
    except ValueError as e:  # e.g. a module type PEFT cannot adapt
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise AppoError(f"model.target_modules: {first}") from None
    # adapter_config.json names the base as appo loads it (an alias, a hub id or an absolute
    # directory), so `model.path=<checkpoint>` can rebuild the merged model.
    spec = str(getattr(model_cfg, "path", "") or "")
    if spec and Path(spec).expanduser().exists():
        spec = str(Path(spec).expanduser().resolve())
    peft_model.peft_config[ADAPTER].base_model_name_or_path = spec or None
    return LoraPolicy(peft_model)


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """PEFT asks transformers through a deprecated name when it wraps a model: a warning
    about library internals on every LoRA run, which the user cannot act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        yield


def _layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last names of the modules with a 2-D weight (what a user can target)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if n and getattr(getattr(m, "weight", None), "dim", lambda: 0)() == 2})


def check_targets(model: torch.nn.Module, config: Any) -> None:
    """Refuse, with one line, what PEFT would accept and appo could not use:
    - a name in a target list that matches no module (PEFT adapts the others silently);
    - the output layer, or a layer sharing its weight (tied embeddings): the trainer's
      log-probs read the head as a weight matrix (`appo.algos.logprobs`), so an adapter
      there gets no gradient, and a merged tied copy would differ from the policy;
    - a rank above a targeted layer's min(in, out): the product `B A` cannot have a higher
      rank, so the extra rows are parameters (and memory) with no effect."""
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = config.target_modules
    names = [n for n, _ in model.named_modules() if n]
    if isinstance(targets, str) and targets == "all-linear":  # PEFT's shorthand
        matched = [n for n in names if isinstance(model.get_submodule(n), torch.nn.Linear)
                   and model.get_submodule(n) is not model.get_output_embeddings()]
    else:
        matched = [n for n in names if check_target_module_exists(config, n)]
    if not isinstance(targets, str):
        for key in targets:
            if not any(n == key or n.endswith("." + key) for n in matched):
                raise AppoError(f"model.target_modules: {key!r} matches no module of the model "
                                f"(its layers: {', '.join(_layer_names(model))})")
    if not matched:
        raise AppoError(f"model.target_modules: {targets!r} matches no module of the model "
                        f"(its layers: {', '.join(_layer_names(model))})")
    head = model.get_output_embeddings()
    head_weight = getattr(head, "weight", None)
    for name in matched:
        weight = getattr(model.get_submodule(name), "weight", None)
        if weight is not None and head_weight is not None and weight is head_weight:
            raise AppoError(f"model.target_modules: {name} is (or shares its weight with) the "
                            "output layer, which the trainer reads as a plain weight matrix, so "
                            "an adapter there cannot train; target the other layers "
                            "(all-linear leaves it out)")
    rank = int(config.r)
    for name in matched:
        weight = getattr(model.get_submodule(name), "weight", None)
        if weight is not None and weight.dim() == 2 and rank > min(weight.shape):
            rows, cols = weight.shape
            raise AppoError(f"model.lora_rank={rank} is larger than the layer {name} "
                            f"({rows} x {cols}) can use: the adapter's rank is at most "
                            f"min(in, out) = {min(weight.shape)}; set model.lora_rank <= "
                            f"{min(weight.shape)}")


# The adapter directories being loaded in this context, outermost first: an adapter whose
# base chain comes back to itself is refused by name instead of recursing without end.
_LOADING: contextvars.ContextVar[tuple[Path, ...]] = contextvars.ContextVar(
    "appo_lora_loading", default=())


def load_merged(path: Path, load_base: Any) -> tuple[Any, Any]:
    """An appo LoRA checkpoint directory (`adapter_config.json`, no `config.json`) as a
    plain model: its base (`load_base(spec)`, a `LoadedModel`) with the adapter merged in.
    Returns (model, tokenizer); every parameter requires grad again (PEFT's loading froze
    them all), so the merged model trains in full as any loaded model does."""
    import json

    from peft import PeftModel

    config_file = path / "adapter_config.json"
    try:
        spec = json.loads(config_file.read_text())["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise AppoError(f"unreadable {config_file}: {e}") from None
    if not spec:
        raise AppoError(f"{config_file} names no base model (base_model_name_or_path)")
    chain = _LOADING.get()
    here = path.resolve()
    base_path = Path(str(spec)).expanduser()
    if here in chain or (base_path.exists() and base_path.resolve() in (*chain, here)):
        loop = " -> ".join(str(p) for p in (*chain, here, base_path.resolve()))
        raise AppoError(f"{config_file} names a base model that leads back to the adapter "
                        f"itself ({loop}); set base_model_name_or_path to the model it "
                        "was trained on")
    token = _LOADING.set((*chain, here))
    try:
        base = load_base(str(spec))
    except AppoError as e:
        raise AppoError(f"the base model {spec!r} named by {config_file}: {e}") from None
    finally:
        _LOADING.reset(token)
    try:
        with _quiet_peft():
            model = PeftModel.from_pretrained(base.model, str(path)).merge_and_unload()
    except Exception as e:  # noqa: BLE001 - PEFT raises many types for a mismatched adapter
        raise AppoError(f"cannot apply the adapter in {path} to {spec}: "
                        f"{type(e).__name__}: {e}") from None
    model.requires_grad_(True)
    tokenizer = base.tokenizer
    if (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model, tokenizer
