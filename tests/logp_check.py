"""Shared by the LoRA and vLLM tests: how far a rollout dump's recorded log-probs are from an
HF forward of the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def rollout_logp_errors(model, dump: Path) -> list[float]:
    """|recorded log-prob - `model`'s| of every trained token (loss mask 1) in a rollout dump
    (`trainer.rollout_data_dir` JSONL)."""
    errors = []
    for line in dump.read_text().splitlines():
        t = json.loads(line)
        ids = t["prompt_ids"] + t["response_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        p = len(t["prompt_ids"])
        errors += [abs(float(ref[p + k - 1, ids[p + k]]) - t["logp_rollout"][k])
                   for k, m in enumerate(t["loss_mask"]) if m]
    return errors
