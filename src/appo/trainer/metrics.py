"""Step metrics: console line, JSONL file, optional tensorboard / wandb, PNG plots at the end.

`trainer.logger` lists the sinks. JSONL is the source of truth (one object per step, plain
floats); plots are drawn from it, so a crashed run can still be plotted afterwards with
`plot_metrics(path)`.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appo.errors import AppoError


class MetricsLogger:
    def __init__(
        self,
        out_dir: str | Path,
        sinks: list[str],
        run_name: str = "appo",
        config: dict[str, Any] | None = None,
        resume_step: int | None = None,
        enabled: bool = True,
    ):
        """`resume_step`: continue the JSONL of a run resumed from that step, keeping its rows
        up to the step and dropping later ones (they are about to be redone); None starts a
        new file."""
        self.out_dir = Path(out_dir)
        self.sinks = list(sinks)
        self.enabled = enabled
        self.path = self.out_dir / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if "jsonl" in self.sinks and self.path.exists():
            if resume_step is None:
                self.path.unlink()
            else:
                truncate_metrics(self.path, resume_step)
        if "tensorboard" in self.sinks:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise AppoError(
                    "trainer.logger includes tensorboard but it is not installed: "
                    "pip install 'appo[tensorboard]'"
                ) from None
            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
        if "wandb" in self.sinks:
            try:
                import wandb
            except ImportError:
                raise AppoError(
                    "trainer.logger includes wandb but it is not installed: pip install 'appo[wandb]'"
                ) from None
            # The API key comes from the environment (WANDB_API_KEY), never from config.
            self._wandb = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "appo"), name=run_name, config=config
            )

    def log(self, step: int, metrics: dict[str, float], console_keys: list[str] | None = None):
        if not self.enabled:
            return
        # A NaN or infinite value is kept (null in the JSONL, nan on the console): a metric
        # that vanishes when it goes bad would hide the failure it reports.
        clean = {k: float(v) for k, v in metrics.items() if _is_number(v)}
        if "jsonl" in self.sinks:
            row = {k: v if math.isfinite(v) else None for k, v in clean.items()}
            with self.path.open("a") as f:
                f.write(json.dumps({"step": step, **row}, allow_nan=False) + "\n")
        if "console" in self.sinks:
            keys = console_keys or sorted(clean)
            parts = [f"{k}={clean[k]:.4g}" for k in keys if k in clean]
            print(f"step {step}: " + "  ".join(parts), file=sys.stderr, flush=True)
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self):
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _is_number(v: Any) -> bool:
    try:
        float(v)
    except (TypeError, ValueError):
        return False
    return True


def truncate_metrics(path: Path, step: int) -> int:
    """Keep the rows of steps <= `step` (and drop a line cut short by a kill); returns how
    many rows were dropped. Rewritten atomically: a kill now loses nothing."""
    from appo.fsutil import atomic_write_text

    kept, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            keep = int(row["step"]) <= step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        elif line.strip():
            dropped += 1
    if dropped:
        atomic_write_text(path, "".join(x + "\n" for x in kept))
    return dropped


def read_metrics(path: str | Path) -> list[dict[str, float]]:
    """The JSONL's rows; a non-finite value (written as null) reads back as NaN."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.append({k: math.nan if v is None else v for k, v in row.items()})
    return rows


def plot_metrics(path: str | Path, keys: list[str], out_dir: str | Path) -> list[Path]:
    """One PNG per key present in the metrics JSONL (x = step). Returns written files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for key in keys:
        points = [(r["step"], r[key]) for r in rows if key in r]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        target = out_dir / f"{key.replace('/', '_')}.png"
        fig.savefig(target, dpi=100)
        plt.close(fig)
        written.append(target)
    return written


@dataclass
class StepTimer:
    """Wall seconds per phase of a step (`with timer.measure("rollout"): ...`) and, on CUDA,
    each phase's peak of allocated GPU memory (`cuda_peak_gb`, from the allocator's peak
    counter, reset as the phase starts)."""

    phases: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    cuda_peak_gb: dict[str, float] = field(default_factory=dict)

    def measure(self, name: str):
        import torch  # a step runs with torch loaded; this module is also read without it

        timer = self
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()

        class _Ctx:
            def __enter__(self):
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.phases[name] += time.perf_counter() - self.t0
                if cuda:
                    peak = torch.cuda.max_memory_allocated() / 2**30
                    timer.cuda_peak_gb[name] = max(timer.cuda_peak_gb.get(name, 0.0), peak)

        return _Ctx()


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rollout_metrics(trajs, outputs, stats) -> dict[str, float]:
    """Reward, tool-use and size statistics of a step's trajectories (`outputs`: their
    `RewardOutput`s, aligned) and the rollout's counters."""
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
        # Context tokens served from a cache (hf: forked KV rows; vllm: its prefix cache).
        context = stats.tokens_prefilled + stats.tokens_reused
        m["rollout/prefix_hit_rate"] = stats.tokens_reused / context if context else 0.0
    return m
