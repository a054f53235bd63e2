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

`tree=True` (`actor.tree_forward`) generalises the one prefix to the rows' whole token trie
(branches sharing their parent's response up to the branch point): `appo.trainer.tree_forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from appo.models.compat import cache_argument
from appo.trainer.tree_forward import TreeBuilder, tree_hidden_states, tree_layout

MIN_SHARED_PREFIX = 16  # below this the second forward costs more than it saves


@dataclass
class MicroBatchPlan:
    batches: list[list[int]]  # row indices per micro-batch
    real_tokens: int
    padded_tokens: int
    rows_tokens: int = 0  # sum of row lengths; differs from real_tokens with a shared prefix

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0


def _leading_run(same: Tensor) -> int:
    """Length of the leading run of True in a 1-D bool tensor."""
    return int(same.to(torch.int64).cumprod(0).sum()) if same.numel() else 0


def shared_prefix_length(ids: Tensor, lengths: Tensor, share_prefix: bool = True) -> int:
    """Tokens `final_hidden_states` computes once for all rows of `ids` `[B, T]` (0: the plain
    forward). Every row keeps at least one token of its own, so the suffix batch is never
    empty."""
    if not share_prefix or len(ids) < 2:
        return 0
    limit = int(lengths.min()) - 1
    shared = _leading_run((ids[:, :limit] == ids[:1, :limit]).all(dim=0))
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


def final_hidden_states(model, ids: Tensor, lengths: Tensor, share_prefix: bool = True,
                        tree: bool = False) -> Tensor:
    """Hidden states after the final norm, `[B, T]` right-padded rows `ids` of `lengths`
    `[B]` -> `[B, T', D]` with `T' = max(lengths)` (padding positions hold unspecified
    values). The LM head is not applied: callers compute log-probs from these in chunks.
    `tree` (with `share_prefix`): every shared prefix between rows computed once."""
    device = next(model.parameters()).device
    width = int(lengths.max())
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:  # transformers < 5
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if tree and share_prefix and not checkpointing and len(ids) > 1:
        layout = tree_layout(ids[:, :width], lengths, MIN_SHARED_PREFIX)
        if len(layout.levels) > 1:
            return tree_hidden_states(model, ids, lengths, layout)
        share_prefix = False  # nothing shared: the plain forward is the same call
    ids = ids[:, :width].to(device)
    shared = 0 if checkpointing else shared_prefix_length(ids, lengths, share_prefix)
    if shared == 0:
        attn = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.long).to(device)
        out = model(input_ids=ids, attention_mask=attn, output_hidden_states=True,
                    logits_to_keep=1)
        return out.hidden_states[-1]
    rows = len(ids)
    dtype = next(model.parameters()).dtype
    cache = _PrefixCache()
    out = model(input_ids=ids[:1, :shared],
                attention_mask=_additive_causal_mask(1, 0, shared, dtype, device),
                position_ids=torch.arange(shared, device=device)[None], use_cache=True,
                **cache_argument(model, cache), output_hidden_states=True, logits_to_keep=1)
    prefix_hidden = out.hidden_states[-1]  # [1, L, D]
    cache.expand(rows)
    cache.length = shared
    suffix = ids[:, shared:]  # right padding comes along; real queries never attend to it
    steps = suffix.shape[1]
    out = model(input_ids=suffix,
                attention_mask=_additive_causal_mask(rows, shared, steps, dtype, device),
                position_ids=torch.arange(shared, shared + steps, device=device)[None].expand(
                    rows, -1),
                use_cache=True, output_hidden_states=True, logits_to_keep=1,
                **cache_argument(model, cache))
    suffix_hidden = out.hidden_states[-1]  # [B, S, D]
    return torch.cat([prefix_hidden.expand(rows, -1, -1), suffix_hidden], dim=1)


def _cost(n_rows: int, longest: int, shortest: int, lcp: int, share_prefix: bool) -> int:
    """`computed_tokens` of rows with these statistics (`lcp` = their common prefix)."""
    shared = min(lcp, shortest - 1)
    if not share_prefix or n_rows < 2 or shared < MIN_SHARED_PREFIX:
        shared = 0
    return shared + n_rows * (longest - shared)


