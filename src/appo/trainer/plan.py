"""A memory plan per GPU, before any GPU is held: `appo plan`, and the trainer's start-up check.

The model is built on the meta device from its `config.json` alone (`model_shape`), so a plan
needs neither weights nor a GPU. `plan_memory(inputs, shape)` is a pure function of the run's
settings (`PlanInputs`, built from a config by `plan_inputs`) and the model's shape; it returns
a `MemoryPlan` of named terms in two phases, and the peak is the larger phase:

- **rollout**: the trainer's resident state (parameters, AdamW states, the KL reference, a
  LoRA run's merged rollout copy) plus the rollout engine: vLLM's share of the card
  (`rollout.gpu_memory_utilization` of the whole card, as verl and vLLM >= 0.7 mean it: its
  bfloat16 weights, one tensor-parallel slice, and the rest its KV cache and workspace;
  `rollout.kv_cache_gib` fixes the cache instead), or the hf engine's KV cache for this rank's
  rows at full length;
- **update**: the resident state plus gradients, FSDP's gathered units, activations at the
  micro-batch token budget (`actor.ppo_max_token_len_per_device`), the backward's working set
  and the LM head's logits chunk.

Sharding and precision: `fsdp` divides parameters, gradients, AdamW states and the reference
by every GPU of every node, and gathers units in bfloat16 (FSDP2 with a bf16
`MixedPrecisionPolicy`); `ddp` keeps a whole replica per GPU, plus torch DDP's gradient
buckets. `model.dtype=bfloat16` with `actor.fp32_master_weights` (the default) keeps float32
weights and AdamW states and computes in bfloat16 (`appo.trainer.precision`); AdamW's two
moments take the weights' dtype, as torch allocates them. LoRA trains only the adapter.

Activations are modelled tensor by tensor from what autograd saves in a transformers
decoder layer (RMSNorm, rotary attention through SDPA, SwiGLU MLP) as appo runs it:
`tests/trainer/test_plan.py` checks the model against the bytes autograd saves on CPU
(`appo.trainer.memory.saved_bytes`) for float32 and bfloat16-autocast forwards, with and
without gradient checkpointing. On GPUs the keys/values are expanded to every query head
(transformers' SDPA path with a padding mask) and SDPA keeps each layer's attention mask;
rows are assumed padded to `data.max_prompt_length + data.max_response_length`.

Phases: by default the rollout engine's memory is released during the update (vLLM's sleep
mode, as verl runs it), so the peak is the larger of the two phases; `overlap=True`
(`appo plan --overlap`) plans the engine's share held through the update as well. Not
counted: the CUDA context beyond a fixed reserve, allocator fragmentation, the reference and
old log-prob forwards (no gradients: smaller than the update), and the shared-prefix
forward's extra keys/values (off under gradient checkpointing, which every published config
turns on).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from appo.errors import AppoError

GIB = 2**30
CUDA_RESERVE_GIB = 1.0  # CUDA context, cuBLAS workspace, NCCL buffers: a fixed allowance


@dataclass(frozen=True)
class ModelShape:
    """What a memory plan needs to know about a causal LM (parameter counts from the meta
    model; sizes from its config)."""

    name: str
    params: int  # every parameter, tied ones once
    tensors: int  # parameter tensors
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    layer_params: int  # one decoder layer
    layer_linear_params: int  # one decoder layer's linear weights
    root_params: int  # outside the decoder layers: embeddings, final norm, head
    head_params: int  # the LM head's weight [V, D]
    qk_norm: bool = False  # RMSNorm on each query and key head (Qwen3)
    lora_params: int = 0  # the adapter's A and B (model.lora_rank > 0)
    lora_tensors: int = 0
    lora_base_params: int = 0  # the adapted layers' base weights


def _targets(target_modules: Any) -> set[str] | None:
    if isinstance(target_modules, str):
        return None if target_modules == "all-linear" else {target_modules}
    return {str(t) for t in target_modules}


def model_shape(hf_config: Any, name: str = "", lora_rank: int = 0,
                target_modules: Any = "all-linear") -> ModelShape:
    """Build the model of `hf_config` on the meta device (no memory, no weights) and count."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    base = getattr(model, "model", None)
    layers = list(getattr(base, "layers", None) or [])
    if not layers:
        raise AppoError(f"cannot plan {type(model).__name__}: no decoder layers at "
                        "model.model.layers")
    params = list(model.parameters())
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    head = model.get_output_embeddings()
    targets = _targets(target_modules)
    lora = lora_tensors = lora_base = 0
    if lora_rank > 0:
        for mod_name, mod in model.named_modules():
            if not isinstance(mod, torch.nn.Linear) or mod is head:
                continue
            if targets is None or mod_name.rsplit(".", 1)[-1] in targets:
                lora += lora_rank * (mod.in_features + mod.out_features)
                lora_tensors += 2
                lora_base += mod.weight.numel()
    c = hf_config
    heads = int(c.num_attention_heads)
    return ModelShape(
        name=name or type(model).__name__,
        params=sum(p.numel() for p in params),
        tensors=len(params),
        layers=len(layers),
        hidden=int(c.hidden_size),
        heads=heads,
        kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(c, "head_dim", None) or c.hidden_size // heads),
        intermediate=int(c.intermediate_size),
        vocab=int(c.vocab_size),
        tied=bool(getattr(c, "tie_word_embeddings", False)),
        layer_params=sum(p.numel() for p in layers[0].parameters()),
        layer_linear_params=sum(m.weight.numel() for m in layers[0].modules()
                                if isinstance(m, torch.nn.Linear)),
        root_params=sum(p.numel() for p in params if id(p) not in in_layers),
        head_params=head.weight.numel() if head is not None else 0,
        qk_norm=getattr(getattr(layers[0], "self_attn", None), "q_norm", None) is not None,
        lora_params=lora, lora_tensors=lora_tensors, lora_base_params=lora_base,
    )


