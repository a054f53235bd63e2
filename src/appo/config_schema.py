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

from appo.config_schema_update import (
    ActorConfig,
    CriticConfig,
    CriticModelConfig,
    FSDPOffloadConfig,
    OptimConfig,
)
from appo.registry import ADV_ESTIMATORS, POLICY_LOSSES, STRATEGIES, Names

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
    # Weights' dtype; bfloat16 trains float32 master weights with bfloat16 forwards
    # (actor.fp32_master_weights). auto: bfloat16 on CUDA, else float32.
    dtype: str = "float32"
    # auto: cuda when a GPU is available, else cpu.
    device: str = "auto"
    # Recompute each layer's activations in the backward instead of keeping them: less
    # memory, a slower update.
    enable_gradient_checkpointing: bool = False
    # Let a Hugging Face model directory run its own modelling code (transformers'
    # trust_remote_code).
    trust_remote_code: bool = False
    # LoRA through PEFT (appo.models.lora), verl's keys: lora_rank 0 trains every weight
    # (full fine-tuning); > 0 trains a rank-r adapter on target_modules ("all-linear": every
    # linear layer but the LM head, or a list such as [q_proj,v_proj]), scaled by
    # lora_alpha / lora_rank. The KL reference is the base model (adapter off); rollouts
    # sample from merged weights. Checkpoints hold the adapter in PEFT's format, plus a
    # merged Hugging Face model in `merged/` when lora_save_merged is true.
    lora_rank: int = 0
    # LoRA scale numerator: the adapter's output is scaled by lora_alpha / lora_rank.
    lora_alpha: float = 16.0
    # The modules a LoRA adapter wraps: "all-linear" or a list of module names.
    target_modules: Any = "all-linear"
    # Dropout on the LoRA adapter's input during training.
    lora_dropout: float = 0.0
    # Checkpoints of a LoRA run also hold the merged Hugging Face model in `merged/`.
    lora_save_merged: bool = False


@dataclass
class DataConfig:
    # Files (parquet / jsonl / HF datasets dir) or a synthetic task spec such as
    # "synth:arith?levels=2,3&n=512" (see appo.data).
    train_files: list[str] = field(default_factory=lambda: ["synth:arith"])
    # Held-out data for training-time validation (trainer.test_freq,
    # trainer.val_before_train); same forms as train_files.
    val_files: list[str] = field(default_factory=lambda: ["synth:arith?split=eval"])
    # The column holding the prompt (a chat list, or a question string) in file data.
    prompt_key: str = "prompt"
    # The prompt template (appo.data.templates): the system prompt naming the tools and the
    # answer format.
    template: str = "math"
    # Append APPO's paragraph asking the model to mark its reasoning stages with
    # <|extra_0|>...<|extra_1|> to every system prompt, as the original APPO rollout did
    # (appo.data.templates.APPO_STAGE_PROMPT); the published APPO configs turn it on.
    appo_stage_prompt: bool = False
    # Prompts per RL step; each is rolled out into rollout.n trajectories.
    train_batch_size: int = 4
    # Held-out prompts rolled out at once by training-time evaluation (validation, the
    # demo's stages): their KV cache lives together, so this bounds evaluation's memory
    # (32: the demo's training rollout holds as many rows; benchmarks/RESULTS.md).
    val_batch_size: int = 32
    # Prompt tokens allowed (after the chat template); longer prompts go by data.overlong.
    max_prompt_length: int = 512
    # Response tokens per trajectory (model and tool-result tokens together); a row is cut
    # there.
    max_response_length: int = 384
    # A prompt over max_prompt_length: skip (drop it, counted) or fail (stop with an error
    # naming it).
    overlong: str = "skip"
    # Shuffle the training prompts each epoch (with data.seed).
    shuffle: bool = True
    # Seed of the prompt order and of synthetic tasks.
    seed: int = 42