def computed_tokens(ids: Tensor, lengths: Tensor, share_prefix: bool = True,
                    tree: bool = False) -> int:
    """Tokens `final_hidden_states` runs through the model for these rows (padding included)."""
    if len(ids) == 0:
        return 0
    if tree and share_prefix and len(ids) > 1:
        layout = tree_layout(ids, lengths, MIN_SHARED_PREFIX)
        if len(layout.levels) > 1:
            return layout.computed_tokens
        return len(ids) * int(lengths.max())
    shared = shared_prefix_length(ids, lengths, share_prefix)
    return shared + len(ids) * (int(lengths.max()) - shared)


def _pair_prefix(a: Tensor, b: Tensor, limit: int) -> int:
    """Common prefix length of two 1-D token tensors, at most `limit`."""
    n = min(limit, len(a), len(b))
    return _leading_run(a[:n] == b[:n])


def plan_shared_microbatches(ids: Tensor, lengths: Tensor, max_tokens: int,
                             groups: list[str] | None = None,
                             share_prefix: bool = True, tree: bool = False) -> MicroBatchPlan:
    """Micro-batches for `final_hidden_states` under a budget of computed tokens.

    `ids` `[B, T]` right-padded rows of `lengths` `[B]`. Rows are ordered by group (first
    appearance; e.g. the prompt uid, so a group's rows share their whole prompt and, with
    branching, its tree) and then by length, and packed greedily while the forward's cost
    (shared prefix once + padded suffixes; with `tree`, the trie's padded calls) stays
    within `max_tokens`. A row over the budget gets a micro-batch of its own.
    `real_tokens` counts the distinct tokens computed (shared tokens once), `padded_tokens`
    what the forwards compute, so the plan's padding fraction is padding only;
    `rows_tokens` is the unshared total (the plain forward's real work).
    """
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    lens = lengths.tolist()
    keys = groups if groups is not None else [""] * len(lens)
    first = {g: i for i, g in reversed(list(enumerate(keys)))}
    order = sorted(range(len(lens)), key=lambda i: (first[keys[i]], lens[i], i))
    if tree and share_prefix:
        return _plan_tree(ids, lens, order, max_tokens)
    batches: list[list[int]] = []
    current: list[int] = []
    longest = shortest = lcp = 0
    for i in order:
        n = lens[i]
        if current:
            new_lcp = _pair_prefix(ids[current[0]], ids[i], min(lcp, n))
            cost = _cost(len(current) + 1, max(longest, n), min(shortest, n), new_lcp,
                         share_prefix)
            if cost <= max_tokens:
                current.append(i)
                longest, shortest, lcp = max(longest, n), min(shortest, n), new_lcp
                continue
            batches.append(current)
        current, longest, shortest, lcp = [i], n, n, n
    if current:
        batches.append(current)
    padded = real = 0
    for b in batches:
        index = torch.tensor(b, dtype=torch.long)
        sub_lens = lengths[index]
        shared = shared_prefix_length(ids[index], sub_lens, share_prefix)
        real += int(sub_lens.sum()) - (len(b) - 1) * shared
        padded += shared + len(b) * (int(sub_lens.max()) - shared)
    return MicroBatchPlan(batches=batches, real_tokens=real, padded_tokens=padded,
                          rows_tokens=sum(lens))


def _plan_tree(ids: Tensor, lens: list[int], order: list[int], max_tokens: int,
               ) -> MicroBatchPlan:
    """`plan_shared_microbatches` for the tree forward: rows in `order`, each added to the
    current micro-batch while its trie layout's cost stays within `max_tokens`."""
    batches: list[list[int]] = []
    builders: list[TreeBuilder] = []
    for i in order:
        if batches and builders[-1].cost_with(ids[i], lens[i]) <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
            builders.append(TreeBuilder(MIN_SHARED_PREFIX))
        builders[-1].add(ids[i], lens[i])
    padded = real = 0
    for b, builder in zip(batches, builders, strict=True):
        layout = builder.layout()
        if len(b) > 1 and len(layout.levels) > 1:
            padded += layout.computed_tokens
            real += builder.own_tokens
        else:  # the plain forward runs (see final_hidden_states)
            padded += len(b) * max(lens[i] for i in b)
            real += sum(lens[i] for i in b)
    return MicroBatchPlan(batches=batches, real_tokens=real, padded_tokens=padded,
                          rows_tokens=sum(lens))
