"""The config schema: one dataclass per section, with its defaults, and the keys whose value
selects a registered implementation (`CHOICES`). Loading, merging and validation are in
`appo.config`, which re-exports everything here.

Key names follow the original ARPO/AEPO/APPO (verl) system where it had one, minus verl's
`actor_rollout_ref.` prefix. The defaults describe the embedded setup (SmolLM2-135M on CPU,
the synthetic `arith` task with the python tool), so every command runs without a config
file; docs/algorithms.md §10 lists the keys that change what is computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

__all__ = [
    "CHOICES", "LIST_CHOICES", "MISSING", "ActorConfig", "AlgorithmConfig", "AppoConfig",
    "CriticConfig", "CriticModelConfig",
    "CustomRewardConfig", "DataConfig", "EvalConfig", "FSDPOffloadConfig", "ModelConfig",
    "OptimConfig",
    "RolloutConfig", "SFTConfig", "ToolInstanceConfig", "ToolsConfig", "TrainerConfig",
]


@dataclass
class ModelConfig:
    # Any appo.models spec: an alias (smollm2-135m, tiny-test), a local HF directory,
    # a .gguf file, or a hub id already in the local Hugging Face cache.
    path: str = "smollm2-135m"
    dtype: str = "float32"
    device: str = "auto"
    enable_gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    # LoRA through PEFT (appo.models.lora), verl's keys: lora_rank 0 trains every weight
    # (full fine-tuning); > 0 trains a rank-r adapter on target_modules ("all-linear": every
    # linear layer but the LM head, or a list such as [q_proj,v_proj]), scaled by
    # lora_alpha / lora_rank. The KL reference is the base model (adapter off); rollouts
    # sample from merged weights. Checkpoints hold the adapter in PEFT's format, plus a
    # merged Hugging Face model in `merged/` when lora_save_merged is true.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    target_modules: Any = "all-linear"
    lora_dropout: float = 0.0
    lora_save_merged: bool = False


@dataclass
class DataConfig:
    # Files (parquet / jsonl / HF datasets dir) or a synthetic task spec such as
    # "synth:arith?levels=2,3&n=512" (see appo.data).
    train_files: list[str] = field(default_factory=lambda: ["synth:arith"])
    val_files: list[str] = field(default_factory=lambda: ["synth:arith?split=eval"])
    prompt_key: str = "prompt"
    template: str = "math"
    # Append APPO's paragraph asking the model to mark its reasoning stages with
    # <|extra_0|>...<|extra_1|> to every system prompt, as the original APPO rollout did
    # (appo.data.templates.APPO_STAGE_PROMPT); the published APPO configs turn it on.
    appo_stage_prompt: bool = False
    train_batch_size: int = 4
    # Held-out prompts rolled out at once by training-time evaluation (validation, the
    # demo's stages): their KV cache lives together, so this bounds evaluation's memory
    # (32: the demo's training rollout holds as many rows; benchmarks/RESULTS.md).
    val_batch_size: int = 32
    max_prompt_length: int = 512
    max_response_length: int = 384
    overlong: str = "skip"
    shuffle: bool = True
    seed: int = 42


@dataclass
class RolloutConfig:
    # hf (in-process, default), vllm (in-process vllm.LLM), openai (servers, base_urls), or
    # auto: vllm where it is installed and finishes this run's rollouts sooner, else hf
    # (appo.rollout.auto: measured rule table, vLLM's start-up counted on CPU)
    name: str = "hf"
    strategy: str = "arpo"
    n: int = 16  # the ARPO paper (docs/algorithms.md §2.2); the CPU demo uses 8
    initial_rollouts: int = 8
    beam_size: int = 2
    branch_probability: float = 0.5
    entropy_weight: float = 0.2
    entropy_window: int = 20
    # The original's measure (top-10 proxy summed over the window / ln|V|): the scale
    # entropy_weight and AEPO's beta were tuned on (docs/algorithms.md arpo.2); `mean`:
    # mean full-vocabulary token entropy.
    entropy_measure: str = "seed_topk_sum"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    result_template: str = " <result>\n{text}\n</result>"
    on_limit: str = "notify"
    # aepo
    # Entropy pre-monitoring and m = f(H_root - H_tool) initial rows (aepo.1-2). Off: fixed
    # initial_rollouts with the AEPO branch rule and penalty, as both released AEPO scripts ran.
    enable_dynamic_rollouts: bool = True
    initial_entropy_tokens: int = 50
    beta: float = 0.5
    branch_penalty: float = 0.05
    reuse_premonitor: bool = False
    # appo
    appo_gamma: float = 1.0
    future_value_clip: float = 0.2
    # Branch points: the original excludes whitespace-only tokens; true also excludes
    # punctuation-only ones (appo's option, docs/algorithms.md appo.3).
    appo_skip_punctuation: bool = False
    # A row whose |logp_current - logp_rollout| all stay within this is on-policy up to
    # recompute noise (FV = 1): appo ranks its branch points by entropy. null: by the
    # scoring model's dtype (float32 1e-3, float16 0.25, bfloat16 2.0: measured recompute
    # noise times 5-25; appo.rollout.scoring.LR_NOISE_TOL).
    lr_noise_tol: float | None = None
    # vllm engine
    gpu_memory_utilization: float = 0.7
    # KV cache size in GiB (vLLM's kv_cache_memory_bytes); null: 2 on CPU (vLLM would
    # otherwise reserve most of the RAM), gpu_memory_utilization decides on GPUs
    kv_cache_gib: float | None = None
    # openai engine (server mode): the servers' base URLs (e.g. vllm serve processes), rows
    # spread over them by prompt group; after each update the policy is saved to
    # weights_dir (null: <trainer.default_local_dir>/rollout_weights), which every server
    # must be able to read, and each server reloads it (vLLM dev mode)
    base_urls: list[str] = field(default_factory=list)
    weights_dir: str | None = None
    tensor_model_parallel_size: int = 1
    enable_prefix_caching: bool = True
    seed: int = 0
    # vllm engine: sleep between rollouts (verl's key): after a rollout the engine offloads
    # its weights to CPU and frees its KV cache (vLLM sleep level 1); before the next it
    # wakes the weights, takes the updated policy, then wakes the KV cache. null: on with
    # CUDA, off on CPU (vLLM's CPU build has no sleep mode).
    enable_sleep_mode: bool | None = None
    # vllm engine: a seed per request, derived from rollout.seed / the step and rank, so
    # rollouts repeat exactly (resume == uninterrupted). vLLM samples seeded requests one
    # by one; false seeds the engine once (verl's behaviour), so a GPU batch samples as
    # one. null: per-request seeds on CPU, engine seed on CUDA.
    request_seeds: bool | None = None


@dataclass
class ToolInstanceConfig:
    class_path: str = MISSING
    params: dict[str, Any] = field(default_factory=dict)


def _default_tools() -> dict[str, ToolInstanceConfig]:
    return {"python": ToolInstanceConfig(class_path="appo.tools.python_tool.PythonTool")}


@dataclass
class ToolsConfig:
    call_limit: int = 3
    max_workers: int = 8
    timeout: float = 30.0
    retry_count: int = 1
    fail_on_error: bool = False
    verbose_logging: bool = False
    tool_instances: dict[str, ToolInstanceConfig] = field(default_factory=_default_tools)
    # Which tool_instances a run uses (None = all of them; [] = no tools at all).
    enabled: list[str] | None = None
    # How calls are written (appo.tools.formats): tags (<python>...</python>, results in
    # <result>; the ARPO family's format) or hermes (Qwen/Hermes native function calling:
    # <tool_call>{json}</tool_call>, tools and results rendered by the chat template).
    format: str = "tags"


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    appo_discount_credit: bool = False
    # APPO branch-credit discount (with appo_discount_credit); the original reads it here.
    reward_scale_discount: float = 0.9
    # gae (PPO with a value model, the `critic` section): discount and GAE lambda per
    # decision token (tool-result tokens are skipped), verl's defaults; gae_whiten whitens
    # the advantages over the batch's loss-mask tokens, as verl always does.
    gamma: float = 1.0
    lam: float = 1.0
    gae_whiten: bool = True


@dataclass
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler: str = "constant"


@dataclass
class FSDPOffloadConfig:
    # verl's `fsdp_config` offload switches (actor.fsdp_config.*), for FSDP2's
    # CPUOffloadPolicy under trainer.parallel=fsdp: parameters (and their gradients) on the
    # CPU between uses; the AdamW states on the CPU. TODO(lead): wire in appo.trainer.fsdp;
    # until then accepted as the original scripts pass them (false) and not acted on.
    param_offload: bool = False
    optimizer_offload: bool = False


@dataclass
class ActorConfig:
    policy_loss: str = "vanilla"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    # AEPO
    entropy_balanced_advantage: bool = False
    entropy_advantage_alpha: float = 0.2
    entropy_clip_scope: str = "all"
    # APPO / FIPO future-KL loss
    future_kl_decay_rate: float = 64.0
    future_kl_clip_high: float = 1.2
    future_kl_clip_high_only: bool = True
    future_kl_safety_thresh: float = 6.0
    future_kl_coef: float = 1.0
    # The original's sequence filter: a response with more than one dual-clip hit (A < 0 and
    # the clipped loss above -A c) leaves the loss and its normaliser (docs/algorithms.md §4.3).
    future_kl_seq_filter: bool = True
    # Update schedule
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 16
    ppo_max_token_len_per_device: int = 4096
    # A memory target (GB) for the update: when set, the micro-batch token budget above is
    # derived from it at start-up (appo.trainer.memory: resident memory, gradients and AdamW
    # states to come, activation bytes per token measured on the model) and replaces it.
    max_memory_gb: float | None = None
    # CPU, with max_memory_gb unset: the update's activations get at most this many GB, so
    # the token budget above shrinks for models whose activations per token are large (the
    # same probe; figures in benchmarks/RESULTS.md). Only the micro-batch split changes
    # (the loss is split-invariant up to rounding). null: off.
    activation_memory_gb: float | None = 1.25
    # Llama-family SwiGLU MLPs save only their gate and up projections for the backward and
    # recompute silu(gate) * up there (appo.trainer.memory): the same gradients, about a
    # quarter less activation memory. Off: the modules' own autograd.
    lean_mlp_activations: bool = True
    # CPU: grouped-query attention through SDPA's own `enable_gqa` instead of transformers'
    # `repeat_kv` expansion under a mask (appo.models.sdpa_gqa; per model, no environment
    # variable): the same forward values, gradients to rounding, fewer saved activations.
    sdpa_gqa: bool = True
    # Outside FSDP, no [V, D] gradient temporary in the update's backward: the LM head adds
    # its weight's gradient into the allocated .grad chunk by chunk, and the input embedding
    # hands back sparse rows that autograd adds into it (appo.trainer.memory). The same
    # gradients summed in another order; with tied embeddings autograd would hold the
    # head's [V, D] gradient until the backward's end. Off: autograd's usual tensors.
    grads_in_place: bool = True
    logprob_chunk_size: int = 128
    # Compute a micro-batch's common prefix (a group's prompt) once in the update forward;
    # exact, and ~n times fewer prompt tokens for groups of n. Off: plain padded forward.
    share_prefix_forward: bool = True
    # With share_prefix_forward: compute the micro-batch's whole token trie once (ARPO/AEPO
    # branches share their parent's response up to the branch point; found from the token
    # ids, any strategy), one model call per trie level. Exact (docs/architecture.md).
    tree_forward: bool = False
    # Keep the token embeddings (and a tied LM head) fixed: Adam moves every vocabulary row
    # each step otherwise, which small models feel (e.g. the end-of-turn token drifts).
    freeze_embeddings: bool = False
    grad_clip: float = 1.0
    # With model.dtype bfloat16: keep the trained weights and AdamW states in float32 and
    # run the training forwards in bfloat16 (autocast), as verl's FSDP actor does; the
    # rollout engine (vllm) still runs in bfloat16. False: train the bfloat16 weights in
    # place (small updates such as lr 1e-6 steps then mostly round away).
    fp32_master_weights: bool = True
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPOffloadConfig = field(default_factory=FSDPOffloadConfig)


@dataclass
class CriticModelConfig:
    # Any appo.models spec for the value model's backbone; null: model.path (the policy's).
    path: str | None = None


@dataclass
class CriticConfig:
    """The value model of algorithm.adv_estimator=gae (built only then): a backbone with a
    fresh scalar head, trained with verl's clipped value loss after each rollout."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cliprange_value: float = 0.5
    # null: the actor's value (actor.ppo_epochs, actor.ppo_mini_batch_size, ...)
    ppo_epochs: int | None = None
    ppo_mini_batch_size: int | None = None
    ppo_max_token_len_per_device: int | None = None
    grad_clip: float = 1.0


