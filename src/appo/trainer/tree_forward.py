"""The tree-shared training forward: every token of a micro-batch's token trie computed once.

ARPO/AEPO branches repeat their parent's response up to the branch point, and every row of
a group repeats its prompt, so a micro-batch's rows form a trie of shared prefixes. The
trie is found from the token ids themselves (longest common prefixes between rows), so it
needs no strategy bookkeeping and covers prompts, branches and identical rows alike.

Layout: rows are taken in order; a row's *parent* is the earlier row it shares the longest
prefix with (at least `min_shared` tokens), and the row's *own* tokens are those past that
prefix (none when it is a prefix of an earlier row). A row's own tokens are computed in
model call `level = 1 + level of the deepest call its shared prefix lives in`; one call
per level, its rows' own segments right-padded to the longest (two calls, long and short
segments, when that saves more padding than a call costs). Keys/values of every
computed token are kept per layer (`_TreeCache`); a segment attends to its ancestors' keys
(gathered by their flat index, with gradients) and causally to its own, with explicit
position ids = depth in its row. Hidden states are then gathered back to `[B, T, D]`.

Values and gradients equal the plain padded forward (a token's hidden state depends on its
prefix only); the cost is the trie's tokens plus the padding within each call, and
attention over each row's own ancestors only (no dense packed `P x P` mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from appo.models.compat import cache_argument

# A model call's fixed cost (python, kernel launches over every layer) in tokens' worth of
# compute: a level is split in two calls only when that saves more padding than this.
CALL_TOKENS = 64


def _split(widths: list[int]) -> int:
    """How many of the `widths` (sorted descending) go in the first call: `len(widths)` for
    one call, `k` for two (the `k` longest, then the rest)."""
    n = len(widths)
    best, split = n * widths[0], n
    for k in range(1, n):
        cost = k * widths[0] + (n - k) * widths[k] + CALL_TOKENS
        if cost < best:
            best, split = cost, k
    return split


def _level_cost(widths: list[int]) -> int:
    """Tokens the calls of one level compute, own segments of `widths` (any order)."""
    if not widths:
        return 0
    w = sorted(widths, reverse=True)
    k = _split(w)
    return k * w[0] + (len(w) - k) * w[k] if k < len(w) else len(w) * w[0]


@dataclass
class TreeLevel:
    """One model call: the own segments of `rows`."""

    rows: list[int] = field(default_factory=list)
    width: int = 0  # longest own segment
    offset: int = 0  # flat index of the call's first (padded) token


@dataclass
class TreeLayout:
    """Where each row's tokens are computed.

    starts:      `[B]` first own token of each row (tokens before it are an ancestor's)
    levels:      the model calls, in order (a trie level is one or two calls)
    token_index: `[B, T]` flat index of each row position's token among all calls' padded
                 outputs (0 past a row's length)
    """

    starts: Tensor
    levels: list[TreeLevel]
    token_index: Tensor

    @property
    def computed_tokens(self) -> int:
        """Tokens the calls run through the model (padding included)."""
        return sum(len(lv.rows) * lv.width for lv in self.levels)


class TreeBuilder:
    """Adds rows one at a time (the order the forward computes them) and keeps the layout's
    cost, so the micro-batch planner can price a candidate row cheaply."""

    def __init__(self, min_shared: int):
        self.min_shared = min_shared
        self.rows: list[Tensor] = []
        self.lengths: list[int] = []
        self.parent: list[int] = []
        self.start: list[int] = []
        self.level: list[int] = []  # call of the row's own tokens, -1 without any
        self.depth: list[int] = []  # deepest call any of the row's tokens lives in
        self.widths: list[list[int]] = []  # own segment lengths per level

    def _place(self, row: Tensor, length: int) -> tuple[int, int, int]:
        """(parent, start, level) of a new row `row` `[T]` of `length`."""
        if not self.rows or self.min_shared > length:
            return -1, 0, 0
        width = min(length, max(self.lengths))
        prev = torch.stack([r[:width] if len(r) >= width else
                            torch.nn.functional.pad(r, (0, width - len(r)), value=-1)
                            for r in self.rows])
        run = (prev == row[:width]).to(torch.int64).cumprod(1).sum(1)
        run = torch.minimum(run, torch.tensor(self.lengths))
        best = int(run.argmax())
        shared = int(run[best])
        if shared < self.min_shared:
            return -1, 0, 0
        return best, shared, (self.depth[best] + 1 if shared < length else -1)

    @property
    def own_tokens(self) -> int:
        """Distinct tokens of the rows added (the trie's size)."""
        return sum(n - s for n, s in zip(self.lengths, self.start, strict=True))

    def cost_with(self, row: Tensor, length: int) -> int:
        """`computed_tokens` after adding this row."""
        _, start, level = self._place(row, length)
        total = sum(_level_cost(w) for w in self.widths)
        if level < 0:
            return total
        if level == len(self.widths):
            return total + (length - start)
        return (total - _level_cost(self.widths[level])
                + _level_cost(self.widths[level] + [length - start]))

    def add(self, row: Tensor, length: int) -> None:
        parent, start, level = self._place(row, length)
        self.rows.append(row[:length])
        self.lengths.append(length)
        self.parent.append(parent)
        self.start.append(start)
        self.level.append(level)
        self.depth.append(level if level >= 0 else self.depth[parent])
        if level >= 0:
            if level == len(self.widths):
                self.widths.append([])
            self.widths[level].append(length - start)

    def layout(self) -> TreeLayout:
        own = [n - s for n, s in zip(self.lengths, self.start, strict=True)]
        levels: list[TreeLevel] = []
        call = [-1] * len(self.rows)  # index into `levels` of each row's own segment
        for depth in range(len(self.widths)):
            rows = sorted((i for i, lv in enumerate(self.level) if lv == depth),
                          key=lambda i: (-own[i], i))
            k = _split([own[i] for i in rows])
            for part in (rows[:k], rows[k:]):
                if part:
                    for i in part:
                        call[i] = len(levels)
                    levels.append(TreeLevel(rows=part, width=own[part[0]]))
        offset = 0
        for lv in levels:
            lv.offset = offset
            offset += len(lv.rows) * lv.width
        slot = [levels[c].rows.index(i) if c >= 0 else -1 for i, c in enumerate(call)]
        width = max(self.lengths, default=0)
        index = torch.zeros(len(self.rows), width, dtype=torch.long)
        for i, n in enumerate(self.lengths):
            s = self.start[i]
            if s:
                index[i, :s] = index[self.parent[i], :s]
            if call[i] >= 0:
                lv = levels[call[i]]
                index[i, s:n] = lv.offset + slot[i] * lv.width + torch.arange(n - s)
        return TreeLayout(starts=torch.tensor(self.start, dtype=torch.long), levels=levels,
                          token_index=index)


def tree_layout(ids: Tensor, lengths: Tensor, min_shared: int) -> TreeLayout:
    """The layout of right-padded rows `ids` `[B, T]` of `lengths` `[B]`, in row order."""
    builder = TreeBuilder(min_shared)
    for row, n in zip(ids, lengths.tolist(), strict=True):
        builder.add(row, n)
    return builder.layout()


class _TreeCache:
    """Duck-typed cache: per layer, the keys/values of every token computed so far, flat
    `[N, H, d]` in the calls' padded order. A call's segments get `cat(gathered ancestors,
    own)` (differentiable); its own keys/values are appended for the next calls."""

    def __init__(self):
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}
        self.ancestors: Tensor | None = None  # [n, A] flat indices (0 on padding)

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *_: object, **__: object):
        n, heads, steps, dim = key.shape
        out = []
        for store, new in ((self.keys, key), (self.values, value)):
            old = store.get(layer_idx)
            full = new
            if self.ancestors is not None and self.ancestors.shape[1]:
                full = torch.cat([old[self.ancestors].transpose(1, 2), new], dim=2)
            flat = new.transpose(1, 2).reshape(n * steps, heads, dim)
            store[layer_idx] = flat if old is None else torch.cat([old, flat])
            out.append(full)
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.ancestors is None else self.ancestors.shape[1]


def _level_mask(anc_lens: Tensor, past: int, steps: int, dtype, device) -> Tensor:
    """`[n, 1, steps, past + steps]`: a segment's query sees its own ancestors' columns and
    its segment causally. Real queries never see padding (ancestor or own)."""
    neg = torch.finfo(dtype).min
    cols = torch.arange(past, device=device)
    anc = torch.zeros(len(anc_lens), steps, past, dtype=dtype, device=device)
    anc.masked_fill_((cols[None, :] >= anc_lens[:, None].to(device))[:, None, :], neg)
    own = torch.zeros(steps, steps, dtype=dtype, device=device)
    own.masked_fill_(torch.ones(steps, steps, dtype=torch.bool, device=device).triu(1), neg)
    own = own[None].expand(len(anc_lens), -1, -1)
    return torch.cat([anc, own], dim=2)[:, None]


def tree_hidden_states(model, ids: Tensor, lengths: Tensor, layout: TreeLayout) -> Tensor:
    """Final hidden states `[B, T', D]` (`T' = max(lengths)`) of rows `ids` `[B, T]`, each
    trie token computed once (`layout` from `tree_layout` on the same rows)."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    width = int(lengths.max())
    ids = ids[:, :width].to(device)
    index = layout.token_index.to(device)
    cache = _TreeCache()
    hidden: list[Tensor] = []
    for lv in layout.levels:
        rows = torch.tensor(lv.rows, dtype=torch.long, device=device)
        starts = layout.starts[lv.rows]
        steps = lv.width
        cols = starts.to(device)[:, None] + torch.arange(steps, device=device)[None]
        seg = ids[rows[:, None], cols.clamp(max=width - 1)]  # padding: any token
        past = int(starts.max())
        anc_cols = torch.arange(past, device=device)
        cache.ancestors = index[rows[:, None], anc_cols[None].expand(len(rows), -1)] * (
            anc_cols[None] < starts.to(device)[:, None])
        mask = _level_mask(starts, past, steps, dtype, device)
        out = model(input_ids=seg, attention_mask=mask, position_ids=cols.clamp(max=width - 1),
                    use_cache=True, output_hidden_states=True, logits_to_keep=1,
                    **cache_argument(model, cache))
        h = out.hidden_states[-1]
        hidden.append(h.reshape(-1, h.shape[-1]))
    return torch.cat(hidden)[index]
