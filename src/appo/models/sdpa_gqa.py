"""SDPA's own grouped-query attention on CPU, for a model's training forwards (`actor.sdpa_gqa`).

transformers' `sdpa` attention expands the keys/values of a grouped-query model to every
query head (`repeat_kv`) whenever an attention mask is given, because on CUDA masked GQA
falls back to SDPA's math kernel. The training forwards always pass a mask (padding, the
shared-prefix and tree forwards' 4D masks), so on CPU every layer materialises the expanded
keys/values, and autograd keeps them for the backward. torch's CPU kernel takes the grouped
heads as they are (`enable_gqa=True`): the same attention with no expansion.

transformers switches this on only through a process-wide environment variable
(`TRANSFORMERS_SDPA_FORCE_GQA=1`, read at every call), which would also change every other
model in the process. Here it is a per-model attention implementation instead, registered
under `GQA_SDPA` with transformers' `AttentionInterface` (and the `sdpa` mask builder) and
selected with `model.set_attn_implementation`: only that model (and copies of it, such as
the reference model) uses it. Calls it does not cover (no mask, no key/value groups, a
position bias, a device other than the CPU) go to transformers' own `sdpa` function.
"""

from __future__ import annotations

import torch.nn.functional as F

GQA_SDPA = "appo_sdpa_gqa"


def _sdpa_gqa_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' attention-function signature: `query` `[B, H, Q, d]`, `key`/`value`
    `[B, KV, K, d]`, additive or boolean `attention_mask` `[B, 1, Q, K]`; returns
    `([B, Q, H, d], None)`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or attention_mask is None or query.device.type != "cpu"
            or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    # With a mask transformers' own path is not causal either (the mask carries causality).
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if GQA_SDPA not in AttentionInterface._global_mapping:  # register is class-wide
        AttentionInterface.register(GQA_SDPA, _sdpa_gqa_forward)
        AttentionMaskInterface.register(GQA_SDPA, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def use_sdpa_gqa(model) -> bool:
    """Switch `model` from transformers' `sdpa` attention to `GQA_SDPA` when it runs on the
    CPU and has grouped key/value heads; returns whether it did. The same attention values
    bitwise; gradients to rounding (SDPA sums a group's key/value gradients in its own
    order; tests/trainer/test_trainer_memory.py)."""
    config = getattr(model, "config", None)
    if (config is None or getattr(config, "_attn_implementation", None) != "sdpa"
            or next(model.parameters()).device.type != "cpu"
            or not any(getattr(m, "num_key_value_groups", 1) > 1 for m in model.modules())):
        return False
    _register()
    model.set_attn_implementation(GQA_SDPA)
    return True
