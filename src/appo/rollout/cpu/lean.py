"""A lean forward for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3), for the hf engine.

Same math as the transformers modules, fewer and bigger operations, which is what a CPU
decode step (weight-bandwidth bound at a few rows) rewards:
- Q/K/V and gate/up projections packed into one `[out, in]` matrix each (two GEMMs per
  layer fewer). The plain layout is kept (an `[in, out]` transposed copy was slower on AMD
  CPUs); the output and down projections use the model's own weights, no copy.
- fused `F.rms_norm`, grouped-query attention without `repeat_kv`, no per-module Python
  dispatch; decode attention can take a shared prefix's keys/values once for all rows
  (`SharedPrefix`).
- CPU decode steps run their projections and LM head the way `matmuls` picks for that
  many rows: torch (MKL; the LM head in row blocks), torch as `W @ x^T`, oneDNN, or the
  numba kernels of `kernels`; prefill the rule's `prefill` implementation; GPU steps torch.
- A prefill whose rows are left-padded runs its norms, projections and MLP on the real
  tokens only (`_Tokens`); attention sees the padded `[B, T]` layout.
- CPU decode steps with numba run the work between the matmuls in numba kernels
  (`fused`: rotary + cache write, one attention kernel per layer, fused norms); without
  numba, or with `cpu_kernel=False`, the torch code below.
The packed copies (~280 MB for SmolLM2-135M in float32) are rebuilt whenever any weight
changes (tensor version counter or storage), so optimizer steps between rollouts are
picked up with no sync call. The model object is never modified; the trainer's
forward/backward are unaffected.

The engine uses it on GPU too (with torch matmuls). Anything outside the supported family
(another architecture, sliding-window attention, a non-SiLU MLP, tensor-parallel pretraining
splits) makes `LeanDecoder.supports` False and the engine uses the model's own forward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from appo.errors import AppoError
from appo.rollout.cpu import kernels, onednn
from appo.rollout.cpu.fused import FusedStep
from appo.rollout.cpu.matmuls import DEFAULT, Implementation, MatmulRule, decode_rule

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class SharedPrefix:
    """Keys/values of a context prefix every batch row shares (one prompt, or one system
    prompt), stored once, for decode steps ("cascade" attention).

    `kv` is `[layers, 2, kv_heads, P, head_dim]`; the batch cache still holds each row's
    own copy, but decode attention reads this one for all rows (one matmul with every
    row's queries) and reads from the batch cache only columns `lo:`, under `suffix_mask`
    (`[rows, 1, 1, columns - lo]`, hiding each row's own prefix copy and padding).
    """

    kv: Tensor
    lo: int
    suffix_mask: Tensor

    @property
    def length(self) -> int:
        return int(self.kv.shape[3])


@dataclass
class _Layer:
    in_norm: Tensor
    post_norm: Tensor
    qkv: Tensor  # [(heads + 2 kv_heads) * head_dim, hidden]
    qkv_bias: Tensor | None
    o: Tensor
    o_bias: Tensor | None
    gate_up: Tensor  # [2 * intermediate, hidden]
    gate_up_bias: Tensor | None
    down: Tensor
    down_bias: Tensor | None
    q_norm: Tensor | None  # qwen3: RMSNorm over each head
    k_norm: Tensor | None


class _Tokens:
    """Where a forward's token-wise work (norms, projections, MLP) runs: every `[B, T]`
    position, or, in a prefill with left padding (`BatchCache.write_mask`), only the real
    tokens, packed into `[N, ...]` rows: the padding of rows with shorter pending parts
    (~30 % of a 32-row prompt prefill's positions) then costs no matmul. Attention still
    runs on `[B, T]` (`unpack` puts zeros at the padding, whose keys/values the cache
    never writes and whose outputs nobody reads)."""

    def __init__(self, batch: int, steps: int, keep: Tensor | None, last: Tensor | None):
        self.batch, self.steps, self.keep, self._last = batch, steps, keep, last

    @classmethod
    def of(cls, cache, batch: int, steps: int) -> _Tokens:
        real = getattr(cache, "write_mask", None) if steps > 1 else None
        if real is None:
            return cls(batch, steps, None, None)
        flat = real.reshape(-1)
        # Rows are right-aligned: each row's last position is real; its packed index is the
        # count of real positions up to it, minus one.
        ends = torch.arange(1, batch + 1, device=flat.device) * steps - 1
        return cls(batch, steps, flat.nonzero().squeeze(1), flat.cumsum(0)[ends] - 1)

    def pack(self, x: Tensor) -> Tensor:
        """`[B, T, C]` -> `[tokens, C]`."""
        flat = x.reshape(self.batch * self.steps, x.shape[-1])
        return flat if self.keep is None else flat.index_select(0, self.keep)

    def unpack(self, x: Tensor) -> Tensor:
        """`[tokens, C]` -> `[B, T, C]` (zeros at the padding)."""
        if self.keep is not None:
            x = x.new_zeros((self.batch * self.steps, x.shape[-1])).index_copy_(0, self.keep, x)
        return x.view(self.batch, self.steps, x.shape[-1])

    def last(self, x: Tensor) -> Tensor:
        """`[tokens, C]` -> `[B, C]`: each row's last position."""
        if self._last is None:
            return x.view(self.batch, self.steps, x.shape[-1])[:, -1]
        return x.index_select(0, self._last)


def _bias(*linears) -> Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([
        lin.bias.detach() if lin.bias is not None
        else torch.zeros(lin.out_features, dtype=lin.weight.dtype, device=lin.weight.device)
        for lin in linears
    ])


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanDecoder:
    def __init__(self, model, cpu_kernel: bool | None = None, cpu_weights: str = "float32"):
        """`cpu_kernel`: let decode steps use the numba kernels (None: when numba is
        installed and `APPO_CPU_KERNELS` is not 0; True: require them). `cpu_weights`
        (`rollout.cpu_weights`): `bfloat16` runs every matmul on bfloat16 copies of the
        weights (`matmuls.BF16_RULE`)."""
        if cpu_kernel and not kernels.available():
            raise AppoError("cpu_kernel=True needs numba (pip install 'appo[cpu-kernels]') "
                            "and APPO_CPU_KERNELS unset or 1")
        self.cpu_kernel = kernels.available() if cpu_kernel is None else cpu_kernel
        self.model = model
        self.base = model.model
        config = model.config
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.heads
        self.eps = float(config.rms_norm_eps)
        self.scale = self.head_dim**-0.5
        self._key: tuple | None = None
        self._pinned = False  # inside `pinned()`: the weights are known not to change
        self._layers: list[_Layer] = []
        weight = next(model.parameters())
        self.dtype = weight.dtype
        self.rule: MatmulRule = decode_rule(weight.dtype, weight.device, self.cpu_kernel,
                                            cpu_weights)
        # Decode steps through the numba kernels of `fused` (float32 CPU, numba on);
        # otherwise `__call__`'s torch code.
        self._fused = FusedStep(self) if self.cpu_kernel else None

    def fused(self, input_ids: Tensor) -> FusedStep | None:
        """The fused decode step for this forward, None when it takes the torch path."""
        fused = self._fused
        if fused is None or not FusedStep.applies(input_ids, self.dtype):
            return None
        return fused

    @staticmethod
    def supports(model) -> bool:
        config = getattr(model, "config", None)
        if config is None or getattr(config, "model_type", None) not in SUPPORTED_TYPES:
            return False
        if getattr(config, "hidden_act", "silu") != "silu":
            return False
        if getattr(config, "pretraining_tp", 1) not in (1, None):
            return False
        if getattr(config, "use_sliding_window", False) or (
            config.model_type == "mistral" and getattr(config, "sliding_window", None)
        ):
            return False
        base = getattr(model, "model", None)
        return (base is not None and hasattr(base, "layers") and hasattr(base, "rotary_emb")
                and hasattr(model, "lm_head"))

    # ------------------------------------------------------------------ weights
    def _version_key(self) -> tuple:
        return tuple((p._version, p.data_ptr()) for p in self.model.parameters())

    def _only_implementation(self) -> str | None:
        """The rule's one implementation where every forward of this float32 CPU decoder
        uses it (every row count and prefill), else None."""
        names = {name for _, name in self.rule.steps} | {self.rule.prefill}
        if (len(names) != 1 or self.dtype != torch.float32
                or next(self.model.parameters()).device.type != "cpu"):
            return None
        return names.pop()

    def _onednn_only(self) -> torch.dtype | None:
        """The dtype every forward of this decoder multiplies in through oneDNN (one oneDNN
        implementation at every row count and for prefill), else None: the concatenated QKV
        and gate/up are then kept in oneDNN's layout alone, not also as dense copies
        (`onednn.pack`)."""
        if not onednn.available():
            return None
        return {"torch_onednn": torch.float32,
                "onednn_bf16": torch.bfloat16}.get(self._only_implementation())

    def _panels_only(self) -> bool:
        """Whether every forward of this decoder multiplies through the panel kernel (the
        rule's one implementation at every row count and for prefill): the concatenated
        QKV and gate/up are then kept as panels alone (`panels.pack_tensor`)."""
        return self.cpu_kernel and self._only_implementation() == "numba_panel"

    def _pack(self) -> None:
        layers = []
        dtype = self._onednn_only()
        if dtype is not None:
            def packed(w):
                return onednn.pack(w, dtype)
        elif self._panels_only():
            from appo.rollout.cpu import panels  # imports numba: only with the kernels

            def packed(w):
                return panels.pack_tensor(w) if panels.fits(w) else w
        else:
            def packed(w):
                return w
        for layer in self.base.layers:
            att, mlp = layer.self_attn, layer.mlp
            q_norm = getattr(att, "q_norm", None)
            k_norm = getattr(att, "k_norm", None)
            layers.append(_Layer(
                in_norm=layer.input_layernorm.weight.detach(),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                qkv=packed(torch.cat([att.q_proj.weight, att.k_proj.weight,
                                      att.v_proj.weight]).detach()),
                qkv_bias=_bias(att.q_proj, att.k_proj, att.v_proj),
                o=att.o_proj.weight.detach(),
                o_bias=_bias(att.o_proj),
                gate_up=packed(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()),
                gate_up_bias=_bias(mlp.gate_proj, mlp.up_proj),
                down=mlp.down_proj.weight.detach(),
                down_bias=_bias(mlp.down_proj),
                q_norm=None if q_norm is None else q_norm.weight.detach(),
                k_norm=None if k_norm is None else k_norm.weight.detach(),
            ))
        self._layers = layers

    def drop(self) -> None:
        """Free the packed copies (the panel kernel's and oneDNN's too); the next forward
        packs them again."""
        self._layers, self._key = [], None
        onednn.drop()
        if self.cpu_kernel:
            from appo.rollout.cpu import panels  # imports numba: only with the kernels

            panels.drop()

    def refresh(self) -> None:
        """Repack the weights if any changed since the last pack (version counters and
        storage of every parameter: a walk over all modules, ~1 ms on SmolLM2)."""
        if self._pinned:
            return
        # The rule too: it decides whether the QKV / gate-up copies are dense or packed.
        key = (self._version_key(), self.rule)
        if key != self._key:
            self._layers = []  # drop the old copies before making new ones
            self._pack()
            self._key = key

    @contextlib.contextmanager
    def pinned(self):
        """Refresh once, then skip the per-forward check until the block ends: an engine's
        decode loop changes no weight between its steps, and walking every parameter each
        step cost a few percent of a small model's decode step."""
        self.refresh()
        self._pinned = True
        try:
            yield
        finally:
            self._pinned = False

    def matrices(self) -> list[Tensor]:
        """The weights a decode step multiplies, in order: every layer's packed QKV, O,
        packed gate/up and down, then the LM head (when it is a plain `nn.Linear`)."""
        self.refresh()
        def dense(w):
            if w.layout == torch._mkldnn:
                return w.to_dense()
            if self.cpu_kernel:
                from appo.rollout.cpu import panels

                return panels.dense(w)
            return w

        out = [dense(w) for lw in self._layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        head = self.model.lm_head
        return out + ([head.weight.detach()] if type(head) is torch.nn.Linear else [])

    # ------------------------------------------------------------------ forward
    def _matmuls(self, input_ids: Tensor) -> Implementation:
        """How this forward runs its projections and LM head (see `matmuls`)."""
        batch, steps = input_ids.shape
        if input_ids.device.type != "cpu":
            return DEFAULT
        if steps != 1:  # torch's own linear unless the rule names another for prefill
            return DEFAULT if self.rule.prefill == "torch" else self.rule.prefill_implementation()
        return self.rule.implementation(batch)

    def _decode_attention(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
        """One query per row: `[B, H, 1, d]` against `[B, KV, L, d]` keys/values.

        The query heads of one key/value head are stacked as rows of one small matmul, so
        each cached key and value is read once (grouped-query attention without expanding
        the cache); ~15% faster than SDPA's CPU kernel here at 8 rows x 400 positions.
        """
        batch = q.shape[0]
        group = self.heads // self.kv_heads
        qg = q.reshape(batch, self.kv_heads, group, self.head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * self.scale + mask
        att = torch.matmul(torch.softmax(scores, dim=-1), values)
        return att.reshape(batch, self.heads, 1, self.head_dim)

    def _cascade_attention(self, q: Tensor, keys: Tensor, values: Tensor,
                           prefix: SharedPrefix, layer: int) -> Tensor:
        """Decode attention split into a shared prefix (read once for all rows) and each
        row's own columns; one softmax over both, so it equals `_decode_attention` over the
        whole context up to float rounding."""
        batch, group = q.shape[0], self.heads // self.kv_heads
        # [B, H, 1, d] -> [KV, B * group, d]: every row's queries of one key/value head.
        qk = q.reshape(batch, self.kv_heads, group, self.head_dim).transpose(0, 1)
        qk = qk.reshape(self.kv_heads, batch * group, self.head_dim)
        pk, pv = prefix.kv[layer, 0], prefix.kv[layer, 1]  # [KV, P, d]
        shared = torch.matmul(qk, pk.transpose(-1, -2)) * self.scale  # [KV, B*group, P]
        shared = shared.reshape(self.kv_heads, batch, group, -1).transpose(0, 1)
        qg = q.reshape(batch, self.kv_heads, group, self.head_dim)
        own = torch.matmul(qg, keys[:, :, prefix.lo :].transpose(-1, -2)) * self.scale
        own = own + prefix.suffix_mask
        probs = torch.softmax(torch.cat([shared, own], dim=-1), dim=-1)
        p_len = prefix.length
        p_shared = probs[..., :p_len].transpose(0, 1).reshape(self.kv_heads, batch * group, p_len)
        att = torch.matmul(p_shared, pv).reshape(self.kv_heads, batch, group, self.head_dim)
        att = att.transpose(0, 1) + torch.matmul(probs[..., p_len:], values[:, :, prefix.lo :])
        return att.reshape(batch, self.heads, 1, self.head_dim)

    def __call__(self, input_ids: Tensor, position_ids: Tensor, mask: Tensor | None, cache,
                 prefix: SharedPrefix | None = None) -> Tensor:
        """Logits `[B, V]` after the last input column; writes keys/values through `cache`.

        `prefix` (decode steps only) switches attention to the shared-prefix split, which
        carries its own mask; `mask` is then unused (None)."""
        self.refresh()
        batch, steps = input_ids.shape
        matmuls = self._matmuls(input_ids)
        linear = matmuls.linear
        emb = self.base.embed_tokens(input_ids)
        cos, sin = self.base.rotary_emb(emb, position_ids)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        nq, nkv, hd = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.head_dim
        tokens = _Tokens.of(cache, batch, steps)
        h = tokens.pack(emb)  # the residual stream, `[tokens, hidden]`
        for idx, lw in enumerate(self._layers):
            x = F.rms_norm(h, (self.hidden,), lw.in_norm, self.eps)
            qkv = tokens.unpack(linear(x, lw.qkv, lw.qkv_bias))
            q = qkv[..., :nq].view(batch, steps, self.heads, hd)
            k = qkv[..., nq : nq + nkv].view(batch, steps, self.kv_heads, hd)
            v = qkv[..., nq + nkv :].view(batch, steps, self.kv_heads, hd)
            if lw.q_norm is not None:
                q = F.rms_norm(q, (hd,), lw.q_norm, self.eps)
                k = F.rms_norm(k, (hd,), lw.k_norm, self.eps)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = cache.update(k, v, idx)
            if steps == 1 and prefix is not None:
                att = self._cascade_attention(q, keys, values, prefix, idx)
            elif steps == 1:
                att = self._decode_attention(q, keys, values, mask)
            else:
                att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                     scale=self.scale, enable_gqa=True)
            att = tokens.pack(att.transpose(1, 2).reshape(batch, steps, nq))
            h = h + linear(att, lw.o, lw.o_bias)
            x = F.rms_norm(h, (self.hidden,), lw.post_norm, self.eps)
            gate_up = linear(x, lw.gate_up, lw.gate_up_bias)
            inter = gate_up.shape[-1] // 2
            h = h + linear(F.silu(gate_up[..., :inter]) * gate_up[..., inter:],
                             lw.down, lw.down_bias)
        last = F.rms_norm(tokens.last(h), (self.hidden,), self.base.norm.weight, self.eps)
        head = self.model.lm_head
        if type(head) is not torch.nn.Linear:  # a wrapped / custom head: its own forward
            return head(last)
        logits = matmuls.head(last, head.weight)
        return logits if head.bias is None else logits + head.bias
