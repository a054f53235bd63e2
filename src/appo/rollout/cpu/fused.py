"""One CPU decode step of the lean forward with the per-layer work in numba kernels.

`LeanDecoder` runs a decode step (one new token per row, float32 on CPU) here when numba is
available: per layer four matmuls (the decode rule's implementation, as on the torch path)
and, between them, `attention`'s kernels: RMSNorm, rotary + cache write and attention in
one split job (`attention.rope_attend_units`), residual add fused with the next norm,
SiLU x up. What the torch path rebuilt in
every layer is done once per step: rotary's cos/sin, the numpy views of the batch buffer
and of the step's work arrays, each row's first visible column (instead of an additive
mask). Once per decode call (per shared prefix): the prefix's keys and values in panels
for the attention kernel's matmuls (`attention.pack_prefix`). The hidden state stays in one numpy array updated in place.
Attention is split over the run's threads in work units (one KV head x a block of rows,
`attention.units`), so both cores work even where the model has an odd number of KV
heads; the units share nothing, so the split does not change a bit of the result.

The matmuls go through the implementation's `linear` on tensors (so a test's spy on it
still sees every call), except where the implementation has a numpy entry point
(`Implementation.numpy_linear`, the numba kernels): then no tensor is made between layers.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import Tensor

from appo.rollout.cpu import hugepages, kernels, onednn

_EMPTY = np.empty(0, np.float32)
# Query-key pairs of a layer's decode attention below which it runs on the calling thread
# alone: a helper's wake-up costs tens of microseconds.
ATTENTION_SPLIT_MIN = 8 * 9 * 256


def _array(t: Tensor | None) -> np.ndarray:
    return _EMPTY if t is None else t.numpy()


class FusedStep:
    """Runs `LeanDecoder` decode steps through the kernels (see module docstring)."""

    def __init__(self, lean):
        # These import numba: only built when available.
        from appo.rollout.cpu import attention, team

        self.lean = lean
        self.k = attention
        self.team = team
        self._norms: tuple | None = None
        # (weak reference to the shared prefix's keys/values, their panels per layer)
        self._pvt: tuple | None = None

    def _prefix_panels(self, prefix_kv: Tensor, pkv: np.ndarray) -> list[tuple]:
        """Per layer, the shared prefix's keys and values in the attention's panels
        (`attention.pack_prefix`), made once per shared prefix (one per decode call) and
        dropped with it."""
        cached = self._pvt
        if cached is not None and cached[0]() is prefix_kv:
            return cached[1]
        pvt = [self.k.pack_prefix(pkv[layer, 0], pkv[layer, 1]) for layer in range(pkv.shape[0])]

        def drop(ref: weakref.ref) -> None:  # the prefix is gone: free its copy too
            if self._pvt is not None and self._pvt[0] is ref:
                self._pvt = None

        self._pvt = (weakref.ref(prefix_kv, drop), pvt)
        return pvt

    @staticmethod
    def applies(input_ids: Tensor, dtype: torch.dtype) -> bool:
        return (input_ids.shape[1] == 1 and input_ids.device.type == "cpu"
                and dtype == torch.float32 and kernels.available())

    def _layer_norms(self) -> list[tuple]:
        """Per layer: the numpy views of its norm weights, rebuilt with the packed weights.
        Keyed by the decoder's pack key, not its list of layers: holding that list would
        keep the packed weight copies alive after `LeanDecoder.drop` (through the update:
        ~0.27 GB of QKV / gate-up on SmolLM2) and beside the next pack's."""
        key = self.lean._key
        if self._norms is None or self._norms[0] is not key:
            self._norms = (key, [
                (lw.in_norm.numpy(), lw.post_norm.numpy(), _array(lw.q_norm),
                 _array(lw.k_norm)) for lw in self.lean._layers])
        return self._norms[1]

    def __call__(self, input_ids: Tensor, position_ids: Tensor, cache, start: Tensor,
                 prefix_kv: Tensor | None) -> Tensor:
        """Logits `[B, V]` for one decode step; writes the new keys/values at column
        `cache.length`. `start[b]`: row b's first column; `prefix_kv`
        (`[layers, 2, kv_heads, P, head_dim]`): the first P tokens every row shares, read
        from there instead of from the rows' columns."""
        lean, k = self.lean, self.k
        lean.refresh()
        impl = lean._matmuls(input_ids)
        hugepages.decode_step()  # packed weights that keep serving go onto huge pages
        rows = input_ids.shape[0]
        hd, eps = lean.head_dim, lean.eps
        emb = lean.base.embed_tokens(input_ids)
        cos, sin = lean.base.rotary_emb(emb, position_ids)
        cos_np, sin_np = cos.reshape(rows, hd).numpy(), sin.reshape(rows, hd).numpy()
        h = emb.reshape(rows, lean.hidden).numpy()  # the residual stream, updated in place
        # A view made per step (one call), not kept: a kept view would keep a finished
        # batch's whole buffer alive until the next rollout.
        buf = cache.buf.numpy()
        col = int(cache.length)
        if prefix_kv is None:
            pkv, pvt, first = None, None, start
        else:
            pkv, first = prefix_kv.numpy(), start + prefix_kv.shape[3]
            pvt = self._prefix_panels(prefix_kv, pkv)
        first_np = first.numpy().astype(np.int64)
        empty_kv = np.empty((lean.kv_heads, 0, hd), np.float32)
        empty_kv_t = np.empty((lean.kv_heads, hd, 0), np.float32)
        x = np.empty_like(h)
        q = np.empty((rows, lean.heads, hd), np.float32)
        att = np.empty((rows, lean.heads * hd), np.float32)
        x_t, att_t = torch.from_numpy(x), torch.from_numpy(att)
        att3 = att.reshape(rows, lean.heads, hd)
        # Attention over the run's threads, one work unit (KV head x row block) per chunk,
        # when the step's attention is large enough to be worth a helper's wake-up.
        threads = torch.get_num_threads()
        work = rows * lean.heads * (col + 1 - int(first.min())
                                    + (0 if prefix_kv is None else prefix_kv.shape[3]))
        n_units = k.units(rows, lean.kv_heads)
        units = tuple((u, u + 1) for u in range(n_units)) if (
            threads > 1 and work >= ATTENTION_SPLIT_MIN) else ((0, n_units),)
        act: np.ndarray | None = None
        norms = self._layer_norms()
        numpy_linear = impl.numpy_linear
        # oneDNN's rule: its op called directly. `numpy_linear`'s checks hold here by
        # construction (float32 C-contiguous 2-D arrays made above, float32 CPU weights,
        # detached biases) and cost ~2 us a call, ~120 calls a step.
        op = onednn.linear_op() if numpy_linear is onednn.numpy_linear else None

        def linear(a: np.ndarray, a_t: Tensor, weight: Tensor, bias: Tensor | None):
            if op is not None:
                return op(a_t, onednn.packed(weight), bias, "none", [None], "").numpy()
            if numpy_linear is not None:
                return numpy_linear(a, weight, bias)
            return impl.linear(a_t, weight, bias).numpy()

        k.rms_norm(h, norms[0][0], eps, x)
        for idx, lw in enumerate(lean._layers):
            in_norm, post_norm, q_norm, k_norm = norms[idx]
            qkv = linear(x, x_t, lw.qkv, lw.qkv_bias)
            pk, pv = (empty_kv, empty_kv_t) if pkv is None else pvt[idx]
            # Rotary + cache write inside the attention's units: split over the threads too.
            self.team.attend((q, buf, idx, first_np, col, pk, pv, lean.scale, att3), units,
                             threads, (qkv, cos_np, sin_np, q_norm, k_norm, eps))
            k.add_rms_norm(h, linear(att, att_t, lw.o, lw.o_bias), post_norm, eps, x)
            gate_up = linear(x, x_t, lw.gate_up, lw.gate_up_bias)
            if act is None:
                act = np.empty((rows, gate_up.shape[1] // 2), np.float32)
                act_t = torch.from_numpy(act)
            k.silu_mul(gate_up, act)
            nxt = norms[idx + 1][0] if idx + 1 < len(norms) else lean.base.norm.weight.detach().numpy()
            k.add_rms_norm(h, linear(act, act_t, lw.down, lw.down_bias), nxt, eps, x)
        head = lean.model.lm_head
        if type(head) is not torch.nn.Linear:  # a wrapped / custom head: its own forward
            return head(x_t.clone())
        logits = impl.head(x_t, head.weight)
        return logits if head.bias is None else logits + head.bias
