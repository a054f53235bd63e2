"""The generation-engine protocol the tool loop and the strategies drive.

An engine holds *rows*: token sequences that grow by sampled segments and forced tokens.
It knows nothing of tools, rewards or strategies. Operations:

- `add_row(prompt_ids)`: a root row for a prompt; later rows of the prompt are forks of it,
  so the prompt is prefilled once per group.
- `prefill(rows)` (optional): cache all but the last token of rows now (a prompt root), so
  every later fork, including fresh trajectories started rounds later, shares that cache.
- `fork(row, k, at=None)`: `k` copies of a row (optionally truncated to its first `at`
  tokens); they share the parent's cache, so the shared prefix is never recomputed.
- `append(row, ids)`: forced tokens (a tool result), prefilled lazily onto the row's cache.
- `decode(rows, max_new_tokens, params)`: sample one segment per row until a stop string,
  EOS or the row's budget; returns ids with behaviour log-prob and entropy per token.
- `release(rows)`: free rows (and their cache) that will not be used again.
- `sync_weights(model)` (optional): an engine holding its own copy of the policy (vllm, the
  servers of the openai engine) loads `model`'s current weights; the trainer calls it
  before the first rollout and after every update. The hf engine samples from the
  trainer's module itself and has none.
- `sleep()` / `wake(model=None)` (optional): an engine that frees its GPU memory between
  rollouts (vllm's sleep mode); the trainer calls `sleep()` after each training rollout and
  `wake(model)` before the next (loading `model`'s weights when they changed, then the KV
  cache), in place of `sync_weights`.
- `drop_weight_copies()` (optional): free weight copies only the engine's decode path uses
  (the hf engine's packed / transposed matrices); the trainer calls it after each training
  rollout, since the update is about to change every weight they copy.

`counters` (tokens prefilled / decoded / reused) are cumulative; callers diff them. The row
operations are implemented once, in `appo.rollout.rows`, for every engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from appo.rollout.records import EngineCounters
from appo.rollout.sampling import SamplingParams


@dataclass
class SegmentOutput:
    """One decoded segment of one row."""

    token_ids: list[int]
    logps: list[float]
    entropies: list[float]  # full-vocabulary entropy of each token's distribution
    # "stop" (a stop string), "eos", "length" (the row's token budget), "error" (a remote
    # engine's request failed; `error` says why and the row ends)
    finish: str
    stop_string: str | None = None
    topk_entropies: list[float] = field(default_factory=list)  # top-10 proxy (seed measure)
    error: str | None = None


@dataclass
class EngineInfo:
    name: str
    stop_strings: list[str] = field(default_factory=list)


@runtime_checkable
class Engine(Protocol):
    tokenizer: object
    counters: EngineCounters

    def set_stop_strings(self, stop_strings: list[str]) -> None: ...

    def add_row(self, prompt_ids: list[int]) -> int: ...

    def fork(self, row: int, k: int = 1, at: int | None = None,
             segment_start: int | None = None) -> list[int]: ...

    def append(self, row: int, token_ids: list[int]) -> None: ...

    def decode(self, rows: list[int], max_new_tokens: list[int],
               params: SamplingParams) -> list[SegmentOutput]: ...

    def row_ids(self, row: int) -> list[int]: ...

    def release(self, rows: list[int]) -> None: ...

    def reseed(self, seed: int) -> None:
        """Restart the sampling stream from `seed` (the trainer derives one per step and
        rank, so a resumed run samples what an uninterrupted one would)."""
        ...
