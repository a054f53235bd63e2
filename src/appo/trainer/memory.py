"""Memory of the update: a micro-batch token budget from a memory target, and phase trimming.

`actor.ppo_max_token_len_per_device` (verl's key) is a token count the user must guess: the
memory it takes depends on the model's width and depth and on what autograd saves for the
backward pass. With `actor.max_memory_gb` set, the trainer derives that budget instead:

    budget = (target - resident now - gradients and AdamW states still to come - margin)
             / activation bytes per token

where the activation bytes per token are measured, not modelled: one probe forward of a few
rows with gradients on, under `torch.autograd.graph.saved_tensors_hooks`, counts the bytes
of every tensor autograd saves that is not a parameter (each storage once). That covers any
architecture transformers runs (attention implementation, GQA expansion, norms, MLP). The
estimate is per computed token of the plain padded forward; the shared-prefix forward also
saves each row's keys/values over the shared prefix (concatenated and expanded to the query
heads), measured on SmolLM2 at 8 rows x (256 prompt + 128 response) tokens as 1.32x the
plain estimate per computed token, which `MARGIN` absorbs (the measured breakdown: benchmarks/RESULTS.md, "Where the memory
goes").

`trim_freed_memory` returns freed heap pages to the system (glibc `malloc_trim`) between
phases, so one phase's peak does not stay resident through the next.

`sparse_embedding_grads` (with the LM head's in-place weight gradient,
`appo.algos.token_logprobs_and_entropy`; `actor.grads_in_place`) keeps `[V, D]` gradient
tensors out of the update's backward; `lean_mlp_activations` saves less per token.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

from appo.errors import AppoError
from appo.trainer.cpu_linear import matmul_nt  # oneDNN inside `onednn_linears`

GIB = 2**30
MARGIN = 0.3  # of the activation share: chunk temporaries and the shared prefix's K/V (below)
MIN_TOKENS = 64
PROBE_ROWS, PROBE_TOKENS = 2, 64


def rss_bytes() -> int:
    """Resident set size of this process now (Linux; 0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def saved_bytes(model, ids: torch.Tensor, lengths: torch.Tensor) -> int:
    """Bytes autograd saves (parameters excluded, each storage once) for one training
    forward of `final_hidden_states` over rows `ids` `[B, T]` of `lengths` `[B]`, plain
    padded path."""
    from appo.trainer.forward import final_hidden_states

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params:
            seen[ptr] = storage.nbytes()
        # Detached: the same storage (kept until the graph goes, so no pointer is reused and
        # counted once for two tensors) without its grad_fn. Returning `t` itself made a
        # cycle through the C++ graph that Python's collector cannot see: every probe leaked
        # its whole graph (hundreds of MB on SmolLM2, for the rest of the run).
        return t.detach()

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = final_hidden_states(model, ids, lengths, share_prefix=False)
    del hidden
    return sum(seen.values())


class _Packed:
    __slots__ = ("t", "__weakref__")


@contextmanager
def peak_saved_bytes(model) -> Iterator[dict[str, int]]:
    """Within the block, track the bytes autograd holds for the backward: yields a dict whose
    "peak" is the most held at any moment (each storage once, released when the graph lets
    go of it), parameters aside (FSDP's unsharded ones too: a tensor whose base is a
    `Parameter`). `appo plan`'s activation model is checked against it."""
    import weakref

    params = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr()
              for p in model.parameters()}
    live: dict[int, list[int]] = {}
    state = {"now": 0, "peak": 0}

    def release(ptr: int) -> None:
        entry = live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            state["now"] -= entry[1]
            del live[ptr]

    def pack(t: torch.Tensor) -> _Packed:
        box = _Packed()
        box.t = t.detach()
        ptr = t.untyped_storage().data_ptr()
        base = t if t._base is None else t._base
        if ptr in params or isinstance(base, torch.nn.Parameter):
            return box
        if ptr in live:
            live[ptr][0] += 1
        else:
            live[ptr] = [1, t.untyped_storage().nbytes()]
            state["now"] += live[ptr][1]
            state["peak"] = max(state["peak"], state["now"])
        weakref.finalize(box, release, ptr)
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda b: b.t):
        yield state


