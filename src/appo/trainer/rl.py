"""The RL loop (GRPO / ARPO / AEPO / APPO), readable top to bottom.

One step:
    prompts -> rollout (strategy + engine + tools) -> rewards -> advantages
    -> reference log-probs (only with a KL term) -> old log-probs (only when the update is
       off-policy: more than one PPO epoch or mini-batch)
    -> `ppo_epochs` x mini-batches of `ppo_mini_batch_size` prompts -> micro-batches by
       token budget -> optimizer step -> metrics, rollout dump, checkpoint, validation.

Deviations from the original (verl) and why:
- The rollout engine shares the policy's weights in memory (hf engine), so there is no
  weight sync between a trainer and an inference server on CPU.
- With one PPO epoch and one mini-batch, old log-probs are the detached current log-probs
  of the update's own forward (ratio 1 exactly): the separate no-grad pass verl runs would
  compute the same numbers.
- Data parallelism (under `accelerate launch`): each rank rolls out its share of the
  prompts, trajectories are gathered so group advantages see whole groups, each rank
  trains on the rows it generated, and gradients are all-reduced once per optimizer step
  (loss normalisers are global, so the update equals the single-process one). FSDP is not
  wired here.
- All per-step randomness (sampling, branch decisions) is derived from (seed, step), so a
  resumed run repeats an uninterrupted one bit for bit on CPU.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import math
import random
import resource
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from appo.algos import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageParams,
    BranchTree,
    LossAgg,
    PolicyLossParams,
    entropy_aware_advantage,
    entropy_bonus,
    kl_loss,
    token_logprobs_and_entropy,
)
from appo.errors import AppoError
from appo.trainer.batching import pad_right
from appo.trainer.forward import final_hidden_states, plan_shared_microbatches
from appo.trainer.fsdp import (
    fsdp_requested,
    full_model_state,
    full_optimizer_state,
    idle_step,
    load_full_states,
    shard_model,
    to_float,
)

# ----------------------------------------------------------------------------- records


@dataclass
class PolicyRows:
    """Trajectories flattened for the update; response-aligned per-token lists.

    `old_logp` / `ref_logp` are filled by the trainer when needed (None otherwise).
    """

    input_ids: list[list[int]]
    prompt_lens: list[int]
    loss_mask: list[list[int]]
    advantages: list[list[float]]
    uids: list[str]
    old_logp: list[list[float]] | None = None
    ref_logp: list[list[float]] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def response_len(self, i: int) -> int:
        return len(self.loss_mask[i])

    def subset(self, idx: list[int]) -> PolicyRows:
        pick = lambda xs: None if xs is None else [xs[i] for i in idx]  # noqa: E731
        return PolicyRows(
            input_ids=pick(self.input_ids),
            prompt_lens=pick(self.prompt_lens),
            loss_mask=pick(self.loss_mask),
            advantages=pick(self.advantages),
            uids=pick(self.uids),
            old_logp=pick(self.old_logp),
            ref_logp=pick(self.ref_logp),
        )


@dataclass
class UpdateSettings:
    """What the update reads from `actor.*`, `algorithm.*` and `data.*`."""

    policy_loss: str = "vanilla"
    loss_params: PolicyLossParams = field(default_factory=PolicyLossParams)
    loss_agg_mode: str = "token-mean"
    max_response_length: int = 384
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    entropy_balanced_advantage: bool = False
    entropy_advantage_alpha: float = 0.2
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 16  # prompts per mini-batch, as in verl
    max_token_len: int = 4096
    chunk_size: int = 128
    grad_clip: float = 1.0
    share_prefix: bool = True
    # FSDP: every rank runs the same number of forward/backward passes (idle ones if it has
    # fewer micro-batches) and FSDP itself reduces the gradients.
    lockstep: bool = False

    @classmethod
    def from_config(cls, cfg: Any) -> UpdateSettings:
        a = cfg.actor
        return cls(
            policy_loss=a.policy_loss,
            loss_params=PolicyLossParams(
                clip_low=a.clip_ratio_low,
                clip_high=a.clip_ratio_high,
                clip_c=a.clip_ratio_c,
                entropy_clip_scope=a.entropy_clip_scope,
                future_kl_decay_rate=a.future_kl_decay_rate,
                future_kl_clip_high=a.future_kl_clip_high,
                future_kl_clip_high_only=a.future_kl_clip_high_only,
                future_kl_safety_thresh=a.future_kl_safety_thresh,
                future_kl_coef=a.future_kl_coef,
            ),
            loss_agg_mode=a.loss_agg_mode,
            max_response_length=cfg.data.max_response_length,
            entropy_coeff=a.entropy_coeff,
            kl_coef=a.kl_loss_coef if a.use_kl_loss else 0.0,
            kl_type=a.kl_loss_type,
            entropy_balanced_advantage=a.entropy_balanced_advantage,
            entropy_advantage_alpha=a.entropy_advantage_alpha,
            ppo_epochs=a.ppo_epochs,
            ppo_mini_batch_size=a.ppo_mini_batch_size,
            max_token_len=a.ppo_max_token_len_per_device,
            chunk_size=a.logprob_chunk_size,
            grad_clip=a.grad_clip,
            share_prefix=a.share_prefix_forward,
        )

    @property
    def needs_old_logp(self) -> bool:
        return self.ppo_epochs > 1


# ----------------------------------------------------------------------------- distributed


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # gloo's worker threads drop a finished collective's tensors after the caller has
    # returned, and dropping a tensor's Python object takes the GIL. A thread that asks for
    # the GIL once finalisation has begun is ended by Python inside that C++ destructor,
    # and std::terminate aborts the rank (seen in a core dump: ~AsyncAllreduceWork ->
    # decref_pyobject -> take_gil -> pthread_exit). Sleeping hands the GIL to any such
    # pending release while the interpreter is still whole.
    time.sleep(0.05)


class DataParallel:
    """Rank / world size and the few collectives the loop needs (no-ops in one process)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.enabled = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.enabled else 0
        self.world = dist.get_world_size() if self.enabled else 1

    @classmethod
    def from_env(cls) -> DataParallel:
        """Join the process group when started by `accelerate launch` / torchrun (WORLD_SIZE,
        RANK, MASTER_ADDR set): nccl with CUDA, gloo on CPU."""
        import os

        import torch.distributed as dist

        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
            # Leave the group while the interpreter is still whole: a process that exits
            # with the group alive tears gloo's worker threads down during finalisation,
            # which now and then aborts a rank ("terminate called without an active
            # exception", SIGABRT) after its work is done.
            atexit.register(_leave_process_group)
        return cls()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def gather_objects(self, items: list) -> list:
        if not self.enabled:
            return list(items)
        parts: list[list] = [None] * self.world  # type: ignore[list-item]
        self.dist.all_gather_object(parts, items)
        return [x for part in parts for x in part]

    def max_int(self, value: int) -> int:
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return int(t.item())

    def sum_floats(self, values: list[float]) -> list[float]:
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        self.dist.all_reduce(t)
        return t.tolist()

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Sum gradients over ranks. Losses carry global normalisers, so the sum is the
        gradient of the global loss (each rank's loss is its share of it)."""
        if not self.enabled:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.dist.all_reduce(p.grad)


# ----------------------------------------------------------------------------- log-probs


def response_logprobs(
    model,
    rows: PolicyRows,
    pad_id: int,
    chunk_size: int,
    with_entropy: bool,
    entropy_grad: bool = False,
    share_prefix: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Current-policy log-prob (and entropy) of every response token of `rows`.

    Returns logp `[b, R]`, entropy `[b, R]` or None, and the response mask `[b, R]` (1 on
    real response tokens), R = longest response. Log-probs come from the final hidden
    states and the lm_head weight in chunks (`appo.algos.token_logprobs_and_entropy`), so
    `[b, T, V]` logits never exist; the model itself computes logits for one position only.
    The rows' common prefix (a group's prompt) is computed once (`appo.trainer.forward`).
    """
    device = next(model.parameters()).device
    ids = pad_right(rows.input_ids, pad_id, torch.long).to(device)
    hidden = final_hidden_states(model, rows.input_ids, pad_id, share_prefix)  # [b, T, D]
    resp_lens = [len(m) for m in rows.loss_mask]
    width = max(resp_lens) if resp_lens else 0
    # Response token j of row i sits at position prompt_len + j and is predicted from the
    # hidden state one position earlier.
    pos = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (p, r) in enumerate(zip(rows.prompt_lens, resp_lens, strict=True)):
        pos[i, :r] = torch.arange(p - 1, p - 1 + r)
        valid[i, :r] = 1
    pos, valid = pos.to(device), valid.to(device)
    gathered = hidden.gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
    targets = ids.gather(1, (pos + 1).clamp(max=ids.shape[1] - 1)) * valid
    head = model.get_output_embeddings()
    logp, entropy = token_logprobs_and_entropy(
        gathered,
        head.weight,
        targets,
        bias=getattr(head, "bias", None),
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
    )
    logp = logp * valid
    if entropy is not None:
        entropy = entropy * valid
    return logp, entropy, valid


@torch.no_grad()
def batched_logprobs(model, rows: PolicyRows, pad_id: int, max_tokens: int,
                     chunk_size: int, share_prefix: bool = True) -> list[list[float]]:
    """No-grad response log-probs for every row (old / reference policy), token-budgeted."""
    result: list[list[float]] = [[] for _ in range(len(rows))]
    plan = plan_shared_microbatches(rows.input_ids, max_tokens, rows.uids, share_prefix)
    for idx in plan.batches:
        logp, _, _ = response_logprobs(model, rows.subset(idx), pad_id, chunk_size, False,
                                       share_prefix=share_prefix)
        for j, i in enumerate(idx):
            result[i] = logp[j, : rows.response_len(i)].float().cpu().tolist()
    return result


# ----------------------------------------------------------------------------- update


def _tensor(rows: list[list[float]], device, dtype=torch.float32) -> torch.Tensor:
    return pad_right(rows, 0, dtype).to(device)


def update_policy(
    model,
    optimizer,
    rows: PolicyRows,
    settings: UpdateSettings,
    pad_id: int,
    dp: DataParallel | None = None,
    scheduler=None,
) -> dict[str, float]:
    """`ppo_epochs` x mini-batches of this rank's rows; one optimizer step per mini-batch.

    Rows with no trainable token (APPO branches) never enter the loss. Mini-batches are
    formed from whole prompt groups (uids) so that every rank agrees on their number.
    """
    dp = dp or DataParallel()
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    trainable = [i for i in range(len(rows)) if sum(rows.loss_mask[i]) > 0]
    uid_order = list(dict.fromkeys(rows.uids))
    per_mb = max(1, settings.ppo_mini_batch_size // dp.world)
    # All ranks run the same number of optimizer steps: as many mini-batches as the rank
    # with the most groups needs.
    n_mini = max(1, dp.max_int(math.ceil(len(uid_order) / per_mb)))
    sums: Counter = Counter()
    padded_total = real_total = rows_total = 0
    model.train()
    for _epoch in range(settings.ppo_epochs):
        for m in range(n_mini):
            mb_uids = set(uid_order[m * per_mb : (m + 1) * per_mb])
            idx = [i for i in trainable if rows.uids[i] in mb_uids]
            mini = rows.subset(idx)
            local_masks = [torch.tensor(x, dtype=torch.float32) for x in mini.loss_mask]
            n_tok = float(sum(float(x.sum()) for x in local_masks))
            n_seq = float(sum(1 for x in local_masks if x.sum() > 0))
            n_tok, n_seq = dp.sum_floats([n_tok, n_seq])
            agg = LossAgg(settings.loss_agg_mode, max(n_tok, 1.0), max(n_seq, 1.0),
                          float(settings.max_response_length))
            plan = plan_shared_microbatches(mini.input_ids, settings.max_token_len, mini.uids,
                                            settings.share_prefix)
            padded_total += plan.padded_tokens
            real_total += plan.real_tokens
            rows_total += plan.rows_tokens
            # FSDP gathers shards in every forward: all ranks must run as many (decided
            # before any of them runs, or the collectives would interleave).
            n_passes = dp.max_int(len(plan.batches)) if settings.lockstep else len(plan.batches)
            optimizer.zero_grad(set_to_none=True)
            for mb_idx in plan.batches:
                mb = mini.subset(mb_idx)
                # FSDP averages gradients over ranks; the sum is wanted (see trainer.fsdp).
                metrics = _micro_step(model, mb, settings, agg, pad_id, device,
                                      loss_scale=float(dp.world) if settings.lockstep else 1.0)
                sums.update(metrics)
            if settings.lockstep:
                for _ in range(n_passes - len(plan.batches)):
                    idle_step(model, pad_id)
            else:
                dp.average_gradients(params)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            sums["actor/grad_norm"] += to_float(grad_norm)
    model.eval()
    # Loss-valued metrics are shares of the mini-batch value (global normalisers): sum them
    # over micro-batches and ranks, then average over optimizer steps.
    if dp.enabled:
        merged: Counter = Counter()
        for part in dp.gather_objects([dict(sums)]):
            merged.update(part)
        grad_sum = sums["actor/grad_norm"]
        sums = merged
        sums["actor/grad_norm"] = grad_sum  # identical on every rank after the all-reduce
        real_total, padded_total, rows_total = dp.sum_floats(
            [float(real_total), float(padded_total), float(rows_total)])
    steps = max(settings.ppo_epochs * n_mini, 1)
    out = {k: v / steps for k, v in sums.items()}
    out["actor/padding_frac"] = 1.0 - real_total / padded_total if padded_total else 0.0
    # Share of the rows' tokens the shared-prefix forward did not have to compute.
    out["actor/prefix_saving"] = 1.0 - padded_total / rows_total if rows_total else 0.0
    out["actor/computed_tokens"] = float(padded_total) / max(settings.ppo_epochs, 1)
    out["actor/optimizer_steps"] = float(steps)
    return out


def _micro_step(model, mb: PolicyRows, s: UpdateSettings, agg: LossAgg, pad_id: int,
                device, loss_scale: float = 1.0) -> dict[str, float]:
    need_entropy = s.entropy_balanced_advantage or s.entropy_coeff != 0 or (
        s.policy_loss == "entropy_balanced" and s.loss_params.entropy_clip_scope == "high_entropy"
    )
    logp, entropy, valid = response_logprobs(
        model, mb, pad_id, s.chunk_size, with_entropy=need_entropy,
        entropy_grad=s.entropy_coeff != 0, share_prefix=s.share_prefix,
    )
    mask = _tensor(mb.loss_mask, device) * valid
    adv = _tensor(mb.advantages, device)
    old = _tensor(mb.old_logp, device) if mb.old_logp is not None else logp.detach()
    metrics: dict[str, float] = {}
    if s.entropy_balanced_advantage:
        adv, m = entropy_aware_advantage(adv, entropy.detach(), mask,
                                         alpha=s.entropy_advantage_alpha)
        metrics.update({f"actor/{k}": v * float(mask.sum()) / agg.n_tokens for k, v in m.items()})
    loss, m = POLICY_LOSSES[s.policy_loss](
        logp, old, adv, mask, agg=agg, params=s.loss_params,
        entropy=None if entropy is None else entropy.detach(),
    )
    metrics.update({f"actor/{k}": v for k, v in m.items()})
    metrics["actor/pg_loss"] = float(loss.detach())
    if s.kl_coef != 0:
        ref = _tensor(mb.ref_logp, device)
        kl, _ = kl_loss(logp, ref, mask, agg=agg, kind=s.kl_type)
        loss = loss + s.kl_coef * kl
        metrics["actor/kl"] = float(kl.detach())
    if entropy is not None:
        ent, _ = entropy_bonus(entropy, mask, agg=agg)
        metrics["actor/entropy"] = float(ent.detach())
        if s.entropy_coeff != 0:
            loss = loss - s.entropy_coeff * ent
    (loss * loss_scale).backward()
    return metrics


# ----------------------------------------------------------------------------- advantages


def compute_advantages(trajs, estimator: str,
                       params: AdvantageParams) -> tuple[list[list[float]], dict[str, float]]:
    """Per-token advantages for every trajectory (response-aligned), grouped by uid.

    Advantages live on `loss_mask=1` tokens only; for `appo` the estimator also needs the
    branch provenance, taken from the trajectories' `parent_id` / `branch_token_index`.
    """
    if not trajs:
        return [], {}
    scores = torch.tensor([float(t.reward) for t in trajs], dtype=torch.float32)
    mask = pad_right([t.loss_mask for t in trajs], 0, torch.float32)
    tree = None
    if estimator == "appo":
        tree = BranchTree.from_ids([t.traj_id for t in trajs], [t.parent_id for t in trajs],
                                   [t.branch_token_index for t in trajs])
    adv, metrics = ADV_ESTIMATORS[estimator](scores, mask, [t.uid for t in trajs],
                                             params=params, tree=tree)
    return [adv[i, : len(t.response_ids)].tolist() for i, t in enumerate(trajs)], metrics


def rows_from_trajectories(trajs, advantages: list[list[float]]) -> PolicyRows:
    return PolicyRows(
        input_ids=[t.prompt_ids + t.response_ids for t in trajs],
        prompt_lens=[len(t.prompt_ids) for t in trajs],
        loss_mask=[list(t.loss_mask) for t in trajs],
        advantages=advantages,
        uids=[t.uid for t in trajs],
    )


# ----------------------------------------------------------------------------- metrics


def rollout_metrics(trajs, outputs, stats) -> dict[str, float]:
    n = max(len(trajs), 1)
    scores = [float(t.reward) for t in trajs]
    mean = sum(scores) / n
    per_tool: Counter = Counter()
    for t in trajs:
        per_tool.update(c.tool for c in t.tool_calls)
    m = {
        "reward/mean": mean,
        "reward/std": (sum((s - mean) ** 2 for s in scores) / n) ** 0.5,
        "reward/accuracy": sum(o.accuracy for o in outputs) / n,
        "reward/format_ok": sum(1.0 for o in outputs if o.format_ok) / n,
        "rollout/trajectories": float(len(trajs)),
        "rollout/branches": float(sum(1 for t in trajs if t.parent_id is not None)),
        "rollout/tool_calls_per_traj": sum(t.num_tool_calls for t in trajs) / n,
        "rollout/response_len": sum(len(t.response_ids) for t in trajs) / n,
        "rollout/truncated_frac": sum(1.0 for t in trajs if t.truncated) / n,
    }
    ents = [e for t in trajs for e, k in zip(t.entropy, t.loss_mask, strict=True) if k]
    if ents:
        m["rollout/entropy"] = sum(ents) / len(ents)
    for tool, count in per_tool.items():
        m[f"rollout/calls_{tool}_per_traj"] = count / n
    if stats is not None:
        m["rollout/tokens_prefilled"] = float(stats.tokens_prefilled)
        m["rollout/tokens_decoded"] = float(stats.tokens_decoded)
        m["rollout/tokens_reused"] = float(stats.tokens_reused)
    return m


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ----------------------------------------------------------------------------- trainer


@dataclass
class StepTimer:
    phases: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def measure(self, name: str):
        timer = self

        class _Ctx:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.phases[name] += time.perf_counter() - self.t0

        return _Ctx()


class RLTrainer:
    """Builds everything from an `AppoConfig` and runs `fit()`."""

    def __init__(self, cfg: Any, lm=None, progress: bool = True):
        from appo.data.rl import rl_data_from_config
        from appo.models import load_model
        from appo.rewards import router_from_config
        from appo.rollout import RolloutSettings, build_engine
        from appo.tools.registry import build_tools
        from appo.trainer.metrics import MetricsLogger

        self.cfg = cfg
        self.dp = DataParallel.from_env()
        self.progress = progress and self.dp.is_main
        self.out_dir = Path(cfg.trainer.default_local_dir)
        torch.manual_seed(cfg.trainer.seed)
        random.seed(cfg.trainer.seed)
        device = cfg.model.device
        if device == "auto" and self.dp.enabled and torch.cuda.is_available():
            device = f"cuda:{self.dp.rank % torch.cuda.device_count()}"
        self.lm = lm or load_model(cfg.model.path, dtype=cfg.model.dtype, device=device)
        self.model = self.lm.model
        self.tokenizer = self.lm.tokenizer
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        if cfg.model.enable_gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.update = UpdateSettings.from_config(cfg)
        self.ref_model = None
        if cfg.actor.freeze_embeddings:
            self.model.get_input_embeddings().requires_grad_(False)
            self.model.get_output_embeddings().requires_grad_(False)
        if self.update.kl_coef != 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        # Under FSDP the engine samples from a whole replica, synced after each update.
        self.fsdp = fsdp_requested(cfg.trainer.parallel, self.dp.enabled)
        self.rollout_model = self.model
        self._rollout_stale = False
        if self.fsdp:
            self.rollout_model = copy.deepcopy(self.model).eval().requires_grad_(False)
            shard_model(self.model, self.dp.world)
            self.update.share_prefix = False
            self.update.lockstep = True
        self.tools = build_tools(cfg.tools)
        train = rl_data_from_config(cfg, "train", self.tokenizer)
        self.train_data = train.examples
        self.val_data = (
            rl_data_from_config(cfg, "val", self.tokenizer).examples
            if cfg.data.val_files else []
        )
        if not self.train_data:
            why = (f": all {train.stats.rows} prompts are longer than data.max_prompt_length="
                   f"{cfg.data.max_prompt_length} (longest {train.stats.longest} tokens)"
                   if train.stats.rows and train.stats.skipped_overlong == train.stats.rows else "")
            raise AppoError(f"data.train_files produced no training prompts{why}")
        self.reward = router_from_config(cfg)
        self.reward.check((e.data_source, e.ability) for e in self.train_data + self.val_data)
        self.engine = build_engine(cfg, dataclasses.replace(self.lm, model=self.rollout_model))
        self.settings = RolloutSettings.from_config(cfg)
        self.adv_params = AdvantageParams(
            norm_adv_by_std=cfg.algorithm.norm_adv_by_std,
            appo_discount_credit=cfg.algorithm.appo_discount_credit,
            reward_scale_discount=cfg.rollout.reward_scale_discount,
        )
        o = cfg.actor.optim
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas),
        )
        self.steps_per_epoch = max(1, len(self.train_data) // cfg.data.train_batch_size)
        self.total_steps = self.steps_per_epoch * cfg.trainer.total_epochs
        if cfg.trainer.total_steps is not None:
            self.total_steps = int(cfg.trainer.total_steps)
        self.scheduler = self._make_scheduler()
        self.step = 0
        if cfg.trainer.resume:
            self._resume()
        self.logger = MetricsLogger(
            self.out_dir, list(cfg.trainer.logger), run_name=cfg.trainer.experiment_name,
            resume=cfg.trainer.resume and self.step > 0, enabled=self.dp.is_main,
        )

    # ------------------------------------------------------------------ setup helpers
    def _make_scheduler(self):
        from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

        o = self.cfg.actor.optim
        mb_per_step = self.update.ppo_epochs * max(
            1, math.ceil(self.cfg.data.train_batch_size / self.update.ppo_mini_batch_size)
        )
        total = self.total_steps * mb_per_step
        warmup = int(o.lr_warmup_steps_ratio * total)
        if o.lr_scheduler == "cosine":
            return get_cosine_schedule_with_warmup(self.optimizer, warmup, total)
        return get_constant_schedule_with_warmup(self.optimizer, warmup)

    def _resume(self) -> None:
        from appo.trainer.checkpoint import latest_checkpoint, load_trainer_state

        path = latest_checkpoint(self.out_dir)
        if path is None:
            return
        from safetensors.torch import load_file

        files = sorted(path.glob("*.safetensors"))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
        trainer_state = load_trainer_state(path)
        saved_fsdp = trainer_state["extra"].get("parallel") == "fsdp"
        if saved_fsdp != self.fsdp:
            raise AppoError(f"checkpoint {path} was written by a {'fsdp' if saved_fsdp else 'ddp'}"
                            f" run; resume it with trainer.parallel="
                            f"{'fsdp' if saved_fsdp else 'ddp'} (optimizer states differ)")
        if self.fsdp:
            self._check_keys(path, *self.rollout_model.load_state_dict(state, strict=False))
            load_full_states(self.model, self.optimizer, self.rollout_model.state_dict(),
                             trainer_state["optimizer"])
        else:
            self._check_keys(path, *self.model.load_state_dict(state, strict=False))
            self.optimizer.load_state_dict(trainer_state["optimizer"])
        self.scheduler.load_state_dict(trainer_state["scheduler"])
        self.step = int(trainer_state["step"])
        if self.dp.is_main:
            print(f"appo: resumed from {path} at step {self.step}")

    @staticmethod
    def _check_keys(path, missing, unexpected) -> None:
        # Tied weights are saved once; anything else missing means a wrong checkpoint.
        tied = {k for k in missing if "lm_head" in k}
        if set(missing) - tied or unexpected:
            raise AppoError(f"checkpoint {path} does not match the model "
                            f"(missing {sorted(set(missing) - tied)[:3]}, "
                            f"unexpected {sorted(unexpected)[:3]})")

    def sync_rollout_weights(self) -> None:
        """FSDP: copy the updated shards into the engine's whole replica (a collective)."""
        if self.fsdp and self._rollout_stale:
            missing, unexpected = self.rollout_model.load_state_dict(
                full_model_state(self.model), strict=False)
            self._check_keys("(fsdp shards)", missing, unexpected)
            self._rollout_stale = False

    # ------------------------------------------------------------------ data order
    def batch_for_step(self, step: int) -> list:
        """The prompts of global step `step` (0-based): epoch permutations from the seed, so
        the data order is a function of the step and resuming needs no extra state."""
        size = self.cfg.data.train_batch_size
        epoch, within = divmod(step, self.steps_per_epoch)
        order = list(range(len(self.train_data)))
        if self.cfg.data.shuffle:
            random.Random(self.cfg.data.seed + epoch).shuffle(order)
        picked = order[within * size : (within + 1) * size]
        return [self.train_data[i] for i in picked]

    def prompts_for(self, examples: list, tag: str) -> list:
        from appo.rollout import RolloutPrompt

        prompts = []
        for i, ex in enumerate(examples):
            ids = self.tokenizer.apply_chat_template(ex.prompt, add_generation_prompt=True,
                                                     tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append(RolloutPrompt(uid=f"{tag}-{i}", prompt_ids=list(ids),
                                         extra={"index": i}))
        return prompts

    # ------------------------------------------------------------------ phases
    def run_rollout(self, examples: list, tag: str, step_seed: int, settings=None,
                    strategy: str | None = None):
        from appo.rollout import rollout
        from appo.rollout.scoring import hf_score_fn

        settings = settings or self.settings
        strategy = strategy or self.cfg.rollout.strategy
        self.sync_rollout_weights()
        prompts = self.prompts_for(examples, tag)
        mine = prompts[self.dp.rank :: self.dp.world]
        if hasattr(self.engine, "generator"):  # hf engine: sampling stream per step and rank
            self.engine.generator.manual_seed(step_seed * 1_000_003 + self.dp.rank)
        rng = random.Random(step_seed * 7919 + self.dp.rank)
        score_fn = (hf_score_fn(self.rollout_model, settings.sampling)
                    if strategy == "appo" else None)
        batch = rollout(mine, self.engine, self.tools, settings, strategy=strategy, rng=rng,
                        score_fn=score_fn)
        return prompts, batch

    def score(self, trajs, examples: list) -> list:
        outputs = []
        for t in trajs:
            ex = examples[t.extra["index"]]
            text = self.tokenizer.decode(t.response_ids, skip_special_tokens=True)
            out = self.reward(ex.data_source, text, ex.ground_truth, ex.extra_info, ex.ability)
            t.reward = float(out.score)
            t.extra.update({"data_source": ex.data_source, "accuracy": float(out.accuracy),
                            "format_ok": bool(out.format_ok), "reason": out.reason})
            outputs.append(out)
        return outputs

    def train_step(self) -> dict[str, float]:
        timer = StepTimer()
        step_seed = self.cfg.trainer.seed * 100_003 + self.step
        examples = self.batch_for_step(self.step)
        with timer.measure("rollout"):
            _, batch = self.run_rollout(examples, f"s{self.step}", step_seed)
        with timer.measure("reward"):
            mine = batch.trajectories
            outputs = self.score(mine, examples)
        # Whole groups are needed for advantages: gather every rank's trajectories.
        everyone = self.dp.gather_objects(mine)
        with timer.measure("advantage"):
            adv_all, adv_metrics = compute_advantages(everyone, self.cfg.algorithm.adv_estimator,
                                                      self.adv_params)
        ids = {t.traj_id for t in mine}
        adv_mine = [a for t, a in zip(everyone, adv_all, strict=True) if t.traj_id in ids]
        for t, a in zip(mine, adv_mine, strict=True):
            k = [x for x, m in zip(a, t.loss_mask, strict=True) if m]
            t.extra["advantage"] = sum(k) / len(k) if k else 0.0
        rows = rows_from_trajectories(mine, adv_mine)
        if self.ref_model is not None:
            with timer.measure("ref_logp"):
                rows.ref_logp = batched_logprobs(self.ref_model, rows, self.pad_id,
                                                 self.update.max_token_len, self.update.chunk_size,
                                                 self.update.share_prefix)
        if self.update.needs_old_logp:
            with timer.measure("old_logp"):
                rows.old_logp = batched_logprobs(self.model, rows, self.pad_id,
                                                 self.update.max_token_len, self.update.chunk_size,
                                                 self.update.share_prefix)
        with timer.measure("update"):
            upd = update_policy(self.model, self.optimizer, rows, self.update, self.pad_id,
                                self.dp, self.scheduler)
        self._rollout_stale = self.fsdp
        all_outputs = self.dp.gather_objects(outputs)
        metrics = rollout_metrics(everyone, all_outputs, batch.stats)
        metrics.update(upd)
        metrics.update({f"adv/{k}": v for k, v in adv_metrics.items()})
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        for name, secs in timer.phases.items():
            metrics[f"time/{name}"] = secs
        metrics["time/step"] = sum(timer.phases.values())
        train_tokens = sum(len(x) for x in rows.input_ids) * self.update.ppo_epochs
        metrics["perf/rollout_tokens_per_s"] = batch.stats.tokens_decoded / max(
            timer.phases["rollout"], 1e-9)
        metrics["perf/train_tokens_per_s"] = train_tokens / max(timer.phases["update"], 1e-9)
        metrics["perf/peak_rss_mb"] = peak_rss_mb()
        self._dump_rollouts(everyone, self.step + 1)
        return metrics

    def _dump_rollouts(self, trajs, step: int) -> None:
        if not self.cfg.trainer.rollout_data_dir or not self.dp.is_main:
            return
        from appo.rollout import write_jsonl

        out = Path(self.cfg.trainer.rollout_data_dir)
        out.mkdir(parents=True, exist_ok=True)
        write_jsonl(trajs, out / f"step_{step:05d}.jsonl", tokenizer=self.tokenizer)

    def validate(self) -> dict[str, float]:
        """pass@1 (mean over `eval.k` samples) and tool statistics on the validation set."""
        from dataclasses import replace

        from appo.rollout.sampling import SamplingParams

        if not self.val_data:
            return {}
        e = self.cfg.eval
        settings = replace(self.settings, n=e.k, initial_rollouts=e.k,
                           sampling=SamplingParams.from_config(e))
        _, batch = self.run_rollout(self.val_data, f"v{self.step}", 10_000_019 + self.step,
                                    settings=settings, strategy="grpo")
        outputs = self.score(batch.trajectories, self.val_data)
        trajs = self.dp.gather_objects(batch.trajectories)
        outputs = self.dp.gather_objects(outputs)
        n = max(len(trajs), 1)
        return {
            "val/pass@1": sum(o.accuracy for o in outputs) / n,
            "val/reward": sum(float(t.reward) for t in trajs) / n,
            "val/tool_calls_per_answer": sum(t.num_tool_calls for t in trajs) / n,
            "val/tool_usage_rate": sum(1.0 for t in trajs if t.num_tool_calls) / n,
            "val/questions": float(len(self.val_data)),
        }

    def save(self) -> Path | None:
        from appo.trainer.checkpoint import save_checkpoint

        extra = {"config": _plain_config(self.cfg), "parallel": "fsdp" if self.fsdp else "ddp"}
        optimizer_state = None
        if self.fsdp:  # gather whole states (collectives: every rank takes part)
            self.sync_rollout_weights()
            optimizer_state = full_optimizer_state(self.model, self.optimizer)
        if not self.dp.is_main:
            return None
        return save_checkpoint(self.out_dir, self.step, self.rollout_model, self.tokenizer,
                               self.optimizer, self.scheduler, extra=extra,
                               optimizer_state=optimizer_state)

    # ------------------------------------------------------------------ the loop
    def fit(self, close: bool = True) -> list[dict[str, float]]:
        """Train to `total_steps`; `close=False` keeps the tools open for more rollouts."""
        from tqdm.auto import tqdm

        t = self.cfg.trainer
        history: list[dict[str, float]] = []
        if t.val_before_train and self.step == 0:
            val = self.validate()
            self.logger.log(0, val, console_keys=sorted(val))
            history.append({"step": 0, **val})
        bar = tqdm(total=self.total_steps, initial=self.step, desc="rl", disable=not self.progress,
                   leave=False)
        while self.step < self.total_steps:
            metrics = self.train_step()
            self.step += 1
            if t.test_freq > 0 and self.step % t.test_freq == 0:
                metrics.update(self.validate())
            self.logger.log(self.step, metrics, console_keys=CONSOLE_KEYS)
            history.append({"step": self.step, **metrics})
            if t.save_freq > 0 and self.step % t.save_freq == 0:
                self.save()
            bar.update(1)
        bar.close()
        if self.step > 0 and (t.save_freq <= 0 or self.step % t.save_freq != 0):
            self.save()
        if self.dp.is_main and "jsonl" in t.logger and self.logger.path.exists():
            from appo.trainer.metrics import plot_metrics

            plot_metrics(self.logger.path, PLOT_KEYS, self.out_dir / "plots")
        self.logger.close()
        if close:
            self.tools.close()
        return history


CONSOLE_KEYS = ["reward/mean", "reward/accuracy", "rollout/tool_calls_per_traj",
                "rollout/branches", "actor/pg_loss", "actor/grad_norm", "time/step",
                "val/pass@1"]
PLOT_KEYS = ["reward/mean", "reward/accuracy", "rollout/tool_calls_per_traj",
             "rollout/branches", "rollout/entropy", "rollout/response_len", "actor/pg_loss",
             "actor/grad_norm", "actor/kl", "val/pass@1", "time/step"]


def _plain_config(cfg: Any) -> dict:
    from appo.config import to_container

    return to_container(cfg)
