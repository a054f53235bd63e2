"""Small shims over transformers API differences between the versions appo supports.

transformers 5.24 renamed the decoder's `past_key_values=` argument to `cache=` (the old
name warns until 5.40) and calls `cache.update(key, value, layer_idx, kwargs=...)` instead
of passing `cache_kwargs` positionally. appo hands its own duck-typed caches to the model
(the engine's KV buffer, the trainer's shared-prefix cache), so it names the argument the
way the installed model expects and its caches accept both `update` conventions.
"""

from __future__ import annotations

import inspect
from typing import Any

_ARG_BY_CLASS: dict[type, str] = {}


def cache_argument(model, cache: Any) -> dict[str, Any]:
    """`{name: cache}` for `model(...)`: `cache` where the forward takes it, else
    `past_key_values`. Looked up once per model class; DDP/FSDP and `torch.compile`
    wrappers (whose forward takes `*args, **kwargs`) are looked through."""
    inner = model
    for attr in ("module", "_orig_mod"):
        inner = getattr(inner, attr, inner)
    cls = type(inner)
    name = _ARG_BY_CLASS.get(cls)
    if name is None:
        params = inspect.signature(inner.forward).parameters
        name = "cache" if "cache" in params else "past_key_values"
        _ARG_BY_CLASS[cls] = name
    return {name: cache}