@dataclass
class RolloutConfig:
    # hf (in-process, default), vllm (in-process vllm.LLM), openai (servers, base_urls), or
    # auto: vllm where it is installed and finishes this run's rollouts sooner, else hf
    # (appo.rollout.auto: measured rule table, vLLM's start-up counted on CPU)
    name: str = "hf"
    # How trajectories are sampled: grpo (n independent rows), arpo (entropy-triggered
    # branching after tool calls), aepo (arpo with entropy pre-monitoring and branch
    # penalty), appo (tree search over branch points); docs/algorithms.md §2.
    strategy: str = "arpo"
    n: int = 16  # the ARPO paper (docs/algorithms.md §2.2); the CPU demo uses 8
    # arpo/aepo/appo: rows started per prompt before branching fills the group up to n.
    initial_rollouts: int = 8
    # Branches tried per row at a branch point (up to beam_size - 1 copies;
    # docs/algorithms.md arpo.4).
    beam_size: int = 2
    # arpo: base probability of branching after a tool result, raised by entropy_weight
    # times the entropy rise.
    branch_probability: float = 0.5
    # arpo: how much a rise of the segment's entropy over the row's initial entropy raises
    # the branch probability.
    entropy_weight: float = 0.2
    # Tokens over which a segment's entropy is measured (arpo.2).
    entropy_window: int = 20
    # The original's measure (top-10 proxy summed over the window / ln|V|): the scale
    # entropy_weight and AEPO's beta were tuned on (docs/algorithms.md arpo.2); `mean`:
    # mean full-vocabulary token entropy.
    entropy_measure: str = "seed_topk_sum"
    # Sampling temperature of training rollouts (0: greedy).
    temperature: float = 1.0
    # Nucleus sampling mass (1: off).
    top_p: float = 1.0
    # Sample from the k most likely tokens (-1 or 0: off).
    top_k: int = -1
    # Penalty on tokens already in the context (1: off).
    repetition_penalty: float = 1.0
    # How a tool result is appended to the response ({text}: the result), in the tags
    # format.
    result_template: str = " <result>\n{text}\n</result>"
    # A tool call past tools.call_limit: notify (not run, the model is told the limit is
    # reached) or stop (the row ends, the original's behaviour).
    on_limit: str = "notify"
    # aepo: entropy pre-monitoring and m = f(H_root - H_tool) initial rows (aepo.1-2). Off: fixed
    # initial_rollouts with the AEPO branch rule and penalty, as both released AEPO scripts ran.
    enable_dynamic_rollouts: bool = True
    # aepo: tokens sampled for the entropy pre-monitoring before the initial rows are
    # chosen.
    initial_entropy_tokens: int = 50
    # aepo: how strongly the root-vs-tool entropy gap sets the number of initial rows
    # (aepo.1-2).
    beta: float = 0.5
    # aepo: lowers the branch probability of a row for each branch already taken from it
    # (aepo.3).
    branch_penalty: float = 0.05
    # aepo: keep the pre-monitoring trajectory as one of the initial rows (appo's option).
    reuse_premonitor: bool = False
    # appo: discount of the log-ratio sum behind the future value that ranks branch points
    # (appo.2).
    appo_gamma: float = 1.0
    # appo: the future value is clipped to [1 - future_value_clip, 1 + future_value_clip]
    # (appo.2).
    future_value_clip: float = 0.2
    # Branch points: the original excludes whitespace-only tokens; true also excludes
    # punctuation-only ones (appo's option, docs/algorithms.md appo.3).
    appo_skip_punctuation: bool = False
    # A row whose |logp_current - logp_rollout| all stay within this is on-policy up to
    # recompute noise (FV = 1): appo ranks its branch points by entropy. null: by the
    # scoring model's dtype (float32 1e-3, float16 0.25, bfloat16 2.0: measured recompute
    # noise times 5-25; appo.rollout.scoring.LR_NOISE_TOL).
    lr_noise_tol: float | None = None
    # vllm engine: share of the GPU's memory the engine may take (weights and KV cache).
    gpu_memory_utilization: float = 0.7
    # KV cache size in GiB (vLLM's kv_cache_memory_bytes); null: 2 on CPU (vLLM would
    # otherwise reserve most of the RAM), gpu_memory_utilization decides on GPUs
    kv_cache_gib: float | None = None
    # openai engine (server mode): the servers' base URLs (e.g. vllm serve processes), rows
    # spread over them by prompt group; after each update the policy goes to every server
    # (vLLM dev mode) as weight_transfer says: broadcast, or saved to weights_dir and
    # reloaded by the server
    base_urls: list[str] = field(default_factory=list)
    # openai engine: where the policy is saved after each update for the servers to reload;
    # null: <trainer.default_local_dir>/rollout_weights.
    weights_dir: str | None = None
    # openai engine: how the policy reaches the servers after each update. group: broadcast
    # through a process group with the server's workers (gloo on CPU, NCCL on GPUs; the
    # server runs --worker-extension-cls appo.rollout.weight_group.WeightGroupExtension),
    # no file; file: saved to weights_dir and reloaded by each server; auto: group for a
    # server on this machine that has the extension, file otherwise.
    weight_transfer: str = "auto"
    # vllm engine: GPUs one engine spans (tensor parallelism).
    tensor_model_parallel_size: int = 1
    # vllm engine: reuse the KV cache of shared prefixes (a group's prompt, a branch's
    # parent) across requests.
    enable_prefix_caching: bool = True
    # hf engine on CPU: the dtype of the weight copies its matmuls read (every projection
    # and the LM head, prefill and decode). bfloat16: half the bytes per decode step,
    # oneDNN's bf16 kernels (inputs rounded to bfloat16, float32 accumulation); needs a CPU
    # with avx512_bf16 or amx_bf16 and a float32 model. Norms, attention, the KV cache and
    # sampling stay float32; behaviour log-probs then differ from the float32 trainer's
    # (benchmarks/RESULTS.md, "bfloat16 decode weights"). float32: the model's own weights.
    cpu_weights: str = "float32"
    # The rollout engine's base sampling seed (appo rollout --seed); training steps seed
    # their rollouts from trainer.seed and the step.
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
    # The tool's class, importable (module.Class), e.g. appo.tools.python_tool.PythonTool.
    class_path: str = MISSING
    # Keyword arguments for the tool's class.
    params: dict[str, Any] = field(default_factory=dict)