@dataclass
class TrainerConfig:
    total_epochs: int = 1
    total_steps: int | None = None
    save_freq: int = -1
    test_freq: int = -1
    val_before_train: bool = False
    # The run directory (checkpoints, metrics.jsonl). null: a new runs/appo-YYYYmmdd-HHMMSS
    # per run. A new run refuses a non-empty directory unless overwrite=true (which deletes
    # the old run there); resume=true continues the run in it (appo.trainer.rundir).
    default_local_dir: str | None = None
    rollout_data_dir: str | None = None
    resume: bool = False
    overwrite: bool = False
    # Checkpoints as each rank's shards (torch.distributed.checkpoint) instead of whole
    # states gathered on rank 0: for models whose whole float32 weights and AdamW states do
    # not fit one process's memory. Resumes in any layout and world size; the run's last
    # checkpoint also holds the whole model, `appo export` turns any other into a Hugging
    # Face directory. Not with LoRA (appo.trainer.sharded).
    sharded_checkpoint: bool = False
    # glibc only: allocations of at least this many KB get their own mapping, returned to the
    # system when freed (mallopt M_MMAP_THRESHOLD). glibc's default raises its threshold up
    # to 32 MB as large blocks are freed, after which freed activations stay in the heap as
    # resident high-water. 128 lowers the RL step's peak by ~0.6 GB but every large tensor
    # then maps fresh zeroed pages: the update takes ~30% longer (benchmarks/RESULTS.md), so
    # it is an option (the demo sets it). null: glibc's default.
    mmap_threshold_kb: int | None = None
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    # Under several processes: ddp (gradient all-reduce) or fsdp (sharded, torch FSDP2);
    # auto = fsdp when `accelerate launch` runs an FSDP config, else ddp.
    parallel: str = "auto"
    # On CUDA the trainer plans its memory per GPU at start-up (appo.trainer.plan_run, as
    # `appo plan` prints it) and refuses a run predicted not to fit; true starts it anyway.
    skip_memory_plan: bool = False
    project_name: str = "appo"
    experiment_name: str = "default"
    seed: int = 42


