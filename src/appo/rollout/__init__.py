"""Tool-integrated rollout: engines (hf, vllm), the tool loop, strategies (grpo/arpo/aepo/appo).

Typical use (the trainer and the evaluator do this):

    engine = build_engine(cfg, lm)                 # hf: KV cache kept across tool rounds
    tools = appo.tools.registry.build_tools(cfg.tools)
    settings = RolloutSettings.from_config(cfg)
    batch = rollout(prompts, engine, tools, settings, strategy=cfg.rollout.strategy,
                    score_fn=hf_score_fn(lm.model))  # score_fn: appo only
    batch.trajectories, batch.stats

Nothing here imports the trainer; torch is imported by the engine modules only.
"""

from __future__ import annotations

from typing import Any

from appo.rollout.loop import RolloutPrompt, ToolLoop
from appo.rollout.records import (
    BranchEvent,
    RolloutBatch,
    RolloutStats,
    Segment,
    ToolCallRecord,
    Trajectory,
    read_jsonl,
    write_jsonl,
)
from appo.rollout.settings import RolloutSettings
from appo.rollout.strategies import STRATEGIES, get_strategy

# `rollout.name` values (kept in step with appo.config.CHOICES by a test); `auto` picks hf
# or vllm (appo.rollout.auto).
ENGINES = ("hf", "vllm", "openai", "auto")

__all__ = [
    "ENGINES",
    "STRATEGIES",
    "BranchEvent",
    "RolloutBatch",
    "RolloutPrompt",
    "RolloutSettings",
    "RolloutStats",
    "Segment",
    "ToolCallRecord",
    "ToolLoop",
    "Trajectory",
    "build_engine",
    "get_strategy",
    "read_jsonl",
    "rollout",
    "write_jsonl",
]


def rollout(prompts, engine, tools, settings: RolloutSettings, strategy: str = "arpo",
            rng: Any = None, score_fn=None) -> RolloutBatch:
    """Run one rollout call of `strategy` over `prompts` (see `appo.rollout.strategies`)."""
    return get_strategy(strategy)(prompts, engine, tools, settings, rng=rng, score_fn=score_fn)


def build_engine(cfg: Any, lm: Any = None, workload: Any = None, announce: bool = True,
                 **kwargs: Any):
    """The engine named by `rollout.name`: `hf` on a loaded model, `vllm` (lazy import, an
    in-process `vllm.LLM`), `openai` (OpenAI-compatible servers, `rollout.base_urls`) or
    `auto` (hf or vllm by `appo.rollout.auto`'s rule for `workload`, an
    `appo.rollout.auto.Workload`; None: one training step of the config; the choice is
    printed as one line to stderr when `announce`)."""
    from appo.errors import AppoError

    name = cfg.rollout.name
    if name == "auto":
        name = _auto_engine_name(cfg, workload, announce)
    if name == "hf":
        if lm is None:
            raise AppoError("the hf rollout engine needs a loaded model (appo.models.load_model)")
        from appo.rollout.hf_engine import HFEngine

        kwargs.setdefault("cpu_weights", cfg.rollout.cpu_weights)
        return HFEngine(lm.model, lm.tokenizer, seed=int(cfg.rollout.seed), **kwargs)
    if name == "vllm":
        from appo.rollout.vllm_engine import VLLMEngine

        return VLLMEngine.from_config(cfg, tokenizer=None if lm is None else lm.tokenizer,
                                      **kwargs)
    if name == "openai":
        return _server_engine(cfg, lm)
    raise AppoError(f"unknown rollout engine {name!r} (choose from {', '.join(ENGINES)})")


def _auto_engine_name(cfg: Any, workload: Any, announce: bool) -> str:
    import sys

    from appo.rollout.auto import Workload, resolve

    if workload is None:
        workload = Workload.training(cfg, steps=1)
    choice = resolve(cfg, workload)
    if announce:
        note = ("; rollout.base_urls is set but only rollout.name=openai uses servers"
                if cfg.rollout.base_urls else "")
        print(choice.line[:-1] + note + ")", file=sys.stderr, flush=True)
    return choice.name


def _server_engine(cfg: Any, lm: Any):
    """`rollout.name=openai`: OpenAI-compatible servers (vLLM) for rollouts, with the
    top-20 log-probs of every sampled token (behaviour log-prob and entropy proxy)."""
    from pathlib import Path

    from appo.errors import AppoError
    from appo.rollout.openai_engine import OpenAICompletionsEngine

    r = cfg.rollout
    if not r.base_urls:
        raise AppoError("rollout.name=openai needs rollout.base_urls=[http://HOST:PORT,...] "
                        "(servers started with vllm's api_server)")
    if lm is None:
        raise AppoError("the openai rollout engine needs the policy's tokenizer")
    # The trainer fills in its run directory before it builds the engine.
    run_dir = cfg.trainer.default_local_dir or "runs/appo"
    weights_dir = Path(r.weights_dir or Path(run_dir) / "rollout_weights")
    return OpenAICompletionsEngine(list(r.base_urls), lm.tokenizer, logprobs=20,
                                   seed=int(r.seed),
                                   weights_dir=str(weights_dir.expanduser().resolve()),
                                   weight_transfer=r.weight_transfer)