def _default_tools() -> dict[str, ToolInstanceConfig]:
    return {"python": ToolInstanceConfig(class_path="appo.tools.python_tool.PythonTool")}


@dataclass
class ToolsConfig:
    # Tool calls allowed per trajectory; a call past it goes by rollout.on_limit.
    call_limit: int = 3
    # Tool calls run in parallel (threads) within a rollout round.
    max_workers: int = 8
    # Seconds one tool call may run before it is stopped (its result then says so).
    timeout: float = 30.0
    # Retries of a tool call that failed or returned nothing.
    retry_count: int = 1
    # Stop the run when this many calls of one tool in a row end in an infrastructure
    # failure after their retries (a search server or page summariser that is down, a sandbox
    # that cannot start): the model would otherwise train on error texts. null: never stop.
    infra_failure_limit: int | None = 16
    # A tool that cannot be built stops the run; false: it is left out with a warning.
    fail_on_error: bool = False
    # Accepted as the original configs pass it; appo does not read it.
    verbose_logging: bool = False
    # The tools a run can use, by name: each a class_path and params (default: the python
    # sandbox).
    tool_instances: dict[str, ToolInstanceConfig] = field(default_factory=_default_tools)
    # Which tool_instances a run uses (None = all of them; [] = no tools at all).
    enabled: list[str] | None = None
    # How calls are written (appo.tools.formats): tags (<python>...</python>, results in
    # <result>; the ARPO family's format) or hermes (Qwen/Hermes native function calling:
    # <tool_call>{json}</tool_call>, tools and results rendered by the chat template).
    format: str = "tags"