@dataclass(frozen=True)
class PlanInputs:
    """The settings a plan depends on (`plan_inputs` reads them from a config)."""

    gpus: int = 1  # per node
    nodes: int = 1
    gpu_memory_gb: float = 80.0  # per GPU, GiB
    parallel: str = "fsdp"  # fsdp | ddp | single
    device: str = "cuda"  # cuda | cpu (cpu: SDPA's grouped-query kernel, no CUDA reserve)
    master_bytes: int = 4  # bytes per trained weight (and gradient, AdamW moment)
    autocast: bool = True  # bfloat16 compute over float32 weights
    lora_rank: int = 0
    kl_reference: bool = False
    critic: bool = False
    rollout: str = "vllm"  # vllm | hf | openai
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.7
    kv_cache_gib: float | None = None
    rollout_rows: int = 0  # rows per GPU held by an hf engine at once
    sequence_tokens: int = 0  # prompt + response: the longest row
    token_budget: int = 4096  # micro-batch tokens of the update
    gradient_checkpointing: bool = False
    lean_mlp: bool = True
    sdpa_gqa: bool = True
    logprob_chunk: int = 128
    overlap: bool = False  # the rollout engine keeps its memory through the update
    padded: bool = True  # rows of a micro-batch are padded (an attention mask per layer)
    # Under FSDP a whole copy of the policy in the compute dtype on every GPU: the hf engine
    # samples from it, APPO's Branching Score scores with it, a critic starts from it (vLLM
    # by name otherwise takes the weights from the shards: no copy).
    rollout_copy: bool = False

    @property
    def world(self) -> int:
        return self.gpus * self.nodes


@dataclass
class Term:
    key: str
    label: str
    rollout: int  # bytes in the rollout phase
    update: int  # bytes in the update phase
    shrink: list[str] = field(default_factory=list)  # config keys that shrink it


