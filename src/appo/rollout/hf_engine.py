"""`hf` engine: batched sampling on a transformers causal LM with a row-managed KV cache.

Where the speed comes from:
- Each row owns an immutable key/value block (`hf_batch.KVBlock`) covering all its tokens
  but the last ("pending") ones. Forks share the block, so a branch starts from its parent's
  cache and the shared prefix is never recomputed; tool results are prefilled onto the
  existing cache. Rows that decoded together keep the prefix they all share (a system
  prompt) as one parent block and copies of their own tokens only.
- A `decode` call first prefills every row's pending tokens, deduplicated: rows with the same
  cache block and the same pending tokens (a prompt group, a parent and its branches after
  a tool result) are computed once and then sample independently.
- The batch cache is one preallocated buffer `[layers, 2, rows, kv_heads, capacity, head_dim]`
  (no per-step `torch.cat` of the whole cache as transformers' `DynamicCache` does), rows
  are right-aligned (each row's tokens end at the same column: left padding is a masked
  hole), and positions are explicit per row, so rows of any length share one forward.
- Rows that stop leave the batch (compaction) instead of decoding padding until the
  longest row ends; logits are computed for the last position only.
- Decode attention over a prefix all rows share (a group's prompt, a common system
  prompt; at least `MIN_CASCADE_PREFIX` tokens) reads its keys/values once for all rows
  instead of once per row (lean forward, `cascade_attention=True`); one softmax spans the
  shared and the row's own columns, so the result is the same attention.
- CPU decode steps run their matmuls by a fixed rule on the row count and the CPU
  (`appo.rollout.cpu.matmuls`: MKL, or the numba kernels of `appo.rollout.cpu.kernels`,
  which beat MKL's small-M float32 GEMM on these CPUs; `cpu_kernel=None` uses them when
  numba is installed). With numba, the rest of such a step (rotary, cache write, attention,
  norms) runs in numba kernels too (`appo.rollout.cpu.fused`), with no mask tensor.
- CPU float32 logits are sampled by one numba kernel call per decode step
  (`appo.rollout.cpu.sampling`: the same distribution, uniforms and recorded values as
  `appo.rollout.sampling.sample`, in two passes over each row's vocabulary instead of dozens
  of torch op calls); `cpu_sampling=None` uses it when numba is installed, unless the
  environment sets `APPO_CPU_SAMPLING=0`; `False` keeps the torch sampling.

The attention mask is built here as a 4D additive mask (transformers returns a 4D mask
unchanged). Every query, including padding queries, sees at least its own column, so no
softmax row is empty: an all-masked row gives NaN under SDPA, which would poison the cache
through later layers' keys/values. Padding columns inside a row's range are never written
(masked write), so a row's cache only ever holds keys/values of its own tokens.

The recorded log-prob/entropy are those of the sampling distribution (see `sampling`).
Rows live in a `RowTable` (`appo.rollout.rows`, shared with the other engines); the state of
one decode call (buffer, batch slots, cached lengths, active rows) is a
`hf_batch.DecodeBatch`.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch import Tensor

from appo.errors import AppoError
from appo.models.compat import cache_argument
from appo.prefix import common_prefix_length
from appo.rollout.cpu import kernels
from appo.rollout.cpu.lean import SUPPORTED_TYPES, LeanDecoder, SharedPrefix
from appo.rollout.cpu.matmuls import BF16_RULE
from appo.rollout.engine import SegmentOutput
from appo.rollout.hf_batch import BatchCache, DecodeBatch, HFRow, KVBlock, gather_rows
from appo.rollout.records import EngineCounters
from appo.rollout.rows import RowTable, TableRows
from appo.rollout.sampling import SamplingParams, sample
from appo.rollout.stops import StopChecker, eos_ids_of

MIN_SHARED_PREFIX = 16  # shorter common prefixes are not worth a separate forward
MIN_CASCADE_PREFIX = 64  # shorter shared prefixes are not worth a separate attention matmul


class _TransposedLinears:
    """Inside `with`, the model's `nn.Linear` layers compute `x @ W^T` from a contiguous copy
    of `W^T` (`[in, out]`), and are plain `nn.Linear` again outside.

    On an Intel CPU, float32 GEMM with a small batch of rows was ~1.2-2x faster in this
    layout than with the `[out, in]` weight `F.linear` passes to MKL (SmolLM2-135M decode
    step 168 -> 138 ms at 8 rows); on an AMD Zen 3 it is faster at 1-2 rows and ~10% slower
    at 4-8. It serves models outside the lean decoder's family only. The copies are
    refreshed whenever a weight changes (tensor version counter or storage), so optimizer
    steps between rollouts are picked up without a sync call. Only the engine's forwards see them: the trainer's forward and
    backward run the untouched modules. Costs one extra copy of the linear weights.
    """

    def __init__(self, model):
        self.layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
        self._copies: dict[int, tuple[int, int, Tensor]] = {}

    def _weight_t(self, layer: torch.nn.Linear) -> Tensor:
        w = layer.weight
        key = (w._version, w.data_ptr())
        cached = self._copies.get(id(layer))
        if cached is None or cached[:2] != key:
            cached = (*key, w.detach().t().contiguous())
            self._copies[id(layer)] = cached
        return cached[2]

    def drop(self) -> None:
        self._copies.clear()

    def __enter__(self):
        for layer in self.layers:
            wt = self._weight_t(layer)
            bias = layer.bias

            def forward(x, wt=wt, bias=bias):
                y = x @ wt
                return y if bias is None else y + bias

            layer.forward = forward
        return self

    def __exit__(self, *exc):
        for layer in self.layers:
            layer.__dict__.pop("forward", None)
        return False


class HFEngine(TableRows):
    """The `hf` engine (see module docstring). Works on CPU and CUDA."""

    name = "hf"

    def __init__(
        self,
        model,
        tokenizer,
        stop_strings: list[str] | None = None,
        seed: int = 0,
        reuse_cache: bool = True,
        capacity_chunk: int = 256,
        compact_fraction: float = 0.25,
        eos_ids: frozenset[int] | None = None,
        transpose_weights: bool | None = None,
        lean_forward: bool | None = None,
        cascade_attention: bool = True,
        cpu_kernel: bool | None = None,
        cpu_sampling: bool | None = None,
        cpu_weights: str = "float32",
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = text_config.num_hidden_layers
        self.kv_heads = getattr(text_config, "num_key_value_heads", None) or (
            text_config.num_attention_heads
        )
        self.head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        # eos_ids=frozenset() decodes to the budget (fixed-length benchmarks).
        self.eos_ids = eos_ids_of(tokenizer, model) if eos_ids is None else frozenset(eos_ids)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.reuse_cache = reuse_cache
        # The lean forward (Llama family) by default; otherwise the model's own forward,
        # with transposed linear weights on CPU (cuBLAS needs no layout trick).
        if lean_forward is None:
            lean_forward = LeanDecoder.supports(model)
        elif lean_forward and not LeanDecoder.supports(model):
            raise AppoError(f"lean_forward: {type(model).__name__} is not a supported "
                            f"Llama-family model ({', '.join(SUPPORTED_TYPES)})")
        if cpu_weights != "float32" and not lean_forward:
            raise AppoError(f"rollout.cpu_weights={cpu_weights}: needs the lean forward "
                            f"(a Llama-family model: {', '.join(SUPPORTED_TYPES)})")
        self._lean = LeanDecoder(model, cpu_kernel, cpu_weights) if lean_forward else None
        if transpose_weights is None:
            transpose_weights = self.device.type == "cpu" and self._lean is None
        self._linears = _TransposedLinears(model) if transpose_weights else None
        self.cascade_attention = cascade_attention
        self.capacity_chunk = capacity_chunk
        self.compact_fraction = compact_fraction
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._sample_numpy = self._cpu_sampler(cpu_sampling)
        self.counters = EngineCounters()
        self.rows: RowTable[HFRow] = RowTable(HFRow)
        self._stops = StopChecker(tokenizer, [], self.eos_ids)
        self.set_stop_strings(stop_strings or [])

    @property
    def matmul_dtype(self) -> torch.dtype:
        """The dtype the forward's matmuls read their weights in: bfloat16 under
        `rollout.cpu_weights=bfloat16`, else the model's (APPO's default noise tolerance
        follows it: `appo.rollout.scoring.noisiest`)."""
        lean = self._lean
        return torch.bfloat16 if lean is not None and lean.rule == BF16_RULE else self.dtype

    def _cpu_sampler(self, cpu_sampling: bool | None):
        """`appo.rollout.cpu.sampling.sample_numpy` where the decode loop samples with it
        (see module docstring), else None (the torch `sample`)."""
        if cpu_sampling is None:
            cpu_sampling = (self.device.type == "cpu" and kernels.available()
                            and os.environ.get("APPO_CPU_SAMPLING", "1") != "0")
        if not cpu_sampling:
            return None
        if self.device.type != "cpu" or not kernels.available():
            raise AppoError("cpu_sampling needs a CPU model and numba (appo[cpu-kernels])")
        from appo.rollout.cpu import team  # imports numba
        from appo.rollout.cpu.sampling import sample_numpy

        # The rows over the threads through the team (torch's OpenMP pool where it can).
        return functools.partial(sample_numpy, run=team.sample_runner)

    # ------------------------------------------------------------------ settings
    def set_stop_strings(self, stop_strings: list[str]) -> None:
        if tuple(stop_strings) != tuple(self._stops.stop_strings):
            self._stops = StopChecker(self.tokenizer, list(stop_strings), self.eos_ids)

    @property
    def stop_strings(self) -> list[str]:
        return list(self._stops.stop_strings)

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def drop_weight_copies(self) -> None:
        """Free the decode path's weight copies (packed or transposed; rebuilt on the next
        forward). The trainer calls this after each training rollout: the update changes every
        weight, so the copies would be rebuilt anyway, and the update runs without them."""
        if self._lean is not None:
            self._lean.drop()
        if self._linears is not None:
            self._linears.drop()

    # ------------------------------------------------------------------ forward helpers
    def _alloc(self, rows: int, capacity: int) -> Tensor:
        # Uninitialised on purpose: every column is written before it is read, except the
        # left padding, which `_prefill` zeroes (garbage there could be NaN, and a masked
        # NaN key still poisons `softmax @ V` as 0 * NaN).
        return torch.empty(
            (self.num_layers, 2, rows, self.kv_heads, capacity, self.head_dim),
            dtype=self.dtype,
            device=self.device,
        )

    def _mask(self, start: Tensor, length: int, steps: int) -> Tensor:
        """Additive mask `[rows, 1, steps, length + steps]`: query q (column length+q) of row r
        sees columns in [start_r, length+q], and always its own column."""
        cols = torch.arange(length + steps, device=self.device)
        qcol = length + torch.arange(steps, device=self.device)
        visible = (cols[None, None, :] >= start[:, None, None]) & (
            cols[None, None, :] <= qcol[None, :, None]
        )
        visible |= cols[None, None, :] == qcol[None, :, None]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        return mask[:, None]

    def _forward(self, cache: BatchCache, input_ids: Tensor, positions: Tensor,
                 start: Tensor, shared_kv: Tensor | None = None) -> Tensor:
        """`shared_kv` (`[layers, 2, kv_heads, P, head_dim]`, decode steps of the lean
        forward): the keys/values of the first P tokens every row shares, read once."""
        steps = input_ids.shape[1]
        fused = None if self._lean is None else self._lean.fused(input_ids)
        if fused is not None:  # no mask: the kernels read each row's columns from start
            logits = fused(input_ids, positions, cache, start, shared_kv)
            cache.length += steps
            return logits
        if self._lean is not None:
            if shared_kv is None:  # the whole-context mask, or only the rows' own columns
                mask, prefix = self._mask(start, cache.length, steps), None
            else:
                p_len = int(shared_kv.shape[3])
                lo = int(start.min()) + p_len
                suffix_mask = self._mask(start + p_len, cache.length, steps)[..., lo:]
                mask, prefix = None, SharedPrefix(shared_kv, lo, suffix_mask)
            logits = self._lean(input_ids, positions, mask, cache, prefix)
            cache.length += steps
            return logits
        with self._linears if self._linears is not None else contextlib.nullcontext():
            out = self.model(
                input_ids=input_ids,
                attention_mask=self._mask(start, cache.length, steps),
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **cache_argument(self.model, cache),
            )
        cache.length += steps
        return out.logits[:, -1, :]

    def _seen(self, rows: list[HFRow], params: SamplingParams) -> Tensor | None:
        if params.repetition_penalty == 1.0:
            return None
        seen = torch.zeros((len(rows), self.vocab_size), dtype=torch.bool, device=self.device)
        for i, row in enumerate(rows):
            seen[i, torch.tensor(row.ids, device=self.device)] = True
        return seen

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def decode(self, rids: list[int], max_new_tokens: list[int] | int,
               params: SamplingParams) -> list[SegmentOutput]:
        """Sample one segment per row (see module docstring); rows keep their new tokens."""
        if not rids:
            return []
        if isinstance(max_new_tokens, int):
            max_new_tokens = [max_new_tokens] * len(rids)
        if len(set(rids)) != len(rids):
            raise AppoError("decode got the same row twice")
        rows = self.rows.many(rids)
        if not self.reuse_cache:  # baseline mode: recompute every context from scratch
            for row in rows:
                row.kv = None
        outputs = [SegmentOutput([], [], [], "length") for _ in rows]
        live = [i for i, b in enumerate(max_new_tokens) if b > 0]
        if not live:
            return outputs
        rows_live = [rows[i] for i in live]
        budgets = [max_new_tokens[i] for i in live]
        ends = [len(r.ids) for r in rows_live]
        buf, length, start, logits, rep_of = self._prefill(rows_live, ends, max(budgets))
        if len(set(rep_of)) != len(rows_live):  # deduplicated rows: one batch row each now
            buf = gather_rows(buf, rep_of, 0, length, buf.shape[4])
            index = torch.tensor(rep_of, device=self.device)
            start = start.index_select(0, index)
            logits = logits.index_select(0, index)
        batch = DecodeBatch(rows_live, buf, length, start, logits, self._seen(rows_live, params),
                            self._shared_prefix(rows_live, buf, start),
                            cascade=self._lean is not None and self.cascade_attention)
        del buf  # the batch owns it now: a compaction or growth can free it
        with contextlib.nullcontext() if self._lean is None else self._lean.pinned():
            self._decode_loop(batch, [outputs[i] for i in live], budgets, params)
        return outputs

    @torch.inference_mode()
    def prefill(self, rids: list[int]) -> None:
        """Cache every token but the last of each row now (e.g. a prompt root before its
        forks), so later forks share it instead of each decode call recomputing it."""
        rows = [r for r in self.rows.many(rids) if len(r.ids) - r.kv_len > 1]
        if not rows or not self.reuse_cache:
            return
        ends = [len(r.ids) - 1 for r in rows]
        buf, _, start, _, rep_of = self._prefill(rows, ends, 0)
        blocks: dict[int, KVBlock] = {}  # one copy per batch row: identical rows share it
        for row, slot, end in zip(rows, rep_of, ends, strict=True):
            if slot not in blocks:
                # The new columns only, after the block the row had (its fork's or the
                # common prefix's): that one stays shared.
                first, parent = int(start[slot]), row.kv
                base = 0 if parent is None else parent.length
                blocks[slot] = KVBlock.copy_of(buf[:, :, slot, :, first + base : first + end],
                                               parent)
            row.kv = blocks[slot]

    def _prefill(self, rows: list[HFRow], ends: list[int], max_budget: int):
        """One forward over every row's uncached tokens `ids[kv_len:end]`, deduplicated.

        Rows with the same cache block and the same tokens to add are computed once. Returns
        the batch buffer (one row per distinct computation, right-aligned, room for
        `max_budget` more columns), its filled length, each batch row's first column, the
        logits after each batch row's last token, and the batch row of every input row.
        """
        if self.reuse_cache:
            self._share_common_prefix(rows, ends)
        groups: dict[tuple, list[int]] = {}
        for i, (row, end) in enumerate(zip(rows, ends, strict=True)):
            pending = tuple(row.ids[row.kv_len : end])
            if not pending:
                raise AppoError("row has no pending token to continue from")
            key = (id(row.kv), row.kv_len, pending) if self.reuse_cache else (i,)
            groups.setdefault(key, []).append(i)
        reps = [members[0] for members in groups.values()]
        rep_of = [0] * len(rows)
        for g, members in enumerate(groups.values()):
            for i in members:
                rep_of[i] = g
        rep_rows = [rows[i] for i in reps]
        c = [r.kv_len for r in rep_rows]
        total = [ends[i] for i in reps]
        p = [t - k for t, k in zip(total, c, strict=True)]
        n_max, p_max = max(total), max(p)
        b = len(rep_rows)
        buf = self._alloc(b, n_max + min(max_budget, self.capacity_chunk))
        ids = torch.full((b, p_max), self.pad_id, dtype=torch.long)
        pos = torch.zeros((b, p_max), dtype=torch.long)
        write = torch.zeros((b, p_max), dtype=torch.bool)
        for j, row in enumerate(rep_rows):
            lo = n_max - total[j]
            if lo:
                buf[:, :, j, :, :lo].zero_()
            if row.kv is not None:
                row.kv.write_into(buf[:, :, j, :, lo : lo + c[j]])
            ids[j, p_max - p[j] :] = torch.tensor(row.ids[c[j] : total[j]])
            pos[j, p_max - p[j] :] = torch.arange(c[j], total[j])
            write[j, p_max - p[j] :] = True
        start = torch.tensor([n_max - t for t in total], device=self.device)
        cache = BatchCache(buf, n_max - p_max,
                           None if bool(write.all()) else write.to(self.device))
        logits = self._forward(cache, ids.to(self.device), pos.to(self.device), start)
        self.counters.prefilled += sum(p)
        rep_set = set(reps)
        self.counters.reused += sum(r.kv_len for r in rows)
        self.counters.reused += sum(
            ends[i] - rows[i].kv_len for i in range(len(rows)) if i not in rep_set
        )
        return buf, n_max, start, logits, rep_of

    def _share_common_prefix(self, rows: list[HFRow], ends: list[int]) -> None:
        """Rows with no cache that start with the same tokens (different prompts under one
        system prompt) get that prefix computed once and shared, like a fork would.

        Each row keeps at least one pending token, so the forward after this still has
        work for every row; only rows with no cache yet are considered.
        """
        fresh = [(r, e) for r, e in zip(rows, ends, strict=True) if r.kv is None]
        if len(fresh) < 2:
            return
        first = fresh[0][0].ids
        shared = common_prefix_length([r.ids for r, _ in fresh], min(e for _, e in fresh) - 1)
        if shared < MIN_SHARED_PREFIX:
            return
        root = HFRow(list(first[:shared]), shared)
        buf, _, start, _, _ = self._prefill([root], [shared], 0)
        kv = KVBlock(buf[:, :, 0, :, int(start[0]) : int(start[0]) + shared])
        for row, _ in fresh:
            row.kv = kv
        # The caller counts every row's cached prefix as reused; one copy was computed here
        # (and counted as prefilled), so prefilled + reused stays the tokens of the contexts.
        self.counters.reused -= shared

    def _shared_prefix(self, rows: list[HFRow], buf: Tensor, start: Tensor) -> KVBlock | None:
        """A block of the keys/values of the tokens all rows start with (rows are batch
        slots 0..n-1 here): stored once for the rows' blocks after the call, and read once
        by cascade decode attention (`LeanDecoder`)."""
        if len(rows) < 2:
            return None
        shared = common_prefix_length([r.ids for r in rows])
        if shared < MIN_CASCADE_PREFIX:
            return None
        first = int(start[0])
        return KVBlock.copy_of(buf[:, :, 0, :, first : first + shared])

    def _decode_loop(self, batch: DecodeBatch, outs: list[SegmentOutput], budgets: list[int],
                     params: SamplingParams) -> None:
        """Sample, drop stopped rows, step the batch; until every row has stopped."""
        while True:
            act = batch.sampling()
            if [batch.slot[i] for i in act] == list(range(batch.size)):
                logits, seen = batch.logits, batch.seen  # every slot samples: no copy
            else:
                idx = batch.slots_of(act)
                logits = batch.logits.index_select(0, idx)
                seen = None if batch.seen is None else batch.seen.index_select(0, idx)
            if self._sample_numpy is not None and logits.dtype == torch.float32:
                tok, lp, ent, ent_top = self._sample_numpy(logits, params, self.generator, seen)
            else:
                tok, lp, ent, ent_top = sample(logits, params, self.generator, seen)
            tokens = tok.tolist()
            batch.add_tokens(act, tokens)
            for i, t, logp, h, h_top in zip(act, tokens, lp.tolist(), ent.tolist(),
                                            ent_top.tolist(), strict=True):
                out = outs[i]
                out.token_ids.append(t)
                out.logps.append(logp)
                out.entropies.append(h)
                out.topk_entropies.append(h_top)
                if self._finished(batch.rows[i], out, budgets[i]):
                    batch.stop(i)
            if not batch.any_active:
                break
            batch.compact(self.compact_fraction)
            batch.ensure_room(self.capacity_chunk)
            ids, pos = batch.step_inputs(self.pad_id)
            logits = self._forward(batch.cache(), ids.to(self.device), pos.to(self.device),
                                   batch.start, batch.shared_kv if batch.size >= 2 else None)
            self.counters.decoded += batch.advance(logits)
        batch.close()

    def _finished(self, row: HFRow, out: SegmentOutput, budget: int) -> bool:
        """Whether the row's segment ends with the token just sampled (EOS, a stop string in
        the current segment, or the budget); sets `out.finish` / `out.stop_string`."""
        if row.ids[-1] in self.eos_ids:
            out.finish = "eos"
            return True
        hit = self._stops.check(row.ids[max(row.seg_start, len(row.ids) - self._stops.window) :])
        if hit is not None:
            out.finish, out.stop_string = "stop", hit
            return True
        if len(out.token_ids) >= budget:
            out.finish = "length"
            return True
        return False