def activation_bytes_per_token(model) -> float:
    """Saved bytes per computed token of a training forward (two probe lengths, so fixed
    costs cancel)."""
    device = next(model.parameters()).device
    vocab = int(model.get_input_embeddings().weight.shape[0])
    gen = torch.Generator().manual_seed(0)
    sizes = []
    # A model with dropout would draw from the global generator: the probe must not shift
    # the run's random stream (a resumed run probes again after restoring it).
    with torch.random.fork_rng(devices=[]):
        for tokens in (PROBE_TOKENS, 2 * PROBE_TOKENS):
            ids = torch.randint(0, vocab, (PROBE_ROWS, tokens), generator=gen).to(device)
            lengths = torch.full((PROBE_ROWS,), tokens)
            sizes.append(saved_bytes(model, ids, lengths))
    return max(1.0, (sizes[1] - sizes[0]) / (PROBE_ROWS * PROBE_TOKENS))


def pending_optimizer_bytes(model, optimizer) -> int:
    """Gradients and AdamW moments not allocated yet (before the first step): two moments
    and one gradient per trainable element, in the parameter's dtype."""
    have_state = {id(p) for p in optimizer.state}
    total = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        size = p.numel() * p.element_size()
        total += 0 if p.grad is not None else size
        total += 0 if id(p) in have_state else 2 * size
    return total


