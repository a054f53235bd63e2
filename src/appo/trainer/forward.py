"""The training forward: final hidden states of a batch of rows, computing a shared prefix once.

RL groups repeat one prompt `n` times (and SFT rows repeat one system prompt), so most of a
micro-batch's tokens are a prefix every row has in common. Here that prefix runs through
the model once, with gradients, as a single row; its keys/values are expanded (a view, no
copy) to every row and the rows' own suffixes attend to them. The result is exactly the
full forward of every row - same hidden states, same gradients (the prefix's gradient is
the sum over rows, which `expand` gives by construction) - at the cost of
`prefix + sum(suffixes)` tokens instead of `rows * (prefix + suffix)`.

Works with any decoder whose attention layers call `cache.update(...)` and accept a
4D additive mask with explicit position ids (all transformers decoders do). With gradient
checkpointing on, or when the shared prefix is short, the plain padded forward is used.
"""

from __future__ import annotations

import torch
from torch import Tensor

from appo.models.compat import cache_argument
from appo.prefix import common_prefix_length
from appo.trainer.batching import MicroBatchPlan, pad_right

MIN_SHARED_PREFIX = 16  # below this the second forward costs more than it saves


def shared_prefix_length(rows: list[list[int]], share_prefix: bool = True) -> int:
    """Tokens `final_hidden_states` computes once for all `rows` (0: the plain forward).

    Every row keeps at least one token of its own, so the suffix batch is never empty.
    """
    if not share_prefix or len(rows) < 2:
        return 0
    shared = common_prefix_length(rows, min(len(r) for r in rows) - 1)
    return shared if shared >= MIN_SHARED_PREFIX else 0


class _PrefixCache:
    """Duck-typed cache: stores the prefix's keys/values per layer on the first forward and
    returns `cat(prefix, new)` (differentiable) on the second."""

    def __init__(self):
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.length = 0
        self.storing = True

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *_: object, **__: object):
        if self.storing:
            self.keys[layer_idx], self.values[layer_idx] = key, value
            return key, value
        return (torch.cat([self.keys[layer_idx], key], dim=2),
                torch.cat([self.values[layer_idx], value], dim=2))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def expand(self, rows: int) -> None:
        for store in (self.keys, self.values):
            for layer, t in store.items():
                store[layer] = t.expand(rows, *t.shape[1:])
        self.storing = False


def _additive_causal_mask(rows: int, past: int, steps: int, dtype, device) -> Tensor:
    """`[rows, 1, steps, past + steps]`: every query sees the whole prefix and the suffix up to
    itself. Suffixes are right-padded, so real queries never see padding columns."""
    cols = torch.arange(past + steps, device=device)
    qcol = past + torch.arange(steps, device=device)
    mask = torch.zeros(steps, past + steps, dtype=dtype, device=device)
    mask.masked_fill_(cols[None, :] > qcol[:, None], torch.finfo(dtype).min)
    return mask[None, None].expand(rows, 1, steps, past + steps)


