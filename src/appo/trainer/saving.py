"""The RL trainer's checkpoint writes: whole states (the default) or sharded ones.

Whole (`appo.trainer.checkpoint.save_checkpoint`): under FSDP every rank takes part in
gathering the float32 masters and the optimizer states to rank 0, which writes a Hugging Face
directory plus `trainer_state.pt`. Sharded (`trainer.sharded_checkpoint`,
`appo.trainer.sharded`): every rank writes its shards through torch's distributed checkpoint;
the run's last checkpoint also gathers the whole model as a Hugging Face directory (the
export a finished run is used through).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from appo.fsutil import atomic_dir, atomic_write_text, is_write_failure, write_error
from appo.trainer.checkpoint import STATE_FILE, rng_state, save_checkpoint, write_manifest
from appo.trainer.fsdp import full_model_state, full_optimizer_state


def save_run(tr: Any) -> Path | None:
    """Write `global_step_{tr.step}` for the RL trainer `tr` (`appo.trainer.loop.RLTrainer`);
    a collective: every rank calls it. Returns the path on rank 0, None elsewhere."""
    if tr.cfg.trainer.sharded_checkpoint:
        return _save_sharded(tr)
    from appo.config import to_container

    extra = {"config": to_container(tr.cfg), "parallel": "fsdp" if tr.fsdp else "ddp"}
    lora, model_state = tr.lora, None
    if tr.fsdp:  # gather whole states (collectives: every rank takes part)
        if tr.lora is None:  # the float32 masters, not the engine's replica
            model_state = full_model_state(tr.model, rank0_cpu=True)
        else:
            tr.sync_rollout_weights()  # the merge gathers shards: every rank, not rank 0
        lora = tr.lora.snapshot() if tr.lora is not None else None
    # keyed by parameter name in every layout: any layout and world size resumes it
    optimizer_state = full_optimizer_state(tr.model, tr.optimizer)
    parts = {name: part.gather() for name, part in tr._parts().items()}  # collectives
    if not tr.dp.is_main:
        return None
    merged = None
    if tr.lora is not None and tr.cfg.model.lora_save_merged:
        tr.sync_rollout_weights()  # the merged model of the current adapter
        merged = tr.rollout_model
    return save_checkpoint(tr.out_dir, tr.step, tr.rollout_model, tr.tokenizer,
                           tr.optimizer, tr.scheduler, extra=extra,
                           optimizer_state=optimizer_state, parts=parts, lora=lora,
                           merged=merged, model_state=model_state)


def _save_sharded(tr: Any) -> Path | None:
    from appo.config import to_container
    from appo.trainer.sharded import check_finite_shards, save_shards

    parts = tr._parts()
    trained = {"": (tr.model, tr.optimizer)}
    trained.update({name: (p.module, p.optimizer) for name, p in parts.items()})
    check_finite_shards([m for m, _ in trained.values()], tr.step, tr.dp)
    final = Path(tr.out_dir) / f"global_step_{tr.step}"
    last = tr.step >= tr.total_steps
    main = tr.dp.is_main
    try:
        if main:
            final.parent.mkdir(parents=True, exist_ok=True)
        # Rank 0 owns the temporary directory (renamed into place once complete); every
        # rank writes its shards into it.
        with atomic_dir(final) if main else nullcontext(None) as mine:
            tmp = Path(tr.dp.gather_objects([str(mine)] if main else [])[0])
            save_shards(tmp, trained)
            # The run's end: the whole model too, as transformers and vLLM load it.
            whole = full_model_state(tr.model, rank0_cpu=True) if last and tr.fsdp else None
            if not main:
                return None
            try:
                model = tr.rollout_model if tr.fsdp else tr.model
                if last:
                    model.save_pretrained(tmp, safe_serialization=True, state_dict=whole)
                else:
                    model.config.save_pretrained(tmp)
                tr.tokenizer.save_pretrained(tmp)
                torch.save({"step": tr.step, "optimizer": None,
                            "scheduler": tr.scheduler.state_dict() if tr.scheduler else None,
                            "parts": {n: p.scheduler.state_dict() if p.scheduler else None
                                      for n, p in parts.items()},
                            "rng": rng_state(),
                            "extra": {"config": to_container(tr.cfg), "sharded": True,
                                      "parallel": "fsdp" if tr.fsdp else "ddp"}},
                           tmp / STATE_FILE)
                write_manifest(tmp, tr.step)
            except Exception as e:
                if is_write_failure(e):
                    raise write_error(e, final, "save checkpoint") from e
                raise
        atomic_write_text(Path(tr.out_dir) / "latest", final.name + "\n")
    except OSError as e:
        raise write_error(e, final, "save checkpoint") from e
    return final