def token_budget(max_memory_gb: float, model, optimizer) -> tuple[int, dict[str, float]]:
    """Micro-batch tokens that keep the update under `max_memory_gb`, and the figures it
    came from (GB). Raises AppoError when the target leaves no room for activations."""
    resident = rss_bytes()
    pending = pending_optimizer_bytes(model, optimizer)
    per_token = activation_bytes_per_token(model)
    room = (max_memory_gb * GIB - resident - pending) * (1 - MARGIN)
    tokens = int(room // per_token)
    info = {"resident_gb": resident / GIB, "optimizer_gb": pending / GIB,
            "mb_per_token": per_token / 2**20, "tokens": tokens}
    if tokens < MIN_TOKENS:
        raise AppoError(
            f"actor.max_memory_gb={max_memory_gb:g} leaves no room for the update: the process "
            f"holds {resident / GIB:.2f} GB, gradients and AdamW states need "
            f"{pending / GIB:.2f} GB more, and a micro-batch of {MIN_TOKENS} tokens "
            f"{MIN_TOKENS * per_token / GIB:.2f} GB (raise it, or leave it unset and set "
            f"actor.ppo_max_token_len_per_device)")
    return tokens, info


BUDGET_FILE = "memory_budget.json"  # in the run directory: the budget derived at its start


def recorded_budget(run_dir: str | Path | None, max_memory_gb: float) -> int | None:
    """The token budget recorded in `run_dir` for this `max_memory_gb`, or None (no record,
    an unreadable one, or one for another target)."""
    if run_dir is None:
        return None
    try:
        record = json.loads((Path(run_dir) / BUDGET_FILE).read_text())
        if float(record["max_memory_gb"]) == float(max_memory_gb):
            return int(record["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def record_budget(run_dir: str | Path, max_memory_gb: float, tokens: int,
                  info: dict[str, float] | None = None) -> None:
    """Record the run's token budget (`BUDGET_FILE`), with the figures it came from."""
    from appo.outdir import write_output

    record = {"max_memory_gb": float(max_memory_gb), "tokens": int(tokens), **(info or {})}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_output(Path(run_dir) / BUDGET_FILE, json.dumps(record, indent=1) + "\n")


def apply_memory_target(actor, model, optimizer, dp, fsdp: bool = False,
                        run_dir: str | Path | None = None) -> int:
    """Set `actor.ppo_max_token_len_per_device` in place (printed when it changes) and
    return it: from `actor.max_memory_gb` when set; else, on CPU, capped so the update's
    activations stay under `actor.activation_memory_gb`. The smallest budget over ranks,
    so every rank plans alike. Under FSDP the probe cannot run on the sharded model: the
    cap is skipped and a target refused.

    The budget from a memory target depends on what the process holds when it is derived
    (a resumed process, or a `appo compare --jobs` worker after another pair, holds more),
    and the budget decides the micro-batch split, so it is derived once: the first start
    records it in `run_dir` (`BUDGET_FILE`) and a resume with the same target reuses it."""
    if fsdp:
        if actor.max_memory_gb is not None:
            raise AppoError("actor.max_memory_gb is not supported with trainer.parallel=fsdp "
                            "yet: set actor.ppo_max_token_len_per_device instead")
        return int(actor.ppo_max_token_len_per_device)
    if actor.max_memory_gb is not None:
        # every rank takes rank 0's record (-1: none), so all plan alike
        reused = dp.max_int(recorded_budget(run_dir, actor.max_memory_gb) or -1)
        if reused > 0:
            actor.ppo_max_token_len_per_device = reused
            if dp.is_main:
                print(f"appo: actor.max_memory_gb={actor.max_memory_gb:g}: micro-batches of up "
                      f"to {reused} tokens, as derived at the run's start ({BUDGET_FILE})",
                      flush=True)
            return reused
        tokens, info = token_budget(actor.max_memory_gb, model, optimizer)
        tokens = -dp.max_int(-tokens)
        actor.ppo_max_token_len_per_device = tokens
        if dp.is_main:
            if run_dir is not None:
                record_budget(run_dir, actor.max_memory_gb, tokens, info)
            print(f"appo: actor.max_memory_gb={actor.max_memory_gb:g}: micro-batches of up "
                  f"to {tokens} tokens (resident {info['resident_gb']:.2f} GB, gradients + "
                  f"AdamW {info['optimizer_gb']:.2f} GB to come, {info['mb_per_token']:.2f} "
                  f"MB of activations per token)", flush=True)
        return tokens
    budget = int(actor.ppo_max_token_len_per_device)
    if actor.activation_memory_gb is None or next(model.parameters()).device.type != "cpu":
        return budget
    per_token = activation_bytes_per_token(model)
    cap = max(MIN_TOKENS, int(actor.activation_memory_gb * GIB * (1 - MARGIN) // per_token))
    tokens = min(budget, -dp.max_int(-cap))
    if tokens < budget:
        actor.ppo_max_token_len_per_device = tokens
        if dp.is_main:
            print(f"appo: actor.activation_memory_gb={actor.activation_memory_gb:g}: "
                  f"micro-batches of up to {tokens} tokens instead of {budget} "
                  f"({per_token / 2**20:.2f} MB of activations per token)", flush=True)
    return tokens


@cache
def _libc():
    try:
        lib = ctypes.CDLL("libc.so.6")
        lib.malloc_trim  # noqa: B018 - glibc only; musl and macOS have none
        return lib
    except (OSError, AttributeError):
        return None


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
# Inside the training forwards under scope `except_forward`: glibc's own ceiling for its
# dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), where that threshold sits once a
# run has freed a few large blocks.
HEAP_MMAP_THRESHOLD = 32 * 2**20
_small_threshold: list[int | None] = [None]  # bytes, under scope `except_forward`


def set_mmap_threshold(kb: int | None, scope: str = "process") -> bool:
    """Allocations of at least `kb` KB get their own mapping, unmapped when freed (glibc
    `mallopt(M_MMAP_THRESHOLD)`, which also stops glibc raising the threshold itself), so
    freed activations do not stay resident as heap. `scope="except_forward"`: everywhere but
    inside `forward_allocations()` (the update's, the critic's and SFT's forward passes).
    False when not applied (None, or no glibc)."""
    lib = _libc()
    _small_threshold[0] = None
    if kb is None or lib is None:
        return False
    if scope == "except_forward":
        _small_threshold[0] = int(kb) * 1024
    return bool(lib.mallopt(M_MMAP_THRESHOLD, int(kb) * 1024))


@contextmanager
def forward_allocations() -> Iterator[None]:
    """Around a training forward: with `trainer.mmap_threshold_scope=except_forward` its
    blocks under 32 MB come from glibc's heap, where the next micro-batch's forward reuses
    what this one's backward frees (mapping each activation afresh costs a page fault per 4
    KB). The backward, which frees the activations while it allocates their gradients, maps
    its blocks and hands them back when freed, so the heap never grows past one forward's
    activations."""
    small, lib = _small_threshold[0], _libc()
    if small is None or lib is None:
        yield
        return
    lib.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)
    try:
        yield
    finally:
        lib.mallopt(M_MMAP_THRESHOLD, small)


def trim_freed_memory() -> None:
    """Collect garbage and hand the allocator's free pages back to the system (glibc); on
    CUDA also release the caching allocator's free blocks, so the update (or a sleeping
    engine's neighbour) can have the memory the rollout's KV cache held."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    lib = _libc()
    if lib is not None:
        lib.malloc_trim(0)


@contextmanager
def sparse_embedding_grads(model, enabled: bool = True) -> Iterator[bool]:
    """Within the block the input embedding (a plain `nn.Embedding` being trained) hands
    autograd its gradient as sparse rows (one per token looked up) instead of a dense
    `[V, D]` tensor, which the backward allocates at its very end, when the heap is at its
    highest. Autograd adds the rows into the parameter's `.grad` in place, so that must be
    allocated and dense first (`appo.trainer.update.zero_grads_first`): the optimizer then
    sees the same dense gradient, summed in another order. Yields whether it applied."""
    emb = model.get_input_embeddings() if enabled else None
    apply = (type(emb) is torch.nn.Embedding and emb.weight.requires_grad
             and not emb.sparse)
    if apply:
        emb.sparse = True
    try:
        yield apply
    finally:
        if apply:
            emb.sparse = False


# ---------------------------------------------------------------------- lean SwiGLU MLP
class _SwiGLUDown(torch.autograd.Function):
    """`down(silu(gate) * up)` saving only `gate` and `up` `[..., I]`: autograd through the
    module saves `silu(gate)` and the product as well (four `[..., I]` tensors per token and
    layer, the largest activations of a Llama-family model). The backward recomputes the two
    elementwise tensors, which costs far less than the matmuls around them.

    With a LoRA adapter on `down` (`lora_a` `[r, I]`, `lora_b` `[O, r]`, `scaling`), its term
    `scaling * lora_b(lora_a(h))` is computed here too, saving only `lora_a(h)` `[..., r]`:
    PEFT's module would save `h` a second time for `lora_a`."""

    @staticmethod
    def forward(ctx, gate, up, weight, bias, lora_a, lora_b, scaling):
        h = torch.nn.functional.silu(gate) * up
        out = matmul_nt(h.reshape(-1, h.shape[-1]), weight).reshape(*h.shape[:-1], -1)
        if bias is not None:
            out = out + bias
        low = None
        if lora_a is not None:
            low = h @ lora_a.t()  # [..., r]
            out = out + (low @ lora_b.t()) * scaling
        ctx.save_for_backward(gate, up, weight, lora_a, lora_b, low)
        ctx.has_bias = bias is not None
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, grad_out):
        gate, up, weight, lora_a, lora_b, low = ctx.saved_tensors
        act = torch.nn.functional.silu(gate)
        flat_out = grad_out.reshape(-1, grad_out.shape[-1])
        grad_prod = matmul_nt(flat_out, weight.t()).reshape(up.shape)  # [..., O] @ [O, I]
        grad_w = grad_b = grad_gate = grad_up = grad_a = grad_bb = None
        if lora_a is not None:
            grad_low = (grad_out @ lora_b) * ctx.scaling  # [..., r]
            grad_prod = grad_prod + grad_low @ lora_a
            if ctx.needs_input_grad[4]:
                grad_a = grad_low.reshape(-1, grad_low.shape[-1]).t() @ (act * up).reshape(
                    -1, up.shape[-1])
            if ctx.needs_input_grad[5]:
                grad_bb = (flat_out.t() @ low.reshape(-1, low.shape[-1])) * ctx.scaling
        if ctx.needs_input_grad[2]:
            grad_w = matmul_nt(flat_out.t(), (act * up).reshape(-1, up.shape[-1]).t())
        if ctx.has_bias and ctx.needs_input_grad[3]:
            grad_b = flat_out.sum(0)
        if ctx.needs_input_grad[0]:
            grad_gate = torch.ops.aten.silu_backward(grad_prod * up, gate)
        if ctx.needs_input_grad[1]:
            grad_up = grad_prod * act
        return grad_gate, grad_up, grad_w, grad_b, grad_a, grad_bb, None


def _down_parts(down) -> tuple | None:
    """(weight, bias, lora_a, lora_b, scaling) of `down` when the lean path computes exactly
    what its forward does: a plain linear, or a PEFT LoRA linear with one plain adapter
    active (not merged or disabled, no dropout, no DoRA-like variant) over a plain linear,
    in one dtype. Else None."""
    if type(down) is torch.nn.Linear:
        return down.weight, down.bias, None, None, 1.0
    base = getattr(down, "base_layer", None)
    lora_a, lora_b = getattr(down, "lora_A", None), getattr(down, "lora_B", None)
    if (type(base) is not torch.nn.Linear or lora_a is None or lora_b is None
            or down.disable_adapters or down.merged or getattr(down, "lora_variant", None)):
        return None
    active = [a for a in down.active_adapters if a in lora_a]
    if len(active) != 1:
        return None
    name = active[0]
    a, b = lora_a[name], lora_b[name]
    if (type(a) is not torch.nn.Linear or type(b) is not torch.nn.Linear
            or a.bias is not None or b.bias is not None
            or not isinstance(down.lora_dropout[name], torch.nn.Identity)
            or not a.weight.dtype == b.weight.dtype == base.weight.dtype):
        return None
    return base.weight, base.bias, a.weight, b.weight, float(down.scaling[name])


def _lean_mlp_forward(self, x):
    # Float32/64 without autocast, gradients on, and a `down_proj` the lean path reproduces
    # (`_down_parts`): the lean path; anything else (bfloat16 autocast, no-grad forwards,
    # other wrappers) the module's own. `gate_proj`/`up_proj` run as they are (LoRA or not).
    if torch.is_grad_enabled() and not torch.is_autocast_enabled(x.device.type):
        parts = _down_parts(self.down_proj)
        if parts is not None:
            return _SwiGLUDown.apply(self.gate_proj(x), self.up_proj(x), *parts)
    return type(self).forward(self, x)


def lean_mlp_activations(model) -> int:
    """Route every SwiGLU MLP (`gate_proj`, `up_proj`, `down_proj`, SiLU: the Llama family)
    of `model` through `_SwiGLUDown` (instance attribute; the class is untouched). Returns
    the number of MLPs changed."""
    import types

    n = 0
    for module in model.modules():
        act = getattr(module, "act_fn", None)
        if (all(hasattr(module, k) for k in ("gate_proj", "up_proj", "down_proj"))
                and (isinstance(act, torch.nn.SiLU)
                     or type(act).__name__ == "SiLUActivation")):  # transformers' own
            module.forward = types.MethodType(_lean_mlp_forward, module)
            n += 1
    return n


def memory_options(model, actor, fsdp: bool, mmap_threshold_kb: int | None = None,
                   mmap_scope: str = "process") -> None:
    """The memory options that change how `model` computes, not what:
    `lean_mlp_activations` (not under FSDP, whose wrapped modules it would bypass) and
    `sdpa_gqa` (CPU only, `appo.models.sdpa_gqa`); and the allocator's
    `trainer.mmap_threshold_kb` / `trainer.mmap_threshold_scope` (`set_mmap_threshold`)."""
    set_mmap_threshold(mmap_threshold_kb, mmap_scope)
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:  # transformers < 5
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing and (actor.share_prefix_forward or actor.tree_forward):
        # A checkpointed block recomputes its forward in the backward, and transformers'
        # checkpointing drops the KV cache the shared-prefix / tree forwards pass between
        # model calls: those forwards fall back to the plain padded one.
        from appo.errors import warn_once

        warn_once("model.enable_gradient_checkpointing turns off actor.share_prefix_forward"
                  f"{' and actor.tree_forward' if actor.tree_forward else ''}: the update "
                  "computes every row's prompt (set them false to silence this)")
    if actor.lean_mlp_activations and not fsdp:
        lean_mlp_activations(model)
    if actor.sdpa_gqa:
        from appo.models.sdpa_gqa import use_sdpa_gqa

        use_sdpa_gqa(model)