@dataclass
class AlgorithmConfig:
    # How advantages are computed from rewards: grpo, rloo, reinforce_plus_plus (group
    # baselines), appo (tree credit), gae (a value model: the critic section);
    # docs/algorithms.md §3.
    adv_estimator: str = "grpo"
    # Divide group-relative advantages by the group's standard deviation (false: Dr.GRPO).
    norm_adv_by_std: bool = True
    # appo estimator: give initial rows a discounted share of their branches' credit
    # (reward_scale_discount).
    appo_discount_credit: bool = False
    # APPO branch-credit discount (with appo_discount_credit); the original reads it here.
    reward_scale_discount: float = 0.9
    # gae (PPO with a value model, the `critic` section): discount and GAE lambda per
    # decision token (tool-result tokens are skipped), verl's defaults; gae_whiten whitens
    # the advantages over the batch's loss-mask tokens, as verl always does.
    gamma: float = 1.0
    # GAE lambda (gae estimator).
    lam: float = 1.0
    # Whiten GAE advantages over the batch's loss-mask tokens.
    gae_whiten: bool = True


@dataclass
class TrainerConfig:
    # Passes over the training prompts (when total_steps is null).
    total_epochs: int = 1
    # RL steps to run; null: total_epochs passes over the data.
    total_steps: int | None = None
    # Save a checkpoint every this many steps (-1 or 0: only at the end).
    save_freq: int = -1
    # Validate on data.val_files every this many steps (-1 or 0: off).
    test_freq: int = -1
    # Validate once before the first step (logged as step 0).
    val_before_train: bool = False
    # The run directory (checkpoints, metrics.jsonl). null: a new runs/appo-YYYYmmdd-HHMMSS
    # per run. A new run refuses a non-empty directory unless overwrite=true (which deletes
    # the old run there); resume=true continues the run in it (appo.trainer.rundir).
    default_local_dir: str | None = None
    # Write each step's trajectories to <dir>/step_N.jsonl (null: off).
    rollout_data_dir: str | None = None
    # Continue the run in default_local_dir from its last checkpoint.
    resume: bool = False
    # A new run may delete an old run in default_local_dir (or sft.output_dir).
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
    # Where `mmap_threshold_kb` holds: `process` (everywhere, from start-up) or
    # `except_forward` (everywhere but the update's, critic's and SFT's forward passes,
    # whose blocks under 32 MB come from the heap that the next micro-batch's forward
    # reuses). `except_forward` keeps most of the update's speed at a small cost in peak
    # memory (benchmarks/RESULTS.md).
    mmap_threshold_scope: str = "process"
    # Where metrics go: console, jsonl (metrics.jsonl), tensorboard, wandb.
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    # Under several processes: ddp (gradient all-reduce) or fsdp (sharded, torch FSDP2);
    # auto = fsdp when `accelerate launch` runs an FSDP config or several processes run on
    # CUDA, else ddp.
    parallel: str = "auto"
    # On CUDA the trainer plans its memory per GPU at start-up (appo.trainer.plan_run, as
    # `appo plan` prints it) and refuses a run predicted not to fit; true starts it anyway.
    skip_memory_plan: bool = False
    # Accepted as verl's configs pass it; appo does not read it (wandb's project:
    # WANDB_PROJECT).
    project_name: str = "appo"
    # The run's name for wandb.
    experiment_name: str = "default"
    # Seed of the run: torch and Python's random at start-up (a LoRA adapter's or a critic
    # head's initialisation), and each RL step's rollout seed (with the step number).
    seed: int = 42