@dataclass
class SFTConfig:
    train_files: list[str] = field(default_factory=lambda: ["synth:arith?split=sft"])
    val_files: list[str] = field(default_factory=list)
    max_length: int = 1024
    mask_tool_results: bool = True
    epochs: int = 1
    batch_size: int = 8
    gradient_accumulation_steps: int = 1
    lr: float = 5e-5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.1
    grad_clip: float = 1.0
    save_freq: int = -1
    max_steps: int | None = None  # stop after this many optimizer steps (None: all epochs)
    output_dir: str | None = None  # null: a new runs/sft-YYYYmmdd-HHMMSS (as trainer.*)
    # A batch's rows run in micro-batches of at most this many tokens (summed row lengths),
    # gradients accumulated: the same step up to float rounding, with activations bounded.
    # null: the whole batch at once (`appo sft`); `appo demo` uses the actor's token budget.
    max_tokens_per_micro_batch: int | None = None


@dataclass
class EvalConfig:
    # The original evaluation's sampling defaults (docs/algorithms.md §8.1).
    k: int = 1
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    repetition_penalty: float = 1.1
    max_response_length: int = 1024
    tool_call_limits: dict[str, int] = field(default_factory=lambda: {"python": 5, "search": 10})
    base_url: str | None = None
    judge_base_url: str | None = None
    judge_model: str | None = None
    out_dir: str = "runs/eval"


