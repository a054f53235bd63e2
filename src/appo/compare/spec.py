"""The comparison spec: a base config, named variants, seeds and held-out evaluation sets.

```yaml
output_dir: runs/compare/arith      # paths: relative to the working directory, as for appo train
base:
  config: configs/demo.yaml         # optional; then `overrides` on top
  overrides: [model.path=runs/demo/sft/final, trainer.total_steps=20]
variants:
  grpo: [rollout.strategy=grpo]
  arpo: [rollout.strategy=arpo]
  big_n:                             # a variant that changes the budget must say so
    overrides: [rollout.strategy=grpo, rollout.n=16]
    allow_budget_difference: true
seeds: [1, 2, 3]
eval:
  sets: {level3: "synth:arith?split=eval&levels=3&n=100"}   # or a list of files
  k: 4                               # sampled pass@k: k samples per question
  temperature: 0.6
  start: true                        # also evaluate the starting checkpoint (row `start`)
keep_checkpoints: all                # or `last`: once a pair is evaluated, delete all its
                                     # checkpoints but the newest (disk: ~1.3 GB each at 135M)
```

Equal budget: the keys in `BUDGET_KEYS` (prompts per step, trajectories per prompt, steps,
response-length cap) must resolve to the same values in every variant; a variant that differs
is refused unless it carries `allow_budget_difference: true`. The sampled-token count is not
fixed (branching changes it); the report shows it.

Each (variant, seed) is one run: the compare command sets `trainer.seed` and `data.seed` to
the seed and the run directory to `output_dir/runs/<variant>/seed<seed>`, so a spec must not
set those keys itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appo.config_ranges import check_value  # the config's own ranges (eval.*)
from appo.errors import AppoError

BUDGET_KEYS = ("data.train_batch_size", "rollout.n", "trainer.total_steps",
               "data.max_response_length")
# Set per run by the compare command (see the module docstring).
MANAGED_KEYS = ("trainer.seed", "data.seed", "trainer.default_local_dir", "trainer.resume",
                "trainer.overwrite")
KEEP_CHECKPOINTS = ("all", "last")
# eval.start: the base config's model, evaluated per seed without training or variant
# overrides, so the report shows what training added to it.
START = "start"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class Variant:
    name: str
    overrides: list[str]
    allow_budget_difference: bool = False
    train: bool = True  # False: `START`, evaluated without training


@dataclass
class EvalSpec:
    """Held-out sets (name -> data file spec); greedy pass@1 and sampled pass@k on each."""

    sets: dict[str, str]
    k: int = 4
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = -1
    max_response_length: int | None = None  # None: the run's data.max_response_length
    start: bool = False  # also evaluate the starting checkpoint as the row `START`


@dataclass
class CompareSpec:
    path: Path
    output_dir: Path
    base_config: str | None
    base_overrides: list[str]
    variants: list[Variant]
    seeds: list[int]
    eval: EvalSpec
    budgets: dict[str, dict[str, Any]] = field(default_factory=dict)  # variant -> key -> value
    keep_checkpoints: str = "all"  # `last`: a finished pair keeps only its newest checkpoint

    def run_dir(self, variant: str, seed: int) -> Path:
        return self.output_dir / "runs" / variant / f"seed{seed}"

    def pairs(self) -> list[tuple[str, int]]:
        """Every (variant, seed), seed-major so a partial study has all variants per seed."""
        return [(v.name, s) for s in self.seeds for v in self.variants]

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)

    def config(self, variant: str, seed: int, resume: bool = False):
        """The full run config of one pair (`AppoConfig`)."""
        from appo.config import load_config

        run = [f"trainer.seed={seed}", f"data.seed={seed}",
               f"trainer.default_local_dir={self.run_dir(variant, seed)}",
               f"trainer.resume={str(resume).lower()}"]
        return load_config(self.base_config,
                           self.base_overrides + self.variant(variant).overrides + run)


def _strings(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(x, str) and "=" in x for x in value):
        raise AppoError(f"{where} must be a list of key=value overrides")
    return list(value)


def _check_managed(overrides: list[str], where: str) -> None:
    for item in overrides:
        key = item.split("=", 1)[0].strip().lstrip("+")
        if key in MANAGED_KEYS:
            raise AppoError(f"{where} sets {key}, which appo compare sets for each run "
                            "(seeds go in `seeds`, the directory in `output_dir`)")


def _variant(name: Any, value: Any) -> Variant:
    if not isinstance(name, str) or not _NAME.match(name):
        raise AppoError(f"variant name {name!r} must be letters, digits, '_', '-' or '.'")
    where = f"variants.{name}"
    if isinstance(value, dict):
        unknown = set(value) - {"overrides", "allow_budget_difference"}
        if unknown:
            raise AppoError(f"{where}: unknown key {sorted(unknown)[0]!r} "
                            "(expected overrides, allow_budget_difference)")
        allow = value.get("allow_budget_difference", False)
        if not isinstance(allow, bool):
            raise AppoError(f"{where}.allow_budget_difference must be true or false")
        return Variant(name, _strings(value.get("overrides"), f"{where}.overrides"), allow)
    return Variant(name, _strings(value, where))


def _eval(value: Any) -> EvalSpec:
    if not isinstance(value, dict) or "sets" not in value:
        raise AppoError("eval must be a mapping with `sets` (held-out data files)")
    sets = value["sets"]
    if isinstance(sets, list):
        sets = {f"set{i + 1}": s for i, s in enumerate(sets)}
    if not isinstance(sets, dict) or not sets or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in sets.items()):
        raise AppoError("eval.sets must be a non-empty list of data files or a mapping "
                        "name -> data file")
    unknown = set(value) - {"sets", "k", "temperature", "top_p", "top_k", "max_response_length",
                            "start"}
    if unknown:
        raise AppoError(f"eval: unknown key {sorted(unknown)[0]!r}")
    try:
        spec = EvalSpec(sets=dict(sets), k=int(value.get("k", 4)),
                        temperature=float(value.get("temperature", 0.6)),
                        top_p=float(value.get("top_p", 0.95)),
                        top_k=int(value.get("top_k", -1)),
                        max_response_length=(None if value.get("max_response_length") is None
                                             else int(value["max_response_length"])))
    except (TypeError, ValueError) as e:
        raise AppoError(f"eval: {e}") from None
    start = value.get("start", False)
    if not isinstance(start, bool):
        raise AppoError("eval.start must be true or false")
    spec.start = start
    if spec.k < 1 or spec.temperature <= 0:
        raise AppoError(f"eval.k must be >= 1 and eval.temperature > 0 (sampled pass@k), got "
                        f"k={spec.k}, temperature={spec.temperature}")
    for key in ("temperature", "top_p", "top_k", "max_response_length"):
        check_value(f"eval.{key}", getattr(spec, key), where=" (in the compare spec)")
    return spec


def parse_spec(data: Any, path: Path) -> CompareSpec:
    """Check the spec's shape (one `AppoError` line per problem) and the budget rule."""
    if not isinstance(data, dict):
        raise AppoError(f"{path}: a compare spec is a YAML mapping (base, variants, seeds, eval)")
    unknown = set(data) - {"output_dir", "base", "variants", "seeds", "eval", "keep_checkpoints"}
    if unknown:
        raise AppoError(f"{path}: unknown key {sorted(unknown)[0]!r} "
                        "(expected output_dir, base, variants, seeds, eval, keep_checkpoints)")
    keep = data.get("keep_checkpoints", "all")
    if keep not in KEEP_CHECKPOINTS:
        raise AppoError(f"{path}: keep_checkpoints must be one of {', '.join(KEEP_CHECKPOINTS)}, "
                        f"got {keep!r}")
    base = data.get("base") or {}
    if not isinstance(base, dict) or set(base) - {"config", "overrides"}:
        raise AppoError(f"{path}: base must be a mapping with `config` and/or `overrides`")
    base_config = base.get("config")
    if base_config is not None and not isinstance(base_config, str):
        raise AppoError(f"{path}: base.config must be a config file path")
    base_overrides = _strings(base.get("overrides"), "base.overrides")
    _check_managed(base_overrides, "base.overrides")
    variants_raw = data.get("variants")
    if not isinstance(variants_raw, dict) or not variants_raw:
        raise AppoError(f"{path}: variants must be a non-empty mapping name -> overrides")
    variants = [_variant(k, v) for k, v in variants_raw.items()]
    for v in variants:
        _check_managed(v.overrides, f"variants.{v.name}")
    eval_spec = _eval(data.get("eval"))
    if eval_spec.start:
        if any(v.name == START for v in variants):
            raise AppoError(f"{path}: a variant is named {START!r}, which eval.start uses for "
                            "the starting checkpoint; rename the variant")
        variants.insert(0, Variant(START, [], allow_budget_difference=True, train=False))
    seeds = data.get("seeds", [1])
    if (not isinstance(seeds, list) or not seeds
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
            or len(set(seeds)) != len(seeds)):
        raise AppoError(f"{path}: seeds must be a non-empty list of distinct integers")
    output_dir = data.get("output_dir") or f"runs/compare/{path.stem}"
    spec = CompareSpec(path=path, output_dir=Path(str(output_dir)), base_config=base_config,
                       base_overrides=base_overrides, variants=variants, seeds=list(seeds),
                       eval=eval_spec, keep_checkpoints=keep)
    spec.budgets = check_budget(spec)
    return spec