@dataclass
class MemoryPlan:
    """Per-GPU bytes by named term and phase; `peak` is the larger phase's total."""

    inputs: PlanInputs
    shape: ModelShape
    terms: list[Term]
    notes: list[str]
    source: str = ""

    def term(self, key: str) -> Term:
        for t in self.terms:
            if t.key == key:
                return t
        raise KeyError(key)

    def total(self, phase: str) -> int:
        return sum(getattr(t, phase) for t in self.terms)

    @property
    def card(self) -> int:
        return int(self.inputs.gpu_memory_gb * GIB)

    @property
    def peak_phase(self) -> str:
        return "update" if self.total("update") >= self.total("rollout") else "rollout"

    @property
    def peak(self) -> int:
        return self.total(self.peak_phase)

    @property
    def fits(self) -> bool:
        return self.peak <= self.card and not self.kv_short

    @property
    def kv_short(self) -> bool:
        """vLLM's share of the card does not even hold its weights."""
        t = next((t for t in self.terms if t.key == "rollout_kv"), None)
        return t is not None and t.rollout < 0

    @property
    def largest(self) -> Term:
        phase = self.peak_phase
        return max(self.terms, key=lambda t: getattr(t, phase))

    def verdict(self) -> str:
        """One line: fits, or does not fit with the largest term and the keys that shrink it."""
        gb = self.peak / GIB
        card = self.inputs.gpu_memory_gb
        if self.kv_short:
            return ("does not fit: rollout.gpu_memory_utilization leaves vLLM no room for a KV "
                    "cache beside its weights (raise it, or rollout.tensor_model_parallel_size)")
        if self.fits:
            return (f"fits: peak {gb:.1f} GB per GPU ({self.peak_phase} phase) of {card:g} GB, "
                    f"{card - gb:.1f} GB free")
        big = self.largest
        how = (f"shrink it with {', '.join(big.shrink)}" if big.shrink
               else "no config key shrinks it")
        return (f"does not fit: the {self.peak_phase} phase needs {gb:.1f} GB per GPU of "
                f"{card:g} GB; largest term: {big.label} "
                f"{getattr(big, self.peak_phase) / GIB:.1f} GB ({how})")

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "inputs": asdict(self.inputs),
            "model": asdict(self.shape),
            "terms": [{"key": t.key, "label": t.label, "rollout_gb": t.rollout / GIB,
                       "update_gb": t.update / GIB, "shrink": t.shrink} for t in self.terms],
            "rollout_gb": self.total("rollout") / GIB,
            "update_gb": self.total("update") / GIB,
            "peak_gb": self.peak / GIB,
            "peak_phase": self.peak_phase,
            "gpu_memory_gb": self.inputs.gpu_memory_gb,
            "fits": self.fits,
            "largest": self.largest.key,
            "verdict": self.verdict(),
            "notes": self.notes,
        }


# ------------------------------------------------------------------ activations
def _compute_bytes(i: PlanInputs) -> int:
    return 2 if i.autocast or i.master_bytes == 2 else 4


def _autocast_forward(i: PlanInputs) -> bool:
    """bfloat16 autocast over float32 weights (outside FSDP; under FSDP the gathered units
    are bfloat16 already, `MixedPrecisionPolicy`)."""
    return i.autocast and i.parallel != "fsdp"


def layer_bytes_per_token(i: PlanInputs, s: ModelShape, row_tokens: int) -> float:
    """Bytes autograd saves per token in one decoder layer for the backward."""
    D, H, d, inter = s.hidden, s.heads, s.head_dim, s.intermediate
    c = _compute_bytes(i)
    if _autocast_forward(i):
        # each RMSNorm: its float32 input, 1/rms and the normalised input; each linear: its
        # own bfloat16 cast of the input (q, k, v; gate, up)
        norms = 2 * (8 * D + 4) + (3 + 2) * 2 * D
    else:
        # each RMSNorm: the float32 input (or its float32 copy), 1/rms, the normalised input
        # and the weighted output (the linears' input) in the weights' dtype
        w = 2 if i.parallel == "fsdp" and i.autocast else i.master_bytes
        norms = 2 * (4 * D + 2 * w * D + 4)
    grouped = (i.device == "cpu" and i.sdpa_gqa) or s.kv_heads == H
    kv = 2 * c * (s.kv_heads if grouped else H) * d  # keys and values as SDPA keeps them
    attention = c * H * d * 2 + kv + 4 * H  # queries, output, log-sum-exp (float32)
    if s.qk_norm:  # per head: the float32 input (or copy), 1/rms, the normalised heads
        attention += (4 + c) * (H + s.kv_heads) * d + 4 * (H + s.kv_heads)
    if i.padded:
        attention += c * row_tokens  # the layer's [rows, 1, T, T] mask
    lean = i.lean_mlp and not i.autocast and i.parallel != "fsdp"
    mlp = (2 if lean else 4) * c * inter
    return norms + attention + mlp


def fixed_bytes_per_token(i: PlanInputs, s: ModelShape) -> float:
    """Per token outside the layers: the final norm (its input, the normalised input and
    its output, which the gather of the response positions keeps), the LM head's input
    (the gathered response positions; every token counted), and per token the ids, the
    gather's index, the targets, log-sum-exp and entropy (32 bytes)."""
    D = s.hidden
    if _autocast_forward(i):
        return 3 * 4 * D + 2 * D + 4 + 32  # float32 norm tensors; bfloat16 head input
    w = 2 if i.parallel == "fsdp" and i.autocast else i.master_bytes
    return 4 * D + 3 * w * D + 4 + 32


