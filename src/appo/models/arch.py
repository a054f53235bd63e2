"""Model architectures without weights: a spec's `config.json`, for planning memory offline.

appo ships the `config.json` of the architectures its published configs train
(`appo/models/architectures/<name>/config.json`, written from the published model cards:
sizes, heads, vocabulary, tied embeddings, positions, rope), so `appo plan` needs neither
the weights nor the hub. A spec resolves, in order:

- `arch` given (`appo plan --arch`): a shipped name, or a `config.json` / a directory
  holding one;
- the `tiny-test` alias (its config is built in code) and `smollm2-135m` (shipped);
- a local directory with a `config.json` (a checkpoint, an SFT output);
- a shipped name found in the spec (`/path/to/Qwen2.5-7B-Instruct-sft` -> `qwen2.5-7b`,
  compared without case or punctuation; the longest name wins);
- a hub id already in the local Hugging Face cache (never downloaded).

Base and instruct models of one family share an architecture (the instruct
`config.json`s differ only in token ids and, for Qwen2.5, `max_position_embeddings`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from appo.errors import AppoError

ARCH_DIR = Path(__file__).resolve().parent / "architectures"


def shipped_architectures() -> list[str]:
    """Names of the shipped architectures (`appo/models/architectures/<name>`)."""
    return sorted(p.parent.name for p in ARCH_DIR.glob("*/config.json"))


def _squash(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def match_architecture(spec: str) -> str | None:
    """The shipped architecture whose name appears in `spec` (case and punctuation ignored),
    the longest such name; None when none does."""
    squashed = _squash(spec)
    found = [n for n in shipped_architectures() if _squash(n) in squashed]
    return max(found, key=lambda n: len(_squash(n))) if found else None


def _from_file(path: Path, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    target = path.parent if path.is_file() else path
    if not (target / "config.json").is_file():
        raise AppoError(f"{path}: no config.json there")
    try:
        return AutoConfig.from_pretrained(str(target), local_files_only=True,
                                          trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any unreadable config is the user's file
        raise AppoError(f"cannot read {target / 'config.json'}: {type(e).__name__}: {e}") from None


def tiny_test_config() -> Any:
    """The `tiny-test` model's config (`appo.models.tiny`), its vocabulary included."""
    from appo.models.tiny import build_tiny_tokenizer, tiny_config

    tok = build_tiny_tokenizer()
    return tiny_config(len(tok))


def resolve_architecture(spec: str, arch: str | None = None,
                         trust_remote_code: bool = False) -> tuple[str, Any]:
    """(where the architecture came from, a transformers `PretrainedConfig`) for a model
    spec (`model.path`) or an explicit `arch`. Raises AppoError naming `--arch` when nothing
    matches."""
    names = shipped_architectures()
    if arch:
        if arch in names:
            return f"shipped {arch}", _from_file(ARCH_DIR / arch, trust_remote_code)
        path = Path(arch).expanduser()
        if path.exists():
            return str(path), _from_file(path, trust_remote_code)
        raise AppoError(f"--arch {arch!r}: not a shipped architecture ({', '.join(names)}) "
                        "nor a config.json / model directory")
    if spec == "tiny-test":
        return "tiny-test (built in code)", tiny_test_config()
    if spec == "smollm2-135m":
        return "shipped smollm2-135m", _from_file(ARCH_DIR / "smollm2-135m")
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return str(path), _from_file(path, trust_remote_code)
    name = match_architecture(spec)
    if name is not None:
        return f"shipped {name} (matched from {spec})", _from_file(ARCH_DIR / name)
    parts = spec.split("/")
    if len(parts) == 2 and all(parts) and not path.exists():
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(spec, local_files_only=True,
                                                trust_remote_code=trust_remote_code)
            return f"{spec} (local Hugging Face cache)", config
        except Exception:  # noqa: BLE001 - not cached: the message below says what to do
            pass
    raise AppoError(f"no architecture for model {spec!r}: give --arch with one of "
                    f"{', '.join(names)} or a config.json / model directory")
