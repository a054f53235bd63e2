"""Typed records the data layer hands to the trainer, the rollout and the evaluator."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

# A chat message is the `{"role": ..., "content": ...}` mapping that Hugging Face chat
# templates consume; kept as a plain dict so it can go to `apply_chat_template` unchanged.
Message = dict[str, str]


@dataclass
class RLExample:
    """One RL / evaluation prompt with what its reward function needs."""

    prompt: list[Message]  # system + user (the original rows may carry their own system)
    data_source: str
    ability: str
    ground_truth: str | list[str]
    extra_info: dict[str, Any] = field(default_factory=dict)
    # The prompt through the chat template (generation prompt included), set by a load that
    # was given a tokenizer, so the template is rendered once per prompt.
    prompt_ids: list[int] | None = None

    @property
    def question(self) -> str:
        return next((m["content"] for m in reversed(self.prompt) if m["role"] == "user"), "")


@dataclass
class SFTExample:
    """A tokenised conversation: `loss_mask[i] = 1` where token i is a trained target."""

    input_ids: list[int]
    loss_mask: list[int]
    data_source: str = ""

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class Conversation:
    """An untokenised SFT conversation (messages as in OpenAI `messages` form)."""

    messages: list[Message]
    data_source: str = ""


@dataclass
class LoadStats:
    """What a load did: rows read, rows dropped as too long, examples per data source."""

    rows: int = 0
    skipped_overlong: int = 0
    longest: int = 0
    per_source: Counter = field(default_factory=Counter)
    per_ability: Counter = field(default_factory=Counter)


@dataclass
class RLData:
    examples: list[RLExample]
    stats: LoadStats


@dataclass
class SFTData:
    examples: list[SFTExample]
    stats: LoadStats