def residual_bytes(i: PlanInputs) -> int:
    """Bytes per hidden element of the residual stream (what a checkpointed layer keeps)."""
    if i.parallel == "fsdp" and i.autocast:
        return 2
    return i.master_bytes


def _layer_casts(i: PlanInputs, s: ModelShape) -> int:
    """Autocast's bfloat16 copies of one layer's linear weights, kept for its backward."""
    return 2 * s.layer_linear_params if _autocast_forward(i) else 0


def weight_cast_bytes(i: PlanInputs, s: ModelShape) -> int:
    """Autocast's bfloat16 weight copies the forward keeps for the backward: every layer's
    (none under checkpointing: a layer's come back with its recomputation) and the LM head's."""
    if not _autocast_forward(i):
        return 0
    return (0 if i.gradient_checkpointing else s.layers * _layer_casts(i, s)) + 2 * s.head_params


def activation_bytes(i: PlanInputs, s: ModelShape, tokens: int | None = None) -> tuple[int, int]:
    """(bytes autograd keeps from the forward, weight copies aside; bytes of the backward's
    working set: one layer's activations, recomputed under checkpointing) for a micro-batch
    of `tokens` in rows of up to `sequence_tokens`."""
    tokens = i.token_budget if tokens is None else tokens
    row = min(i.sequence_tokens or tokens, tokens)
    per_layer = layer_bytes_per_token(i, s, row)
    fixed = fixed_bytes_per_token(i, s)
    if i.gradient_checkpointing:
        saved = tokens * (s.layers * s.hidden * residual_bytes(i) + fixed)
    else:
        rope = 2 * s.head_dim * row * (4 if _autocast_forward(i) else residual_bytes(i))
        saved = tokens * (s.layers * per_layer + fixed) + rope
    return int(saved), int(tokens * per_layer + _layer_casts(i, s))


