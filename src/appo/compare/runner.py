"""Run the missing (variant, seed) pairs of a comparison, each as an ordinary `appo train`
run in its own directory, then evaluate it on the held-out sets.

A pair's state comes from its run directory alone, so the command can be stopped at any
moment and started again:
- `done`: `result.json` exists (written atomically after the evaluation): skipped;
- `partial`: a checkpoint exists: training resumes from it (`trainer.resume=true`), then the
  evaluation runs;
- `missing`: nothing usable (no directory, or one with no checkpoint yet): a fresh run
  (an unfinished directory without a checkpoint is replaced, `trainer.overwrite=true`).

Several `appo compare` processes may run one spec at once (`--jobs N` starts them; a second
command started by hand is the same): a process works on a pair only while it holds the
pair's lock, an exclusive `flock` on `output_dir/.locks/<variant>-seed<N>.lock`, and passes
over pairs another process holds. The kernel drops a lock when its holder dies, so a killed
run never leaves one behind, and two processes never write one run directory.

Each pair records what it ran under (`pair.json`: the resolved run config, the token
budget of a memory target, and the eval settings, `pair_definition`); `check_definitions` refuses to run or report a comparison in
which a done pair's definition (or a started pair's, the step count aside) differs from the
spec's, so old numbers are never reported under a new definition.

Evaluation per set (`PairResult`): greedy pass@1 (one answer at temperature 0) and sampled
pass@k (k answers at `eval.temperature`; a question counts when any is correct), per question
so the report can pair questions across variants. The evaluation seed depends on the run's
seed only, so every variant of a seed answers under the same sampling seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appo.compare.spec import CompareSpec
from appo.outdir import write_output

RESULT_FILE = "result.json"
PAIR_FILE = "pair.json"  # the pair's definition when it ran (`pair_definition`)
EVAL_SEED = 20_000_003
# Set per run by compare itself: not part of what a pair is.
_NOT_DEFINITION = ("trainer.resume", "trainer.overwrite", "trainer.default_local_dir")
# A pair that has not finished may go on to more steps (resume extends a run).
_EXTENDABLE = ("trainer.total_steps", "trainer.total_epochs")
# The micro-batch token budget a memory target gave the variant (`pair_config`).
BUDGET_KEY = "actor.max_memory_gb.tokens"


@dataclass
class SetResult:
    """Per-question scores on one eval set (lists aligned with the set's questions)."""

    greedy: list[float]  # accuracy of the greedy answer
    sampled_correct: list[int]  # correct answers among k samples
    k: int
    tool_calls: list[int]  # tool calls of the greedy answer
    files: str = ""  # the eval set's data spec when it was evaluated

    @property
    def pass_at_k(self) -> list[float]:
        return [1.0 if c > 0 else 0.0 for c in self.sampled_correct]


@dataclass
class PairResult:
    variant: str
    seed: int
    steps: int
    eval_seconds: float
    sets: dict[str, SetResult] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PairResult:
        sets = {k: SetResult(**v) for k, v in d["sets"].items()}
        return cls(variant=d["variant"], seed=int(d["seed"]), steps=int(d["steps"]),
                   eval_seconds=float(d["eval_seconds"]), sets=sets)


def pair_state(spec: CompareSpec, variant: str, seed: int) -> str:
    """`done`, `partial` or `missing` (module docstring)."""
    from appo.trainer.checkpoint import latest_checkpoint

    run = spec.run_dir(variant, seed)
    if (run / RESULT_FILE).is_file():
        return "done"
    if run.is_dir() and latest_checkpoint(run) is not None:
        return "partial"
    return "missing"


def budget_dir(spec: CompareSpec, variant: str) -> Path:
    """Where a variant's micro-batch token budget is recorded (`appo.trainer.memory`'s
    `BUDGET_FILE`), beside the run directories (a fresh pair replaces its own)."""
    return spec.output_dir / ".memory" / variant


def pair_config(spec: CompareSpec, variant: str, seed: int, resume: bool = False):
    """The run config of one pair. Under `actor.max_memory_gb` the variant's first pair
    derives the token budget (from what its process holds then) and records it
    (`budget_dir`); every later pair of the variant, in any worker, after any other pair,
    trains with that budget, so a pair's micro-batch split (and its numbers) do not depend
    on what ran before it. A resumed pair that derived it itself reuses its own record."""
    from appo.trainer.memory import recorded_budget

    cfg = spec.config(variant, seed, resume=resume)
    target = cfg.actor.max_memory_gb
    if target is None or (resume and recorded_budget(spec.run_dir(variant, seed), target)):
        return cfg
    tokens = recorded_budget(budget_dir(spec, variant), target)
    if tokens is not None:  # the memory target's own path with the recorded budget
        cfg.actor.max_memory_gb = None
        cfg.actor.activation_memory_gb = None  # a target supersedes the activation cap
        cfg.actor.ppo_max_token_len_per_device = tokens
    return cfg


@contextlib.contextmanager
def _derived_once(spec: CompareSpec, variant: str, target: float | None) -> Iterator[None]:
    """Hold the variant's budget lock while its budget is not recorded yet, so that two
    workers never derive it both."""
    from appo.trainer.memory import recorded_budget

    if target is None or recorded_budget(budget_dir(spec, variant), target) is not None:
        yield
        return
    with held_lock(lock_path(spec, f"memory-{variant}"), wait=True):
        yield


def pair_definition(spec: CompareSpec, variant: str, seed: int) -> dict[str, Any]:
    """What one pair's numbers mean: its resolved run config (dotted keys), the token
    budget its variant trains with under a memory target, and the evaluation settings
    (not the eval sets: the report checks each set's files itself)."""
    from appo.config import flatten, to_container
    from appo.trainer.memory import recorded_budget

    cfg = spec.config(variant, seed)
    config = flatten(to_container(cfg))
    out = {k: v for k, v in config.items() if k not in _NOT_DEFINITION}
    if cfg.actor.max_memory_gb is not None:
        out[BUDGET_KEY] = recorded_budget(budget_dir(spec, variant),
                                                            cfg.actor.max_memory_gb)
    e = spec.eval
    out.update({"eval.k": e.k, "eval.temperature": e.temperature, "eval.top_p": e.top_p,
                "eval.top_k": e.top_k, "eval.max_response_length": e.max_response_length})
    return json.loads(json.dumps(out))  # as stored


def record_definition(spec: CompareSpec, variant: str, seed: int) -> None:
    write_output(spec.run_dir(variant, seed) / PAIR_FILE,
                      json.dumps(pair_definition(spec, variant, seed), indent=1,
                                 sort_keys=True) + "\n")


def redefined_pairs(spec: CompareSpec) -> list[str]:
    """`variant/seedN (key: old -> new)` for every done or started pair whose stored
    definition differs from the spec's now (a finished pair in any key; a started one in
    any key but the step count, which a resume may extend)."""
    from appo.outdir import differences

    out = []
    for variant, seed in spec.pairs():
        file = spec.run_dir(variant, seed) / PAIR_FILE
        state = pair_state(spec, variant, seed)
        if state == "missing" or not file.is_file():
            continue
        try:
            old = json.loads(file.read_text())
        except (OSError, ValueError):
            old = {}
        new = pair_definition(spec, variant, seed)
        if BUDGET_KEY not in old:  # recorded before budgets were (it was derived per pair)
            new.pop(BUDGET_KEY, None)
        if state == "partial":
            for key in _EXTENDABLE:
                old.pop(key, None)
                new.pop(key, None)
        diff = differences(old, new)
        if diff:
            out.append(f"{variant}/seed{seed} ({'; '.join(diff[:2])}"
                       f"{f' and {len(diff) - 2} more' if len(diff) > 2 else ''})")
    return out


def check_definitions(spec: CompareSpec) -> None:
    """One line when pairs ran under another definition than the spec's: their numbers
    must not be reported (or resumed) as the new definition's."""
    from appo.errors import AppoError

    changed = redefined_pairs(spec)
    if changed:
        raise AppoError(
            f"{len(changed)} pair(s) ran under another definition than {spec.path} now gives: "
            f"{', '.join(changed)}; restore the spec, or remove those pairs' directories "
            f"under {spec.output_dir / 'runs'} to run them again")


def load_result(spec: CompareSpec, variant: str, seed: int) -> PairResult | None:
    path = spec.run_dir(variant, seed) / RESULT_FILE
    if not path.is_file():
        return None
    return PairResult.from_dict(json.loads(path.read_text()))


def run_pair(spec: CompareSpec, variant: str, seed: int, progress: bool = True) -> PairResult:
    """Train (or resume) one pair and evaluate it; writes `result.json` last. The `start`
    row (eval.start) is evaluated as loaded."""
    from appo.errors import AppoError
    from appo.trainer.guards import NonFiniteError
    from appo.trainer.loop import RLTrainer
    from appo.trainer.memory import record_budget, recorded_budget

    resume = pair_state(spec, variant, seed) == "partial"
    target = spec.config(variant, seed).actor.max_memory_gb
    with _derived_once(spec, variant, target):
        cfg = pair_config(spec, variant, seed, resume=resume)
        if not resume:
            cfg.trainer.overwrite = True  # only ever a directory with no checkpoint (above)
        trainer = RLTrainer(cfg, progress=progress)  # owns (locks) the pair's run directory
        if (target is not None and trainer.dp.is_main
                and recorded_budget(budget_dir(spec, variant), target) is None):
            record_budget(budget_dir(spec, variant), target,
                          int(trainer.cfg.actor.ppo_max_token_len_per_device))
    if trainer.dp.is_main:
        record_definition(spec, variant, seed)
    try:
        if spec.variant(variant).train:
            try:
                trainer.fit(close=False)
            except NonFiniteError as e:  # the step, and which pair
                raise AppoError(f"{variant} seed {seed}: "
                                f"{e.at_step(trainer.step + 1)}") from None
        result = evaluate_pair(spec, trainer, variant, seed)
        if trainer.dp.is_main:
            write_output(spec.run_dir(variant, seed) / RESULT_FILE, result.to_json())
            if spec.keep_checkpoints == "last":
                prune_checkpoints(spec.run_dir(variant, seed))
    finally:
        trainer.tools.close()
        trainer.run_dir.release()
    return result


def prune_checkpoints(run: Path) -> list[Path]:
    """Delete every checkpoint of a finished run but the newest valid one (`keep_checkpoints:
    last`); returns the deleted directories. The kept one still resumes, e.g. to extend a
    study to more steps."""
    import shutil

    from appo.trainer.checkpoint import find_checkpoint

    keep, _, _ = find_checkpoint(run)
    if keep is None:
        return []
    gone = [p for p in sorted(run.glob("global_step_*")) if p.is_dir() and p != keep]
    for p in gone:
        shutil.rmtree(p)
    return gone


def evaluate_pair(spec: CompareSpec, trainer: Any, variant: str, seed: int) -> PairResult:
    """Greedy pass@1 and sampled pass@k on every eval set with the trained policy."""
    from appo.rollout.sampling import SamplingParams
    from appo.trainer.evaluate import evaluate

    start = time.perf_counter()
    cfg, e = trainer.cfg, spec.eval
    base = trainer.settings
    if e.max_response_length is not None:
        base = dataclasses.replace(base, max_response_length=e.max_response_length)
    greedy = dataclasses.replace(base, n=1, initial_rollouts=1,
                                 sampling=SamplingParams(temperature=0.0))
    sampled = dataclasses.replace(base, n=e.k, initial_rollouts=e.k, sampling=SamplingParams(
        temperature=e.temperature, top_p=e.top_p, top_k=e.top_k))
    result = PairResult(variant=variant, seed=seed, steps=trainer.step, eval_seconds=0.0)
    for i, (name, files) in enumerate(spec.eval.sets.items()):
        examples = load_eval_set(cfg, files, trainer.tokenizer)
        eval_seed = EVAL_SEED + 1009 * seed + i
        g = evaluate(trainer, examples, f"g{i}", eval_seed, greedy)
        s = evaluate(trainer, examples, f"k{i}", eval_seed + 1, sampled)
        index = {id(ex): j for j, ex in enumerate(examples)}
        greedy_acc, calls = [0.0] * len(examples), [0] * len(examples)
        for traj, out, ex in zip(g.trajectories, g.rewards, g.examples, strict=True):
            greedy_acc[index[id(ex)]] = float(out.accuracy)
            calls[index[id(ex)]] = int(traj.num_tool_calls)
        correct = [0] * len(examples)
        for out, ex in zip(s.rewards, s.examples, strict=True):
            correct[index[id(ex)]] += int(out.accuracy > 0)
        result.sets[name] = SetResult(greedy=greedy_acc, sampled_correct=correct, k=e.k,
                                      tool_calls=calls, files=files)
    result.eval_seconds = time.perf_counter() - start
    return result


def load_eval_set(cfg: Any, files: str, tokenizer: Any = None) -> list:
    """The `RLExample`s of one eval set, loaded as the run's own data (template, tools)."""
    from appo.data.rl import load_rl_data
    from appo.data.templates import tools_from_config

    return load_rl_data([files], template=cfg.data.template, tools=tools_from_config(cfg),
                        prompt_key=cfg.data.prompt_key, tokenizer=tokenizer,
                        max_prompt_length=(cfg.data.max_prompt_length if tokenizer is not None
                                           else None),
                        overlong=cfg.data.overlong,
                        stage_prompt=cfg.data.appo_stage_prompt).examples


def check_eval_sets(spec: CompareSpec) -> dict[str, int]:
    """Load every eval set once before anything trains, so a mistyped file is one error
    now rather than after the first run; returns the number of questions per set."""
    from appo.errors import AppoError

    cfg = spec.config(spec.variants[0].name, spec.seeds[0])
    sizes = {}
    for name, files in spec.eval.sets.items():
        sizes[name] = len(load_eval_set(cfg, files))
        if not sizes[name]:
            raise AppoError(f"eval set {name!r} ({files}) has no questions")
    return sizes


@contextlib.contextmanager
def held_lock(path: Path, wait: bool = False) -> Iterator[bool]:
    """An exclusive `flock` on `path` for the block: yields True when this process holds it,
    False when another one does (`wait=False`); with `wait`, blocks until it is free."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True  # closing the descriptor (finally) releases the lock
    finally:
        os.close(fd)


def lock_path(spec: CompareSpec, name: str) -> Path:
    # Beside the run directories, not in one: a fresh run replaces its directory
    # (`trainer.overwrite`), which would unlink a lock file held inside it.
    return spec.output_dir / ".locks" / f"{name}.lock"


def run_comparison(spec: CompareSpec, run: Callable[..., Any] = run_pair,
                   after_each: Callable[[], Any] | None = None,
                   progress: bool = True) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Run every pair that is not done and that no other `appo compare` process holds, in
    `spec.pairs()` order. Returns (pairs run, pairs passed over because another process
    held them). `after_each` (e.g. rewriting the report) is called after every finished
    pair."""
    ran, held = [], []
    for variant, seed in spec.pairs():
        if pair_state(spec, variant, seed) == "done":
            continue
        with held_lock(lock_path(spec, f"{variant}-seed{seed}")) as mine:
            if not mine:
                print(f"appo compare: {variant} seed {seed} is being run by another appo "
                      "compare process; passed over", flush=True)
                held.append((variant, seed))
                continue
            # Read again under the lock: another process may have finished it meanwhile.
            state = pair_state(spec, variant, seed)
            if state == "done":
                continue
            print(f"appo compare: {variant} seed {seed} "
                  f"({'resuming' if state == 'partial' else 'new'})", flush=True)
            run(spec, variant, seed, progress=progress)
        ran.append((variant, seed))
        if after_each is not None:
            after_each()
    return ran, held
