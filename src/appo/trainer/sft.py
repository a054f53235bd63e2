"""Supervised fine-tuning (the cold start before RL): masked cross-entropy on tool trajectories.

Each example is token ids plus a loss mask (1 = assistant tokens the model should learn to
write; 0 = system/user turns and, by default, tool results inside <result>...</result>,
which the model never writes itself — the original trained on them, we do not).

The loss is a token mean over the whole optimizer step (all micro-batches of a gradient
accumulation window), so accumulation does not change the result. Cosine schedule with
warmup, gradient clipping, optional gradient checkpointing, evaluation loss, checkpoints in
Hugging Face format.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from appo.trainer.checkpoint import save_checkpoint
from appo.trainer.cpu_linear import onednn_linears
from appo.trainer.guards import SFT_HINT, check_finite
from appo.trainer.memory import forward_allocations
from appo.trainer.metrics import MetricsLogger
from appo.trainer.optim import adamw
from appo.trainer.rundir import unique_run_dir


class TokenExample(Protocol):
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class SFTResult:
    steps: int
    train_loss: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    eval_loss: float | None = None
    seconds: float = 0.0
    checkpoint: Path | None = None


def token_micro_batches(rows: list[TokenExample], max_tokens: int | None
                        ) -> list[list[TokenExample]]:
    """`rows` in order, cut into runs whose summed lengths stay within `max_tokens` (a row
    longer than that alone); one run when `max_tokens` is None."""
    if not max_tokens:
        return [rows]
    out: list[list[TokenExample]] = []
    size = 0
    for row in rows:
        if out and size + len(row.input_ids) <= max_tokens:
            out[-1].append(row)
            size += len(row.input_ids)
        else:
            out.append([row])
            size = len(row.input_ids)
    return out


def masked_token_loss_sum(model, examples: list[TokenExample], pad_id: int,
                          share_prefix: bool = True, chunk_size: int = 128,
                          compute_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, int]:
    """Sum of next-token cross-entropy over the targets with loss_mask=1, and their count.

    Logits exist only for those targets, a chunk at a time, and the rows' common prefix
    (the system prompt) is computed once (`appo.trainer.forward`). `compute_dtype`: float32
    master weights computed in this dtype (`appo.trainer.precision`).
    """
    from appo.algos import token_logprobs_and_entropy
    from appo.trainer.batch import pad_right
    from appo.trainer.forward import final_hidden_states
    from appo.trainer.precision import autocast, head_inputs

    with autocast(next(model.parameters()).device, compute_dtype):
        hidden = final_hidden_states(
            model, pad_right([e.input_ids for e in examples], pad_id, torch.long),
            torch.tensor([len(e.input_ids) for e in examples]), share_prefix)
    rows, positions, targets = [], [], []
    for i, e in enumerate(examples):
        for p in range(1, len(e.input_ids)):
            if e.loss_mask[p]:
                # token p is predicted from the hidden state at p - 1
                rows.append(i)
                positions.append(p - 1)
                targets.append(e.input_ids[p])
    if not targets:
        return hidden.sum() * 0.0, 0
    head = model.get_output_embeddings()
    device = hidden.device
    picked = hidden[torch.tensor(rows, device=device), torch.tensor(positions, device=device)]
    picked, weight, bias = head_inputs(picked, head.weight, getattr(head, "bias", None),
                                       compute_dtype)
    logp, _ = token_logprobs_and_entropy(
        picked, weight, torch.tensor(targets, device=device),
        bias=bias, chunk_size=chunk_size, with_entropy=False,
    )
    return -logp.sum(), len(targets)


def evaluate_loss(model, examples: list[TokenExample], pad_id: int, batch_size: int = 8) -> float:
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(examples), batch_size):
            loss_sum, n = masked_token_loss_sum(model, examples[i : i + batch_size], pad_id)
            total += float(loss_sum)
            count += n
    model.train(was_training)
    return total / max(count, 1)


def train_sft(
    model,
    tokenizer,
    train: list[TokenExample],
    params: Any,
    seed: int = 42,
    val: list[TokenExample] | None = None,
    logger: MetricsLogger | None = None,
    progress: bool = True,
    gradient_checkpointing: bool = False,
    compute_dtype: torch.dtype | None = None,
    lora: Any = None,
    save_merged: bool = False,
    onednn: bool = False,
) -> SFTResult:
    """Run SFT in place on `model` under `params` (an `appo.config.SFTConfig`: `sft.*`);
    checkpoints go to `params.output_dir`. Returns the loss curve and the final checkpoint
    path. `seed` (`trainer.seed`) orders the data. `compute_dtype`: the forwards' autocast
    dtype over float32 master weights (`appo.trainer.precision`), or None. `lora` (an
    `appo.models.lora.LoraPolicy` whose `model` is `model`): checkpoints hold its adapter,
    plus the merged model in `merged/` when `save_merged` (`model.lora_save_merged`).
    `onednn`: the linears' forward and backward through oneDNN (`actor.cpu_matmul`,
    `appo.trainer.cpu_linear`)."""
    from tqdm.auto import tqdm
    from transformers import get_cosine_schedule_with_warmup

    if not train:
        from appo.errors import AppoError

        raise AppoError("SFT got no training examples")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # The CLI applied the run directory policy (appo.trainer.rundir); a library caller
    # without a directory gets a new one.
    out_dir = Path(params.output_dir) if params.output_dir else unique_run_dir("sft")
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
        if lora is not None:  # frozen embeddings: checkpointed blocks need grads coming in
            model.enable_input_require_grads()
    per_step = params.batch_size * params.gradient_accumulation_steps
    steps_per_epoch = math.ceil(len(train) / per_step)
    total_steps = steps_per_epoch * params.epochs
    if params.max_steps is not None:
        total_steps = min(total_steps, params.max_steps)
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], params.lr,
                      params.weight_decay, fused=getattr(params, "fused", None))
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, int(params.warmup_ratio * total_steps), total_steps
    )
    generator = torch.Generator().manual_seed(seed)
    result = SFTResult(steps=0)
    start = time.perf_counter()
    model.train()
    bar = tqdm(total=total_steps, desc="sft", disable=not progress, leave=False)
    step = 0
    for _epoch in range(params.epochs):
        order = torch.randperm(len(train), generator=generator).tolist()
        for s in range(steps_per_epoch):
            if step >= total_steps:
                break
            window = [train[i] for i in order[s * per_step : (s + 1) * per_step]]
            # Normalise by the tokens of the whole step so accumulation = one big batch.
            step_tokens = sum(sum(e.loss_mask[1:]) for e in window)
            tokens_seen = sum(len(e.input_ids) for e in window)
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_total = 0.0
            for m in range(0, len(window), params.batch_size):
                for micro in token_micro_batches(window[m : m + params.batch_size],
                                                 params.max_tokens_per_micro_batch):
                    # The backward in the block too: checkpointing recomputes through it.
                    with onednn_linears(model, onednn):
                        with forward_allocations():
                            loss_sum, _ = masked_token_loss_sum(model, micro, pad_id,
                                                                compute_dtype=compute_dtype)
                        loss = loss_sum / max(step_tokens, 1)
                        loss.backward()
                    loss_total += float(loss.detach())
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), params.grad_clip)
            check_finite(step + 1, SFT_HINT,
                         **{"sft/loss": loss_total, "sft/grad_norm": float(grad_norm)})
            optimizer.step()
            scheduler.step()
            step += 1
            result.train_loss.append(loss_total)
            result.grad_norms.append(float(grad_norm))
            metrics = {
                "sft/loss": loss_total,
                "sft/lr": scheduler.get_last_lr()[0],
                "sft/grad_norm": float(grad_norm),
                "sft/tokens_per_s": tokens_seen / max(time.perf_counter() - t0, 1e-9),
            }
            if logger is not None:
                logger.log(step, metrics, console_keys=["sft/loss", "sft/lr", "sft/grad_norm"])
            bar.update(1)
            bar.set_postfix(loss=f"{loss_total:.3f}")
            if params.save_freq > 0 and step % params.save_freq == 0:
                _save(out_dir, step, model, tokenizer, optimizer, scheduler, lora, save_merged)
    bar.close()
    model.eval()
    result.steps = step
    if val:
        result.eval_loss = evaluate_loss(model, val, pad_id, params.batch_size)
        if logger is not None:
            logger.log(step, {"sft/eval_loss": result.eval_loss}, console_keys=["sft/eval_loss"])
    result.checkpoint = _save(out_dir, step, model, tokenizer, optimizer, scheduler, lora,
                              save_merged)
    # The last step's gradients would otherwise stay on the parameters through whatever
    # runs next (the demo's evaluation and RL rollout: one more copy of the weights).
    optimizer.zero_grad(set_to_none=True)
    result.seconds = time.perf_counter() - start
    return result


def _save(out_dir: Path, step: int, model, tokenizer, optimizer, scheduler, lora: Any,
          save_merged: bool) -> Path:
    merged = lora.rollout_model() if lora is not None and save_merged else None
    return save_checkpoint(out_dir, step, model, tokenizer, optimizer, scheduler, lora=lora,
                           merged=merged)