# ------------------------------------------------------------------ the plan
def plan_memory(i: PlanInputs, s: ModelShape, source: str = "") -> MemoryPlan:
    """The per-GPU memory plan of a run with settings `i` on a model of shape `s`."""
    if i.gpus < 1 or i.nodes < 1 or i.gpu_memory_gb <= 0:
        raise AppoError("a plan needs at least one GPU of some memory")
    fsdp = i.parallel == "fsdp"
    shard = i.world if fsdp else 1
    c = _compute_bytes(i)
    lora = i.lora_rank > 0
    trained = s.lora_params if lora else s.params
    tensors = s.lora_tensors if lora else s.tensors
    more = {"fsdp": ["more GPUs (--gpus / --nodes)"], "ddp": ["trainer.parallel=fsdp"],
            "single": ["several GPUs with trainer.parallel=fsdp"]}[i.parallel]
    fewer = more + ([] if lora else ["model.lora_rank"])
    dtype = {4: "float32", 2: "bfloat16"}[i.master_bytes]
    per = f", /{shard}" if fsdp else ""
    terms: list[Term] = []

    def add(key: str, label: str, rollout: float, update: float, shrink: list[str]) -> None:
        terms.append(Term(key, label, int(rollout), int(update), shrink))

    params = (s.params + (s.lora_params if lora else 0)) * i.master_bytes / shard
    add("params", f"parameters ({dtype}{per})", params, params, more)
    add("grads", f"gradients ({dtype}{per})", 0, trained * i.master_bytes / shard, fewer)
    # AdamW: two moments per trained element in its dtype, plus one step count per tensor
    optim = 2 * trained * i.master_bytes / shard + 4 * tensors
    add("optimizer", f"AdamW states (2 x {dtype}{per})", optim, optim, fewer)
    if i.kl_reference and not lora:  # under LoRA the reference is the base, adapter off
        ref = s.params * c / shard
        add("reference", f"KL reference ({'bfloat16' if c == 2 else dtype}{per})", ref, ref,
            ["actor.kl_loss_coef=0 / actor.use_kl_loss=false"] + more)
    if i.rollout_copy and fsdp and not lora:
        copy_bytes = s.params * c
        add("rollout_copy", f"whole rollout copy ({'bfloat16' if c == 2 else dtype})",
            copy_bytes, copy_bytes, ["rollout.name=vllm (not with APPO, a critic)"])
    if lora:  # the merged rollout copy of the adapted weights, whole on every GPU
        merged = s.lora_base_params * i.master_bytes
        add("lora_merged", "LoRA merged rollout copy", merged, merged, ["model.target_modules"])
    if i.critic:
        one = s.params * i.master_bytes / shard  # weights; + 2 AdamW moments; + gradients
        add("critic", f"critic (weights, gradients, AdamW{per})", 3 * one, 4 * one, more)
    if fsdp:
        # FSDP2 in bfloat16: the root unit (embeddings, head) gathered through the forward
        # and backward, with its unsharded gradients; two decoder units gathered (current and
        # prefetched) and one unit's gradients before the reduce-scatter (bf16 + fp32 copy).
        gathered = (2 * s.root_params + 2 * s.layer_params) * 2 + s.layer_params * (2 + 4)
        add("fsdp_buffers", "FSDP gathered units and unsharded gradients", 0, gathered, [])
    elif i.world > 1:
        # torch DDP's gradient buckets (gradient_as_bucket_view=False, its default)
        add("ddp_buckets", "DDP gradient buckets", 0, trained * i.master_bytes,
            ["trainer.parallel=fsdp"])
    casts = weight_cast_bytes(i, s)
    if casts:
        add("weight_casts", "bfloat16 weight copies (autocast)", 0, casts,
            ["model.enable_gradient_checkpointing=true"] if not i.gradient_checkpointing
            else more)
    saved, working = activation_bytes(i, s)
    ckpt = "checkpointed" if i.gradient_checkpointing else "no checkpointing"
    act_keys = ["actor.ppo_max_token_len_per_device"] + (
        [] if i.gradient_checkpointing else ["model.enable_gradient_checkpointing=true"])
    add("activations", f"activations ({i.token_budget} tokens, {ckpt})", 0, saved, act_keys)
    add("backward", "backward working set (one layer)", 0, working,
        ["actor.ppo_max_token_len_per_device"])
    logits = i.logprob_chunk * s.vocab * (8 + (2 if c == 2 else 0))
    add("logits", f"logits chunk ({i.logprob_chunk} x {s.vocab})", 0, logits,
        ["actor.logprob_chunk_size"])
    notes = []
    if i.rollout == "vllm":
        weights = 2 * s.params / i.tensor_parallel
        if i.kv_cache_gib is not None:
            kv = i.kv_cache_gib * GIB
            share = weights + kv
        else:
            share = i.gpu_memory_utilization * i.gpu_memory_gb * GIB
            kv = share - weights
        tp = ["rollout.tensor_model_parallel_size"]
        add("rollout_weights", f"vLLM weights (bfloat16, tensor parallel {i.tensor_parallel})",
            weights, weights if i.overlap else 0, tp)
        add("rollout_kv", "vLLM KV cache and workspace", kv, kv if i.overlap else 0,
            ["rollout.gpu_memory_utilization", "rollout.kv_cache_gib"])
        notes.append(
            "phases: vLLM keeps its share through the update (--overlap)" if i.overlap else
            "phases: vLLM releases its share during the update (sleep mode, as verl); "
            "the peak is the larger phase (--overlap: held through the update)")
    elif i.rollout == "hf":
        kv_token = 2 * s.layers * s.kv_heads * s.head_dim * i.master_bytes
        kv = i.rollout_rows * i.sequence_tokens * kv_token
        add("rollout_kv", f"hf engine KV cache ({i.rollout_rows} rows x "
            f"{i.sequence_tokens} tokens)", kv, kv if i.overlap else 0,
            ["data.train_batch_size", "rollout.n", "data.max_response_length"])
        notes.append("rollout: the hf engine samples from the policy's own weights")
    else:
        notes.append("rollout: servers (rollout.name=openai) hold their memory elsewhere")
    if i.device == "cuda":
        add("cuda_reserve", "CUDA context and workspaces (allowance)",
            CUDA_RESERVE_GIB * GIB, CUDA_RESERVE_GIB * GIB, [])
    return MemoryPlan(i, s, terms, notes, source)


def check_fits(plan: MemoryPlan, skip_key: str = "trainer.skip_memory_plan") -> MemoryPlan:
    """`plan`, or AppoError (one line: the verdict and how to go on anyway)."""
    if plan.fits:
        return plan
    raise AppoError(f"memory plan: {plan.verdict()}; to start anyway: {skip_key}=true "
                    f"(see `appo plan`)")