@dataclass
class SFTConfig:
    # Trajectories to imitate: files or a synthetic spec (appo.data.sft).
    train_files: list[str] = field(default_factory=lambda: ["synth:arith?split=sft"])
    # Held-out trajectories; their loss is logged as sft/eval_loss.
    val_files: list[str] = field(default_factory=list)
    # Tokens per example; a longer one is skipped (counted) or, with data.overlong=fail,
    # stops the run.
    max_length: int = 1024
    # Leave tool-result tokens out of the loss (the original trained on them).
    mask_tool_results: bool = True
    # Passes over the training examples (when max_steps is null).
    epochs: int = 1
    # Examples per batch.
    batch_size: int = 8
    # Batches per optimizer step.
    gradient_accumulation_steps: int = 1
    # AdamW learning rate.
    lr: float = 5e-5
    # AdamW weight decay.
    weight_decay: float = 0.0
    # AdamW's implementation, as actor.optim.fused: null picks torch's fused kernel on the
    # CPU (the same update up to float rounding).
    fused: bool | None = None
    # Share of the optimizer steps with a linear learning-rate warm-up.
    warmup_ratio: float = 0.1
    # Clip the gradient's global norm to this (inf: no clipping).
    grad_clip: float = 1.0
    # Save a checkpoint every this many optimizer steps (-1 or 0: only at the end).
    save_freq: int = -1
    max_steps: int | None = None  # stop after this many optimizer steps (None: all epochs)
    output_dir: str | None = None  # null: a new runs/sft-YYYYmmdd-HHMMSS (as trainer.*)
    # A batch's rows run in micro-batches of at most this many tokens (summed row lengths),
    # gradients accumulated: the same step up to float rounding, with activations bounded.
    # null: the whole batch at once (`appo sft`); `appo demo` uses the actor's token budget.
    max_tokens_per_micro_batch: int | None = None


@dataclass
class EvalConfig:
    # Answers sampled per question (pass@k). The sampling defaults below are the original
    # evaluation's (docs/algorithms.md §8.1).
    k: int = 1
    # Sampling temperature (0: greedy).
    temperature: float = 0.6
    # Nucleus sampling mass.
    top_p: float = 0.95
    # Sample from the k most likely tokens (-1 or 0: off).
    top_k: int = 20
    # Penalty on tokens already in the context (1: off).
    repetition_penalty: float = 1.1
    # Response tokens per answer.
    max_response_length: int = 1024
    # Tool calls allowed per answer, by tool name.
    tool_call_limits: dict[str, int] = field(default_factory=lambda: {"python": 5, "search": 10})
    # An OpenAI-compatible server to evaluate (appo eval --base-url); null: the model in-
    # process.
    base_url: str | None = None
    # An OpenAI-compatible server of the LLM judge for QA benchmarks; null: no judge.
    judge_base_url: str | None = None
    # The judge's model name on that server.
    judge_model: str | None = None
    # Where appo eval writes its per-benchmark results.
    out_dir: str = "runs/eval"


@dataclass
class CustomRewardConfig:
    # A Python file with your reward function; null: the built-in reward of each row's
    # data_source.
    path: str | None = None
    # The function's name in that file; with no path, a registered reward function's name
    # (appo.register_reward, a --plugin module; or a built-in: math, qa, deep_research),
    # which then scores every row.
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


# Keys whose value selects a registered implementation: plain tuples, or a registry's live
# names (`Names`, torch-free) where a user may register more; tests assert the tuples equal
# the real tables.
CHOICES: dict[str, tuple[str, ...] | Names] = {
    "model.dtype": ("float32", "bfloat16", "float16", "auto"),
    "model.device": ("auto", "cpu", "cuda"),
    "data.template": ("code_search", "math", "search"),
    "data.overlong": ("skip", "fail"),
    "rollout.name": ("hf", "vllm", "openai", "auto"),
    "trainer.parallel": ("auto", "ddp", "fsdp"),
    "trainer.mmap_threshold_scope": ("process", "except_forward"),
    "actor.cpu_matmul": ("auto", "torch", "onednn"),
    # The registry itself (built-ins and strategies registered at run time; torch-free).
    "rollout.strategy": Names(STRATEGIES),
    "rollout.entropy_measure": ("mean", "seed_topk_sum"),
    "rollout.on_limit": ("stop", "notify"),
    "rollout.weight_transfer": ("auto", "file", "group"),
    "rollout.cpu_weights": ("float32", "bfloat16"),
    "tools.format": ("tags", "hermes"),
    # Registries too (appo.registry; their built-ins are appo.algos' tables).
    "algorithm.adv_estimator": Names(ADV_ESTIMATORS),
    "actor.policy_loss": Names(POLICY_LOSSES),
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