@dataclass
class CustomRewardConfig:
    path: str | None = None
    name: str = "compute_score"


@dataclass
class AppoConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    custom_reward_function: CustomRewardConfig = field(default_factory=CustomRewardConfig)


# Keys whose value selects a registered implementation. Kept here as plain tuples so that
# loading a config never imports torch; tests assert they equal the real registries.
CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": ("float32", "bfloat16", "float16", "auto"),
    "model.device": ("auto", "cpu", "cuda"),
    "data.template": ("code_search", "math", "search"),
    "data.overlong": ("skip", "fail"),
    "rollout.name": ("hf", "vllm", "openai", "auto"),
    "trainer.parallel": ("auto", "ddp", "fsdp"),
    "rollout.strategy": ("grpo", "arpo", "aepo", "appo"),
    "rollout.entropy_measure": ("mean", "seed_topk_sum"),
    "rollout.on_limit": ("stop", "notify"),
    "tools.format": ("tags", "hermes"),
    "algorithm.adv_estimator": ("grpo", "rloo", "reinforce_plus_plus", "appo", "gae"),
    "actor.policy_loss": ("vanilla", "entropy_balanced", "future_kl"),
    "actor.loss_agg_mode": (
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
    ),
    "actor.kl_loss_type": ("k1", "k2", "k3", "low_var_kl"),
    "actor.entropy_clip_scope": ("all", "high_entropy"),
    "actor.optim.lr_scheduler": ("constant", "cosine"),
}
LIST_CHOICES: dict[str, tuple[str, ...]] = {
    "trainer.logger": ("console", "jsonl", "tensorboard", "wandb"),
}
