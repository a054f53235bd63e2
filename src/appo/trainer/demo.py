"""`appo demo` (what `make demo` runs): base -> SFT cold start -> ARPO -> eval, on a laptop CPU.

On the embedded SmolLM2-135M-Instruct and the synthetic `arith` task (appo.data.synth):
1. evaluate the base model on the held-out split, per level (greedy, python tool);
2. SFT on gold tool demonstrations of level 1 only (`sft.*`): this teaches the tag format and
   the tool call, and solves level 1 by itself;
3. ARPO training (`rollout.*`, `actor.*`, `trainer.*`) on levels 2 and 3 - the levels SFT
   leaves mostly unsolved - so whatever RL adds there is its own gain;
4. evaluate again after SFT and after RL, print one table (accuracy and tool calls per
   answer per level and stage, with the number of questions), and write a report folder:
   `report.md`, `summary.json`, the RL metrics JSONL and plots, the RL rollouts of every
   step and the evaluation rollouts of every stage.

Everything is one ordinary appo config (`DEMO_OVERRIDES`, also in `configs/demo.yaml`), so
`appo demo key=value` overrides any part and `appo train --config configs/demo.yaml` runs
the RL stage alone.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appo.errors import AppoError

EVAL_LEVELS = (1, 2, 3)
EVAL_PER_LEVEL = 32

DEMO_OVERRIDES = [
    "model.path=smollm2-135m",
    "data.template=math",
    "tools.enabled=[python]",
    # RL prompts: the levels SFT does not solve. Eval: held-out questions of levels 1-3.
    "data.train_files=['synth:arith?split=train&levels=2,3&n=512']",
    "data.val_files=[" + ",".join(f"synth:arith?split=eval&levels={lv}&n={EVAL_PER_LEVEL}"
                                  for lv in EVAL_LEVELS) + "]",
    "data.train_batch_size=4",
    "data.max_prompt_length=512",
    "data.max_response_length=160",
    # SFT cold start on level-1 gold demonstrations.
    "sft.train_files=[synth:arith?split=sft&levels=1&n=160]",
    "sft.batch_size=8",
    "sft.lr=1e-4",
    "sft.max_steps=20",
    "sft.warmup_ratio=0.1",
    "sft.output_dir=runs/demo/sft",
    # SFT's micro-batches: SFT also trains the (tied) embeddings, whose gradient and AdamW
    # moments the actor's budget (frozen embeddings) does not count.
    "sft.max_tokens_per_micro_batch=576",
    # ARPO: 8 trajectories per prompt, 4 sampled from the root, the rest by entropy branching.
    "rollout.strategy=arpo",
    "rollout.n=8",
    "rollout.initial_rollouts=4",
    "rollout.temperature=1.0",
    "tools.call_limit=2",
    # RL moves a small model fast: at 5e-5 one step stopped SmolLM2 ending its turns (Adam's
    # first steps move every weight by ~lr); 1e-5 with the tied embeddings frozen does not.
    "actor.optim.lr=1e-5",
    "actor.freeze_embeddings=true",
    "actor.optim.lr_scheduler=constant",
    "actor.ppo_mini_batch_size=4",
    # ARPO's branches share their responses up to the branch point: the update computes
    # each group's token trie once (exact; appo.trainer.tree_forward).
    "actor.tree_forward=true",
    # The update's micro-batch budget from a memory target (appo.trainer.memory): the demo
    # aims at a laptop, so the whole process should stay under 4 GiB; the target leaves room
    # for the trie's keys/values and glibc's heap beside the modelled activations.
    "actor.max_memory_gb=2.5",
    # Freed blocks of 128 KB or more returned to the system at once instead of kept as glibc
    # heap, except in the update's forwards (faster; benchmarks/RESULTS.md): the laptop
    # wants the memory.
    "trainer.mmap_threshold_kb=128",
    "trainer.mmap_threshold_scope=except_forward",
    "eval.k=1",
    "eval.temperature=0.0",
    "eval.max_response_length=160",
    "trainer.total_steps=6",
    "trainer.test_freq=0",
    "trainer.save_freq=0",
    "trainer.default_local_dir=runs/demo/rl",
    "trainer.rollout_data_dir=runs/demo/rl/rollouts",
    "trainer.logger=[console,jsonl]",
    "trainer.experiment_name=demo",
    # The demo owns runs/demo/: a rerun replaces the previous demo's stages (each stage
    # starts from scratch) instead of refusing the non-empty run directories.
    "trainer.overwrite=true",
]


@dataclass
class LevelScore:
    level: int
    questions: int
    accuracy: float
    tool_calls_per_answer: float


@dataclass
class StageResult:
    stage: str
    seconds: float
    levels: list[LevelScore] = field(default_factory=list)

    def level(self, level: int) -> LevelScore | None:
        return next((x for x in self.levels if x.level == level), None)


def demo_config(config_path: str | None = None, overrides: list[str] | None = None):
    """The demo's config: defaults <- DEMO_OVERRIDES (or FILE) <- user overrides."""
    from appo.config import load_config

    if config_path is not None:
        return load_config(config_path, overrides)
    return load_config(None, DEMO_OVERRIDES + list(overrides or []))


