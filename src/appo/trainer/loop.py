"""The RL loop (GRPO / ARPO / AEPO / APPO), readable top to bottom.

One step (`RLTrainer.train_step`), each hand-off a typed record:
    examples (`RLExample`) -> rollout (`RolloutBatch` of `Trajectory`) -> rewards
    (`RewardOutput`, `Trajectory.reward`) -> `TrainBatch` (tensors, built once) ->
    values (only with a critic: `appo.trainer.critic`) -> advantages -> reference log-probs
    (with a KL term) -> old log-probs (off-policy updates) -> update (`appo.trainer.update`,
    then the critic's) -> metrics, rollout dump, checkpoint, validation.

Deviations from the original (verl) and why:
- The hf engine samples from the policy's own weights in one process, from a whole replica
  refreshed after each update under FSDP; vllm takes the updated weights before the next
  rollout, under FSDP straight from the shards (`sync_rollout_weights`).
- Per-step randomness comes from (seed, step): a resume repeats a run bit for bit on CPU.
- Data parallelism: `appo.trainer.distributed`.
- LoRA (`model.lora_rank` > 0, `appo.models.lora`): only the adapter trains; the KL
  reference is the base model with the adapter off; the engines sample from a merged
  copy (`rollout_model`), re-merged before the first rollout after each update.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from pathlib import Path
from typing import Any

import torch

from appo.algos import AdvantageParams
from appo.errors import AppoError
from appo.trainer.batch import TrainBatch, compute_advantages, row_mean_advantages
from appo.trainer.cpu_linear import onednn_linears, run_uses_onednn
from appo.trainer.critic import Critic, uses_critic
from appo.trainer.distributed import DataParallel, GradSync, rank_device
from appo.trainer.evaluate import Evaluation, evaluate
from appo.trainer.fsdp import (
    fsdp_offload,
    fsdp_requested,
    meta_skeleton,
    shard_model,
    sync_replica,
)
from appo.trainer.memory import apply_memory_target, memory_options, trim_freed_memory
from appo.trainer.metrics import StepTimer, peak_rss_mb, rollout_metrics
from appo.trainer.objects import PythonObjects
from appo.trainer.optim import adamw
from appo.trainer.precision import master_dtype, train_compute_dtype
from appo.trainer.rundir import agree_run_dir
from appo.trainer.update import batched_logprobs, kl_coef, needs_old_logp, update_policy

CONSOLE_KEYS = ["reward/mean", "reward/accuracy", "rollout/tool_calls_per_traj",
                "rollout/branches", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss",
                "time/step", "val/pass@1"]
PLOT_KEYS = ["reward/mean", "reward/accuracy", "rollout/tool_calls_per_traj",
             "rollout/branches", "rollout/entropy", "rollout/response_len", "actor/pg_loss",
             "actor/grad_norm", "actor/kl", "val/pass@1", "time/step"]


class RLTrainer:
    """Builds everything from an `AppoConfig` and runs `fit()`."""

    # ------------------------------------------------------------------ the loop
    def fit(self, close: bool = True) -> list[dict[str, float]]:
        """Train to `total_steps`; `close=False` keeps the tools open for more rollouts."""
        from tqdm.auto import tqdm

        t = self.cfg.trainer
        history: list[dict[str, float]] = []
        with self.run_dir.running():  # a first step that fails leaves nothing (rundir.py)
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
            self.run_dir.release()
        return history

    def train_step(self) -> dict[str, float]:
        timer = StepTimer()
        step_seed = self.cfg.trainer.seed * 100_003 + self.step
        with timer.measure("rollout"):
            rollout, by_uid = self.rollout(self.batch_for_step(self.step), f"s{self.step}",
                                           step_seed)
            # The update changes every weight: decode-only copies would be rebuilt anyway.
            if hasattr(self.engine, "drop_weight_copies"):
                self.engine.drop_weight_copies()
            if hasattr(self.engine, "sleep"):  # vLLM's memory back for the update
                self.engine.sleep()
            trim_freed_memory()  # the rollout's KV blocks are free: give them back
        with timer.measure("reward"):
            mine = rollout.trajectories
            rewards = self.score(mine, by_uid)
        # Whole groups are needed for advantages: gather every rank's trajectories.
        everyone = self.dp.gather_objects(mine)
        batch = TrainBatch.collate(everyone, self.pad_id)
        ids = {t.traj_id for t in mine}
        own = [i for i, tid in enumerate(batch.traj_ids) if tid in ids]
        if self.critic is not None:  # GAE's values: before any update, every rank's rows
            with timer.measure("values"):
                batch.values = self.critic.values(batch, own, self.dp)
        with timer.measure("advantage"):
            batch, adv_metrics = compute_advantages(batch, self.cfg.algorithm.adv_estimator,
                                                    self.adv_params)
            train = batch.select(own)
        if self.ref_model is not None or (self.lora is not None and kl_coef(self.cfg.actor)):
            with timer.measure("ref_logp"):
                train.ref_logp = self.reference_logprobs(train)
        if needs_old_logp(self.cfg.actor, train, self.dp):
            with timer.measure("old_logp"):
                train.old_logp = self._logprobs(self.model, train)
        with timer.measure("update"), onednn_linears(self.model, self.onednn_train):
            update = update_policy(self.model, self.optimizer, train, self.cfg.actor,
                                   self.cfg.data.max_response_length, self.dp, self.scheduler,
                                   fsdp=self.fsdp, temperature=self.train_temperature,
                                   compute_dtype=self.compute_dtype, ddp=self.grad_sync)
            # Not needed before the next update: free them for the rollout and evaluation.
            self.optimizer.zero_grad(set_to_none=True)
        if self.critic is not None:
            with timer.measure("critic_update"):
                update.update(self.critic.update(train, self.dp))
        # The heap the updates' forwards grew (activations freed into it, which glibc keeps
        # resident) back to the system before the next rollout's copies and KV cache.
        trim_freed_memory()
        self._rollout_stale = True
        all_rewards = self.dp.gather_objects(rewards)
        metrics = rollout_metrics(everyone, all_rewards, rollout.stats)
        metrics.update(update)
        metrics.update({f"adv/{k}": v for k, v in adv_metrics.items()})
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        for name, secs in timer.phases.items():
            metrics[f"time/{name}"] = secs
        metrics["time/step"] = sum(timer.phases.values())
        for name, gb in timer.cuda_peak_gb.items():  # on CUDA only
            metrics[f"memory/{name}_peak_gb"] = gb
        if self.lora is not None:  # this step's re-merge (inside time/rollout)
            metrics["time/lora_merge"] = self.lora.merge_seconds
        train_tokens = int(train.lengths.sum()) * self.cfg.actor.ppo_epochs
        metrics["perf/rollout_tokens_per_s"] = rollout.stats.tokens_decoded / max(
            timer.phases["rollout"], 1e-9)
        metrics["perf/train_tokens_per_s"] = train_tokens / max(timer.phases["update"], 1e-9)
        metrics["perf/peak_rss_mb"] = peak_rss_mb()
        if self.cfg.trainer.rollout_data_dir and self.dp.is_main:
            self.dump(Path(self.cfg.trainer.rollout_data_dir) / f"step_{self.step + 1:05d}.jsonl",
                      everyone, [by_uid[t.uid] for t in everyone], all_rewards,
                      advantages=row_mean_advantages(batch))
        return metrics

    # ------------------------------------------------------------------ stages
    def batch_for_step(self, step: int) -> list:
        """The prompts of global step `step` (0-based): epoch permutations from the seed, so
        the data order is a function of the step and resuming needs no extra state."""
        size = self.cfg.data.train_batch_size
        epoch, within = divmod(step, self.steps_per_epoch)
        order = list(range(len(self.train_data)))
        if self.cfg.data.shuffle:
            random.Random(self.cfg.data.seed + epoch).shuffle(order)
        return [self.train_data[i] for i in order[within * size : (within + 1) * size]]

    def rollout(self, examples: list, tag: str, step_seed: int, settings=None,
                strategy: str | None = None):
        """This rank's share of `examples` rolled out; returns the `RolloutBatch` and the
        example of every prompt uid (all ranks' uids)."""
        from appo.rollout import RolloutPrompt, rollout
        from appo.rollout.scoring import hf_score_fn

        settings = settings or self.settings
        strategy = strategy or self.cfg.rollout.strategy
        self.sync_rollout_weights()
        by_uid = {f"{tag}-{i}": ex for i, ex in enumerate(examples)}
        prompts = [RolloutPrompt(uid=uid, prompt_ids=self._prompt_ids(ex))
                   for uid, ex in by_uid.items()]
        mine = prompts[self.dp.rank :: self.dp.world]
        self.engine.reseed(step_seed * 1_000_003 + self.dp.rank)  # per step and rank
        rng = random.Random(step_seed * 7919 + self.dp.rank)
        score_fn = (hf_score_fn(self.rollout_model, settings.sampling)
                    if strategy == "appo" else None)
        batch = rollout(mine, self.engine, self.tools, settings, strategy=strategy, rng=rng,
                        score_fn=score_fn)
        return batch, by_uid

    def score(self, trajs: list, by_uid: dict) -> list:
        """Reward every trajectory (sets `Trajectory.reward`); returns the `RewardOutput`s."""
        outputs = []
        for t in trajs:
            ex = by_uid[t.uid]
            text = self.tokenizer.decode(t.response_ids, skip_special_tokens=True)
            out = self.reward(ex.data_source, text, ex.ground_truth, ex.extra_info, ex.ability)
            t.reward = float(out.score)
            outputs.append(out)
        return outputs

    def _prompt_ids(self, ex) -> list[int]:
        # The data stage rendered the chat template when it checked the prompt's length.
        if ex.prompt_ids is not None:
            return list(ex.prompt_ids)
        from appo.data.rl import render_prompt_ids, template_tools

        return render_prompt_ids(ex.prompt, self.tokenizer, template_tools(self.cfg))

    def _logprobs(self, model, batch: TrainBatch) -> torch.Tensor:
        a = self.cfg.actor
        with onednn_linears(model, self.onednn_train):  # the update's numerics
            return batched_logprobs(model, batch, a.ppo_max_token_len_per_device,
                                    a.logprob_chunk_size,
                                    a.share_prefix_forward and not self.fsdp,
                                    temperature=self.train_temperature,
                                    compute_dtype=self.compute_dtype, tree=a.tree_forward,
                                    dp=self.dp, fsdp=self.fsdp)

    def reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Log-probs `[B, T]` of the KL reference: the frozen copy, or under LoRA the base
        model (the adapter switched off, no second copy of the weights)."""
        if self.lora is not None:
            with self.lora.disabled():
                return self._logprobs(self.model, batch)
        return self._logprobs(self.ref_model, batch)

    def validate(self) -> dict[str, float]:
        """pass@1 (mean over `eval.k` samples) and tool statistics on the validation set."""
        if not self.val_data:
            return {}
        return self.evaluate(self.val_data, f"v{self.step}", 10_000_019 + self.step,
                             n=self.cfg.eval.k).metrics()

    def evaluate(self, examples: list, tag: str, seed: int, n: int,
                 max_response_length: int | None = None) -> Evaluation:
        """`n` answers per example under `eval.*` sampling (`appo.trainer.evaluate`)."""
        from appo.rollout.sampling import SamplingParams

        settings = dataclasses.replace(self.settings, n=n, initial_rollouts=n,
                                       sampling=SamplingParams.from_config(self.cfg.eval))
        if max_response_length is not None:
            settings = dataclasses.replace(settings, max_response_length=max_response_length)
        return evaluate(self, examples, tag, seed, settings)

    def dump(self, path: Path, trajs: list, examples: list, rewards: list,
             advantages: list[float] | None = None) -> None:
        """Trajectories as JSONL (`appo.rollout.write_jsonl`), annotated for `appo view` with
        their example's data source and answer, reward details and mean advantage."""
        from appo.rollout import write_jsonl

        notes: list[dict[str, Any]] = []
        for ex, out in zip(examples, rewards, strict=True):
            notes.append({"data_source": ex.data_source, "ground_truth": ex.ground_truth,
                          "accuracy": float(out.accuracy), "format_ok": bool(out.format_ok),
                          "reason": out.reason})
        for i, adv in enumerate(advantages or []):
            notes[i]["advantage"] = adv
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(trajs, path, tokenizer=self.tokenizer, annotations=notes,
                    model=self.cfg.model.path)  # for appo view

    # ------------------------------------------------------------------ weights
    def sync_rollout_weights(self) -> None:
        """Bring the rollout engine up to the policy after an update: under FSDP copy the
        updated shards into the engine's whole replica (a collective); an engine that holds
        its own copy of the weights (vllm, servers) then loads them. Every rank syncs its own
        engine; servers shared by all ranks are synced by rank 0."""
        wake = getattr(self.engine, "wake", None)  # an engine that sleeps between rollouts
        if not self._rollout_stale:
            if wake is not None:
                wake()
            return
        if self.lora is not None:
            self.lora.merge()
        source = self.rollout_model
        if self.fsdp and self.lora is None and self._streams_from_shards():
            source = self.model  # vLLM gathers each parameter from the shards as it loads it
        elif self.fsdp and self.lora is None:
            sync_replica(self.model, self.rollout_model)
        sync = getattr(self.engine, "sync_weights", None)
        if sync is not None:
            if getattr(self.engine, "shared_by_ranks", False):
                # Servers every rank talks to: rank 0 saves and reloads them, once.
                if self.dp.is_main:
                    sync(source)
                self.dp.gather_objects([])  # the others wait for it (a barrier)
            elif wake is not None:
                wake(source)
            else:
                sync(source)
        self._rollout_stale = False

    def _streams_from_shards(self) -> bool:
        """Under FSDP: vLLM (by name) takes the policy from the shards, no whole copy here;
        not with LoRA, APPO (its Branching Score scores on a copy) or a critic (copies it)."""
        c = self.cfg
        return (c.rollout.name == "vllm" and self.lora is None and c.rollout.strategy != "appo"
                and not uses_critic(c))

    def save(self) -> Path | None:
        """Write a checkpoint (every rank calls it): `appo.trainer.saving`."""
        from appo.trainer.saving import save_run

        return save_run(self)

    def _parts(self) -> dict:
        """Trained modules besides the policy, for checkpoints: the critic, if any."""
        return {"critic": self.critic.part()} if self.critic is not None else {}

    # ------------------------------------------------------------------ set-up
    def __init__(self, cfg: Any, lm=None, progress: bool = True, *, reward_fn: Any = None,
                 train_data: Any = None, val_data: Any = None, strategy: Any = None):
        self.cfg = cfg
        # What a config cannot hold, recorded in run.json (appo.trainer.objects).
        self.objects = PythonObjects.given(cfg, reward_fn, train_data, val_data, strategy)
        self.dp = DataParallel.from_env()
        self.progress = progress and self.dp.is_main
        # Before anything is loaded or written: the run directory policy (rundir.py); a
        # failed start leaves nothing new behind, and a replaced run is deleted only after.
        self.run_dir = agree_run_dir(cfg.trainer, self.dp)
        self.out_dir = self.run_dir.path
        cfg.trainer.default_local_dir = str(self.out_dir)  # what the checkpoints record
        with self.run_dir.starting():
            if self.dp.is_main:
                self.objects.record(self.out_dir, bool(cfg.trainer.resume))
            self._setup(lm)

    def _setup(self, lm) -> None:
        """Model, data, tools, rewards, engine, optimizer and resume, in that order."""
        from appo.data.rl import report_overlong, rl_data_from_config
        from appo.models.lora import apply_lora
        from appo.rewards import router_from_config
        from appo.rollout import RolloutSettings, build_engine
        from appo.rollout.auto import Workload
        from appo.rollout.template_check import check_call_format
        from appo.tools.registry import build_tools
        from appo.trainer.checkpoint import resume_training
        from appo.trainer.load_once import load_once
        from appo.trainer.metrics import MetricsLogger
        from appo.trainer.plan_run import startup_plan

        cfg = self.cfg
        torch.manual_seed(cfg.trainer.seed)
        random.seed(cfg.trainer.seed)
        device = rank_device(cfg.model.device, self.dp.enabled)
        self.fsdp = fsdp_requested(cfg.trainer.parallel, self.dp.enabled)
        if lm is None:  # on CUDA: the memory plan, before anything is loaded (plan_run.py)
            startup_plan(cfg, self.dp.world, self.fsdp)
        # Several processes: a model directory's weights are read by rank 0 alone (load_once).
        self.lm = lm or load_once(cfg.model.path, self.dp, dtype=master_dtype(cfg),
                                  device=device)
        self.model = self.lm.model
        # bfloat16 training: float32 master weights, bfloat16 forwards (appo.trainer.precision)
        self.compute_dtype = (train_compute_dtype(cfg)
                              if next(self.model.parameters()).dtype == torch.float32 else None)
        # The training linears through oneDNN where MKL is slow (appo.trainer.cpu_linear).
        self.onednn_train = run_uses_onednn(cfg, self.model, self.fsdp)
        self.tokenizer = self.lm.tokenizer
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.lora = apply_lora(self.model, cfg.model)  # None: full fine-tuning
        if cfg.model.enable_gradient_checkpointing:
            # Non-reentrant: a reentrant backward marks DDP's parameters ready twice.
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
            if self.lora is not None:  # frozen embeddings: checkpointed blocks need grads in
                self.model.enable_input_require_grads()
        memory_options(self.model, cfg.actor, self.fsdp, cfg.trainer.mmap_threshold_kb,
                       cfg.trainer.mmap_threshold_scope)
        if cfg.actor.freeze_embeddings and self.lora is None:
            self.model.get_input_embeddings().requires_grad_(False)
            self.model.get_output_embeddings().requires_grad_(False)
        self.ref_model = None
        if kl_coef(cfg.actor) != 0 and self.lora is None:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
            if self.compute_dtype is not None:  # a frozen copy needs no float32 master
                self.ref_model.to(self.compute_dtype)
        # Under FSDP the engine samples from a whole replica, synced after each update.
        self.rollout_model = self.model
        self._rollout_stale = False
        if self.lora is not None:  # under FSDP built whole before sharding, merged per unit
            self.rollout_model = self.lora.rollout_model()
        elif self.fsdp and self._streams_from_shards():
            self.rollout_model = meta_skeleton(self.model)  # no whole copy on any GPU
        elif self.fsdp:
            # The engine's whole copy (in the forwards' dtype once the critic has copied it).
            self.rollout_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        if self.fsdp:
            shard_model(self.model, self.dp.world, compute_dtype=self.compute_dtype,
                        offload=fsdp_offload(cfg.actor))
            if self.ref_model is not None:  # sharded too: no whole reference on every GPU
                shard_model(self.ref_model, self.dp.world)
        check_call_format(cfg, self.tokenizer, announce=self.dp.is_main)
        self.tools = build_tools(cfg.tools)
        train = rl_data_from_config(cfg, "train", self.tokenizer, rows=self.objects.train_data)
        self.train_data = train.examples
        val = (rl_data_from_config(cfg, "val", self.tokenizer, rows=self.objects.val_data)
               if cfg.data.val_files or self.objects.val_data is not None else None)
        self.val_data = val.examples if val is not None else []
        for key, data in (("data.train_files", train), ("data.val_files", val)):
            report_overlong(key, data, cfg.data.max_prompt_length)
        if not self.train_data:
            why = (f": all {train.stats.rows} prompts are longer than data.max_prompt_length="
                   f"{cfg.data.max_prompt_length} (longest {train.stats.longest} tokens)"
                   if train.stats.rows and train.stats.skipped_overlong == train.stats.rows else "")
            raise AppoError(f"data.train_files produced no training prompts{why}")
        self.reward = router_from_config(cfg, reward_fn=self.objects.reward_fn)
        self.reward.check((e.data_source, e.ability) for e in self.train_data + self.val_data)
        self.steps_per_epoch = max(1, len(self.train_data) // cfg.data.train_batch_size)
        self.total_steps = self.steps_per_epoch * cfg.trainer.total_epochs
        if cfg.trainer.total_steps is not None:
            self.total_steps = int(cfg.trainer.total_steps)
        self.settings = RolloutSettings.from_config(cfg)
        # verl computes training log-probs at the rollout temperature (docs/algorithms.md §4.7);
        # a greedy rollout (temperature 0) has no such distribution: 1.
        self.train_temperature = (float(cfg.rollout.temperature)
                                  if cfg.rollout.temperature > 0 else 1.0)
        self.adv_params = AdvantageParams(
            norm_adv_by_std=cfg.algorithm.norm_adv_by_std,
            appo_discount_credit=cfg.algorithm.appo_discount_credit,
            reward_scale_discount=cfg.algorithm.reward_scale_discount,
            gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam, gae_whiten=cfg.algorithm.gae_whiten,
        )
        o = cfg.actor.optim
        self.optimizer = adamw([p for p in self.model.parameters() if p.requires_grad],
                               o.lr, o.weight_decay, tuple(o.betas), o.fused)
        self.scheduler = self._make_scheduler()
        # PPO's value model, from the policy's starting weights (under FSDP: its whole
        # replica) or critic.model.path.
        policy = dataclasses.replace(self.lm, model=self.rollout_model) if self.fsdp else self.lm
        self.critic = (Critic.from_config(cfg, policy, self.total_steps, self.fsdp,
                                          self.compute_dtype) if uses_critic(cfg) else None)
        if (self.fsdp and self.lora is None and self.compute_dtype is not None
                and not self._streams_from_shards()):
            # The engine's whole copy in the forwards' dtype (bfloat16 over float32 masters:
            # what the engine samples in on GPUs, half a float32 copy's memory); converted
            # once the critic has copied the policy's float32 start weights.
            self.rollout_model.to(self.compute_dtype)
        # rollout.name=auto weighs the run's rollout work (this rank's share) against
        # vLLM's start-up; every rank decides the same from the same config.
        workload = Workload.training(cfg, self.total_steps, self.dp.world)
        self.engine = build_engine(cfg, dataclasses.replace(self.lm, model=self.rollout_model),
                                   workload=workload, announce=self.dp.is_main)
        # An engine with its own copy of the weights (vllm, servers) loaded model.path, which a
        # given `lm` or a resumed checkpoint differs from: its first rollout syncs.
        self._rollout_stale = hasattr(self.engine, "sync_weights") or self.lora is not None
        self.step = 0
        if cfg.trainer.resume:
            from appo.config import to_container

            self.step = resume_training(self.out_dir, self.model, self.optimizer, self.scheduler,
                                        fsdp=self.fsdp, rollout_model=self.rollout_model,
                                        announce=self.dp.is_main, config=to_container(cfg),
                                        parts=self._parts(), lora=self.lora)
        # Several processes without FSDP: torch's DDP sums the policy's gradients, built
        # once (its constructor broadcasts rank 0's weights) around the resumed weights.
        self.grad_sync = GradSync(self.model) if self.dp.enabled and not self.fsdp else None
        # The update's token budget from a memory target, or capped by an activation share.
        budget = apply_memory_target(cfg.actor, self.model, self.optimizer, self.dp, self.fsdp,
                                     run_dir=self.out_dir)  # derived once, then reused
        if self.critic is not None and cfg.critic.ppo_max_token_len_per_device is None:
            self.critic.max_tokens = budget  # the critic follows the actor's budget
        # Rows logged after the checkpoint resumed from are redone: drop them.
        self.logger = MetricsLogger(
            self.out_dir, list(cfg.trainer.logger), run_name=cfg.trainer.experiment_name,
            resume_step=self.step if cfg.trainer.resume and self.step > 0 else None,
            enabled=self.dp.is_main,
        )

    def _make_scheduler(self):
        from transformers import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

        o, a = self.cfg.actor.optim, self.cfg.actor
        steps_per_update = a.ppo_epochs * max(
            1, math.ceil(self.cfg.data.train_batch_size / a.ppo_mini_batch_size))
        total = self.total_steps * steps_per_update
        warmup = int(o.lr_warmup_steps_ratio * total)
        if o.lr_scheduler == "cosine":
            return get_cosine_schedule_with_warmup(self.optimizer, warmup, total)
        return get_constant_schedule_with_warmup(self.optimizer, warmup)

