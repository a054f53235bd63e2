"""The config schema's update sections: the actor (policy loss, update schedule, memory
options, optimizer), and the critic of `algorithm.adv_estimator=gae`. Part of
`appo.config_schema` (which re-exports every class here), kept apart so that each module
stays readable: the comment above each field is its entry in docs/reference/config.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class OptimConfig:
    # AdamW learning rate.
    lr: float = 1e-5
    # AdamW weight decay.
    weight_decay: float = 0.0
    # AdamW betas (beta1, beta2).
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    # AdamW's implementation (the same update up to float rounding): null picks torch's
    # fused kernel for a model on the CPU (not under FSDP), torch's default elsewhere;
    # true / false force it (appo.trainer.optim).
    fused: bool | None = None
    # Share of the run's steps with a linear learning-rate warm-up from 0.
    lr_warmup_steps_ratio: float = 0.0
    # After warm-up: constant, or cosine decay to 0 at the last step.
    lr_scheduler: str = "constant"


@dataclass
class FSDPOffloadConfig:
    # verl's `fsdp_config` offload switches (actor.fsdp_config.*), for FSDP2's
    # CPUOffloadPolicy under trainer.parallel=fsdp: parameters (and their gradients) on the
    # CPU between uses; the AdamW states on the CPU. TODO(lead): wire in appo.trainer.fsdp;
    # until then accepted as the original scripts pass them (false) and not acted on.
    param_offload: bool = False
    # See param_offload: the AdamW states on the CPU (not acted on yet).
    optimizer_offload: bool = False


@dataclass
class ActorConfig:
    # The policy loss: vanilla (PPO clip with dual clip), entropy_balanced (AEPO's gradient-
    # keeping clip), future_kl (APPO, after FIPO); docs/algorithms.md §4.
    policy_loss: str = "vanilla"
    # PPO clip: the ratio is clipped below at 1 - clip_ratio_low.
    clip_ratio_low: float = 0.2
    # PPO clip: the ratio is clipped above at 1 + clip_ratio_high.
    clip_ratio_high: float = 0.2
    # Dual clip: for negative advantages the loss is bounded by -A * clip_ratio_c.
    clip_ratio_c: float = 3.0
    # How token losses become the batch loss: token-mean over all tokens, or per sequence
    # then over sequences (docs/algorithms.md §4.5).
    loss_agg_mode: str = "token-mean"
    # Weight of an entropy bonus in the loss (0: none).
    entropy_coeff: float = 0.0
    # Add a KL penalty to the reference policy (the initial model) to the loss.
    use_kl_loss: bool = False
    # Weight of the KL penalty (with use_kl_loss).
    kl_loss_coef: float = 0.0
    # KL estimator of the penalty: k1, k2, k3, or low_var_kl (k3 clipped, verl's).
    kl_loss_type: str = "low_var_kl"
    # AEPO: scale each token's advantage by 1 + entropy_advantage_alpha * z(entropy)
    # (docs/algorithms.md §4.2).
    entropy_balanced_advantage: bool = False
    # AEPO: alpha of the entropy-balanced advantage.
    entropy_advantage_alpha: float = 0.2
    # entropy_balanced loss: the gradient-keeping clip on all tokens or only above-mean-
    # entropy ones.
    entropy_clip_scope: str = "all"
    # APPO / FIPO future-KL loss: half-life in tokens of the future-KL sum's decay.
    future_kl_decay_rate: float = 64.0
    # future_kl: upper bound of the future-KL influence factor.
    future_kl_clip_high: float = 1.2
    # future_kl: lower bound 1 (true) or 2 - future_kl_clip_high (false).
    future_kl_clip_high_only: bool = True
    # future_kl: for negative advantages with a ratio above this, the factor is clipped to
    # [0.8, 1].
    future_kl_safety_thresh: float = 6.0
    # future_kl: weight of the future-KL term.
    future_kl_coef: float = 1.0
    # The original's sequence filter: a response with more than one dual-clip hit (A < 0 and
    # the clipped loss above -A c) leaves the loss and its normaliser (docs/algorithms.md §4.3).
    future_kl_seq_filter: bool = True
    # Update schedule: passes over the step's trajectories.
    ppo_epochs: int = 1
    # Prompts per optimizer step (each with its rollout.n trajectories); a step's batch
    # gives train_batch_size / ppo_mini_batch_size optimizer steps per epoch.
    ppo_mini_batch_size: int = 16
    # Micro-batch token budget: rows are packed into micro-batches of at most this many
    # tokens, gradients accumulated.
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
    # Tokens per chunk when log-probs are computed from the LM head (bounds the [tokens,
    # vocab] logits held at once).
    logprob_chunk_size: int = 128
    # Compute a micro-batch's common prefix (a group's prompt) once in the update forward;
    # exact, and ~n times fewer prompt tokens for groups of n. Off: plain padded forward.
    share_prefix_forward: bool = True
    # With share_prefix_forward: compute the micro-batch's whole token trie once (ARPO/AEPO
    # branches share their parent's response up to the branch point; found from the token
    # ids, any strategy), one model call per trie level. Exact (docs/architecture.md).
    # Pays where compute is the cost (CPU); on a GPU at small micro-batches the extra calls'
    # kernel launches cost more than the tokens saved (docs/training.md).
    tree_forward: bool = False
    # The training forward's and backward's linear layers on CPU (the update, its log-prob
    # passes, SFT, the critic): torch (MKL), onednn (torch's oneDNN: MKL stays on AVX2
    # kernels on AMD CPUs), or auto: onednn where the decode rule uses it (AMD with
    # AVX-512, float32, not FSDP). appo.trainer.cpu_linear.
    cpu_matmul: str = "auto"
    # Keep the token embeddings (and a tied LM head) fixed: Adam moves every vocabulary row
    # each step otherwise, which small models feel (e.g. the end-of-turn token drifts).
    freeze_embeddings: bool = False
    # Clip the gradient's global norm to this (inf: no clipping).
    grad_clip: float = 1.0
    # Skip the optimizer and scheduler step of a mini-batch whose advantages are all 0 (no
    # learning signal, e.g. every answer of every group scored alike): AdamW's moments
    # would still move the weights at grad norm 0. Counted as actor/skipped_steps; its
    # KL and entropy terms are skipped with it. False: step anyway, as verl does.
    skip_zero_advantage_steps: bool = False
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
    # Clipped value loss: the new value may move this far from the old before the clip
    # applies.
    cliprange_value: float = 0.5
    # null: actor.ppo_epochs (each of these three: null takes the actor's value).
    ppo_epochs: int | None = None
    # null: actor.ppo_mini_batch_size.
    ppo_mini_batch_size: int | None = None
    # null: actor.ppo_max_token_len_per_device.
    ppo_max_token_len_per_device: int | None = None
    # Clip the critic gradient's global norm to this (inf: no clipping).
    grad_clip: float = 1.0