def check_budget(spec: CompareSpec) -> dict[str, dict[str, Any]]:
    """Each variant's budget (`BUDGET_KEYS`); refuse a variant whose budget differs from the
    first unmarked variant's unless it has `allow_budget_difference: true`."""
    from omegaconf import OmegaConf

    budgets: dict[str, dict[str, Any]] = {}
    for v in spec.variants:
        cfg = spec.config(v.name, spec.seeds[0])
        budgets[v.name] = {k: OmegaConf.select(cfg, k) for k in BUDGET_KEYS}
    reference = next((v for v in spec.variants if not v.allow_budget_difference), None)
    if reference is None:
        return budgets
    ref = budgets[reference.name]
    for v in spec.variants:
        if v.allow_budget_difference:
            continue
        diff = [k for k in BUDGET_KEYS if budgets[v.name][k] != ref[k]]
        if diff:
            k = diff[0]
            raise AppoError(
                f"variant {v.name!r} has a different budget from {reference.name!r}: {k}="
                f"{budgets[v.name][k]} vs {ref[k]}; give every variant the same budget "
                f"({', '.join(BUDGET_KEYS)}) or mark it `allow_budget_difference: true`")
    return budgets


def load_spec(path: str | Path) -> CompareSpec:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise AppoError(f"compare spec {p} not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise AppoError(f"{p}: not valid YAML: {' '.join(str(e).split())}") from None
    return parse_spec(data, p)