def final_hidden_states(model, rows: list[list[int]], pad_id: int,
                        share_prefix: bool = True) -> Tensor:
    """Hidden states after the final norm, `[B, T, D]` for `B = len(rows)` right-padded rows
    (`T` = longest row; padding positions hold unspecified values). The LM head is not
    applied: callers compute log-probs from these in chunks."""
    device = next(model.parameters()).device
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:  # transformers < 5
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    shared = 0 if checkpointing else shared_prefix_length(rows, share_prefix)
    if shared == 0:
        ids = pad_right(rows, pad_id, torch.long).to(device)
        attn = pad_right([[1] * len(r) for r in rows], 0, torch.long).to(device)
        out = model(input_ids=ids, attention_mask=attn, output_hidden_states=True,
                    logits_to_keep=1)
        return out.hidden_states[-1]
    dtype = next(model.parameters()).dtype
    cache = _PrefixCache()
    prefix = torch.tensor(rows[0][:shared], dtype=torch.long, device=device)[None]
    out = model(input_ids=prefix, attention_mask=_additive_causal_mask(1, 0, shared, dtype, device),
                position_ids=torch.arange(shared, device=device)[None], use_cache=True,
                **cache_argument(model, cache), output_hidden_states=True, logits_to_keep=1)
    prefix_hidden = out.hidden_states[-1]  # [1, L, D]
    cache.expand(len(rows))
    cache.length = shared
    suffix = pad_right([r[shared:] for r in rows], pad_id, torch.long).to(device)
    steps = suffix.shape[1]
    out = model(input_ids=suffix,
                attention_mask=_additive_causal_mask(len(rows), shared, steps, dtype, device),
                position_ids=torch.arange(shared, shared + steps, device=device)[None].expand(
                    len(rows), -1),
                use_cache=True, output_hidden_states=True, logits_to_keep=1,
                **cache_argument(model, cache))
    suffix_hidden = out.hidden_states[-1]  # [B, S, D]
    return torch.cat([prefix_hidden.expand(len(rows), -1, -1), suffix_hidden], dim=1)


def _cost(n_rows: int, longest: int, shortest: int, lcp: int, share_prefix: bool) -> int:
    """`computed_tokens` of rows with these statistics (`lcp` = their common prefix)."""
    shared = min(lcp, shortest - 1)
    if not share_prefix or n_rows < 2 or shared < MIN_SHARED_PREFIX:
        shared = 0
    return shared + n_rows * (longest - shared)


def computed_tokens(rows: list[list[int]], share_prefix: bool = True) -> int:
    """Tokens `final_hidden_states` runs through the model for `rows` (padding included)."""
    if not rows:
        return 0
    shared = shared_prefix_length(rows, share_prefix)
    return shared + len(rows) * (max(len(r) for r in rows) - shared)


def plan_shared_microbatches(rows: list[list[int]], max_tokens: int,
                             groups: list[str] | None = None,
                             share_prefix: bool = True) -> MicroBatchPlan:
    """Micro-batches for `final_hidden_states` under a budget of computed tokens.

    Rows are ordered by group (first appearance; e.g. the prompt uid, so a group's rows
    share their whole prompt) and then by length, and packed greedily while the forward's
    cost (shared prefix once + padded suffixes) stays within `max_tokens`. A row over the
    budget gets a micro-batch of its own. `real_tokens` counts the distinct tokens computed
    (prefix once), `padded_tokens` what the forwards compute, so the plan's padding fraction
    is padding only; `rows_tokens` is the unshared total (the plain forward's real work).
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    keys = groups if groups is not None else [""] * len(rows)
    first = {g: i for i, g in reversed(list(enumerate(keys)))}
    order = sorted(range(len(rows)), key=lambda i: (first[keys[i]], len(rows[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = shortest = lcp = 0
    for i in order:
        row = rows[i]
        if current:
            new_lcp = common_prefix_length([rows[current[0]], row], lcp)
            cost = _cost(len(current) + 1, max(longest, len(row)), min(shortest, len(row)),
                         new_lcp, share_prefix)
            if cost <= max_tokens:
                current.append(i)
                longest, shortest, lcp = max(longest, len(row)), min(shortest, len(row)), new_lcp
                continue
            batches.append(current)
        current, longest, shortest, lcp = [i], len(row), len(row), len(row)
    if current:
        batches.append(current)
    padded = real = 0
    for b in batches:
        sub = [rows[i] for i in b]
        shared = shared_prefix_length(sub, share_prefix)
        real += sum(len(r) for r in sub) - (len(sub) - 1) * shared
        padded += shared + len(sub) * (max(len(r) for r in sub) - shared)
    return MicroBatchPlan(batches=batches, real_tokens=real, padded_tokens=padded,
                          rows_tokens=sum(len(r) for r in rows))