def demo_yaml() -> str:
    """`DEMO_OVERRIDES` as YAML (the content of `configs/demo.yaml`)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.from_dotlist(DEMO_OVERRIDES))


def evaluate_levels(trainer, stage: str, out_dir: Path) -> StageResult:
    """Greedy pass@1 and tool calls per answer on the validation set, per `extra_info.level`."""
    start = time.perf_counter()
    e = trainer.cfg.eval
    ev = trainer.evaluate(trainer.val_data, f"eval-{stage}", 10_000_019, n=1,
                          max_response_length=e.max_response_length)
    trainer.dump(out_dir / f"eval_{stage}.jsonl", ev.trajectories, ev.examples, ev.rewards)
    result = StageResult(stage=stage, seconds=time.perf_counter() - start)
    for level, part in ev.by(lambda ex: int(ex.extra_info.get("level", 0))).items():
        m = part.metrics()
        result.levels.append(LevelScore(level=level, questions=len(part.trajectories),
                                        accuracy=m["val/pass@1"],
                                        tool_calls_per_answer=m["val/tool_calls_per_answer"]))
    return result


def results_table(stages: list[StageResult]) -> str:
    """Markdown table: one row per level, accuracy / tool calls per answer per stage."""
    levels = sorted({x.level for s in stages for x in s.levels})
    head = ["level", "questions"] + [f"{s.stage} acc" for s in stages] + [
        f"{s.stage} calls/answer" for s in stages]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for level in levels:
        scores = [s.level(level) for s in stages]
        n = next(x.questions for x in scores if x is not None)
        cells = [str(level), str(n)]
        cells += [f"{x.accuracy:.1%}" if x else "-" for x in scores]
        cells += [f"{x.tool_calls_per_answer:.2f}" if x else "-" for x in scores]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _sft_stage(trainer, cfg) -> Any:
    from appo.data.sft import sft_data_from_config
    from appo.trainer.memory import trim_freed_memory
    from appo.trainer.metrics import MetricsLogger
    from appo.trainer.rundir import prepare_run_dir
    from appo.trainer.sft import train_sft

    cfg.sft.output_dir = str(prepare_run_dir(cfg.sft.output_dir, "sft", "sft.output_dir",
                                             overwrite=cfg.trainer.overwrite, resumable=False))
    tools = {tag: trainer.tools.resolve(tag) for tag in trainer.tools.tags}
    data = sft_data_from_config(cfg, trainer.tokenizer, "train", tool_instances=tools)
    if not data.examples:
        raise AppoError("sft.train_files produced no demonstrations")
    logger = MetricsLogger(cfg.sft.output_dir, [x for x in cfg.trainer.logger if x == "jsonl"])
    sft = cfg.sft
    if sft.max_tokens_per_micro_batch is None:  # the RL update's budget (from memory)
        sft = copy.deepcopy(sft)  # a copy: the run's config (saved with RL checkpoints) keeps null
        sft.max_tokens_per_micro_batch = trainer.cfg.actor.ppo_max_token_len_per_device
    result = train_sft(trainer.model, trainer.tokenizer, data.examples,
                       sft, seed=cfg.trainer.seed, logger=logger,
                       gradient_checkpointing=cfg.model.enable_gradient_checkpointing,
                       lora=trainer.lora, save_merged=cfg.model.lora_save_merged,
                       onednn=trainer.onednn_train)
    logger.close()
    trim_freed_memory()  # SFT's AdamW states and activations, before RL allocates its own
    # The weights changed outside the RL loop: engines with their own copy (vllm, the LoRA
    # merged model) reload before the next evaluation.
    trainer._rollout_stale = True
    return result, len(data.examples)


def run_demo(cfg) -> int:
    """Run the demo's stages on `cfg` (`demo_config`) and write the report folder."""
    from appo.models import load_model
    from appo.trainer.loop import RLTrainer
    from appo.trainer.memory import trim_freed_memory

    report = Path(cfg.trainer.default_local_dir).parent
    report.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    print(f"appo demo: {cfg.model.path} on CPU; report folder {report}/", flush=True)
    lm = load_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device)
    trainer = RLTrainer(cfg, lm=lm)
    stages: list[StageResult] = []
    timings: dict[str, float] = {}

    print("[1/5] base model on the held-out split ...", flush=True)
    stages.append(evaluate_levels(trainer, "base", report))
    print(results_table(stages), flush=True)

    sft_loss: list[float] = []
    if cfg.sft.max_steps == 0:  # e.g. RL only, from a model that had its SFT already
        print("[2/5] SFT skipped (sft.max_steps=0)", flush=True)
        timings["sft"], sft_steps, n_demos = 0.0, 0, 0
    else:
        print(f"[2/5] SFT cold start ({', '.join(cfg.sft.train_files)}) ...", flush=True)
        t0 = time.perf_counter()
        sft_result, n_demos = _sft_stage(trainer, cfg)
        timings["sft"] = time.perf_counter() - t0
        sft_steps, sft_loss = sft_result.steps, sft_result.train_loss
        print(f"      {sft_steps} steps on {n_demos} demos in {timings['sft']:.0f} s, loss "
              f"{sft_loss[0]:.3f} -> {sft_loss[-1]:.3f}", flush=True)
        print("[3/5] after SFT ...", flush=True)
        stages.append(evaluate_levels(trainer, "sft", report))
        print(results_table(stages), flush=True)

    print(f"[4/5] {cfg.rollout.strategy} RL on {', '.join(cfg.data.train_files)} "
          f"({trainer.total_steps} steps) ...", flush=True)
    t0 = time.perf_counter()
    from appo.trainer.guards import NonFiniteError

    try:
        history = trainer.fit(close=False)
    except NonFiniteError as e:  # the update knows no step number: the one being trained
        raise e.at_step(trainer.step + 1) from None
    timings["rl"] = time.perf_counter() - t0
    # RL is over and its last checkpoint saved: the AdamW moments (two more copies of the
    # trained weights) would only raise the last evaluation's memory.
    trainer.optimizer.state.clear()
    trim_freed_memory()

    print("[5/5] after RL ...", flush=True)
    stages.append(evaluate_levels(trainer, "rl", report))
    trainer.tools.close()
    timings["total"] = time.perf_counter() - t_all
    for s in stages:
        timings[f"eval_{s.stage}"] = s.seconds
    table = results_table(stages)
    rewards = [h.get("reward/mean") for h in history if "reward/mean" in h]
    summary = {
        "model": cfg.model.path,
        "stages": [{"stage": s.stage, "seconds": round(s.seconds, 1),
                    "levels": [vars(x) for x in s.levels]} for s in stages],
        "sft": {"steps": sft_steps, "demos": n_demos,
                "loss_first_last": [sft_loss[0], sft_loss[-1]] if sft_loss else []},
        "rl": {"steps": trainer.step, "reward_mean_per_step": rewards},
        "seconds": {k: round(v, 1) for k, v in timings.items()},
    }
    (report / "summary.json").write_text(json.dumps(summary, indent=2))
    (report / "report.md").write_text(_report_text(cfg, table, summary))
    print("\n" + table)
    print(f"\nappo demo: done in {timings['total'] / 60:.1f} min (SFT {timings['sft']:.0f} s, "
          f"RL {timings['rl']:.0f} s); report in {report}/report.md")
    return 0


def _report_text(cfg, table: str, summary: dict) -> str:
    rl = summary["rl"]
    rewards = ", ".join(f"{r:.2f}" for r in rl["reward_mean_per_step"])
    return "\n".join([
        "# appo demo report",
        "",
        f"Model `{cfg.model.path}`; SFT on `{', '.join(cfg.sft.train_files)}` "
        f"({summary['sft']['steps']} steps); {cfg.rollout.strategy} RL on "
        f"`{', '.join(cfg.data.train_files)}` ({rl['steps']} steps, "
        f"{cfg.data.train_batch_size} prompts x {cfg.rollout.n} trajectories).",
        "Evaluation: held-out questions, greedy, python tool, strict math reward.",
        "",
        table,
        "",
        f"RL reward per step: {rewards}",
        "",
        "Seconds: " + ", ".join(f"{k} {v}" for k, v in summary["seconds"].items()),
        "",
        "Files: `summary.json`, `eval_<stage>.jsonl` (evaluation rollouts), `rl/metrics.jsonl`,",
        "`rl/plots/*.png`, `rl/rollouts/step_*.jsonl`, `sft/` (SFT checkpoint and metrics),",
        "`rl/global_step_*` (final RL checkpoint, Hugging Face format).",
        "",
    ])
