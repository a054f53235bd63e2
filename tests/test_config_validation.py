"""Every numeric config key is checked when the config loads (issue 41, class 1): NaN, an
infinity and a value outside the key's range are one `AppoError` line naming the key.

The keys come from the schema itself (`AppoConfig`, walked here), so a new key is covered
without touching this file; a numeric key without a declared range fails
`test_every_numeric_key_declares_its_range`.
"""

from __future__ import annotations

import math

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf

from appo.config import AppoConfig, load_config
from appo.config_ranges import RANGES, range_for
from appo.errors import AppoError


def _schema_numbers() -> list[tuple[str, type]]:
    """(dotted key, int or float) of every number the schema holds, optional ones included;
    list items as `key.INDEX`, mapping entries as `key.NAME`."""
    out: list[tuple[str, type]] = []

    def walk(node, prefix):
        if isinstance(node, DictConfig):
            items = [(k, node._get_node(k)) for k in node.keys()]
        else:
            items = [(i, node._get_node(i)) for i in range(len(node))]
        for key, child in items:
            full = f"{prefix}{key}"
            if isinstance(child, (DictConfig, ListConfig)):
                if not full.startswith("tools.tool_instances"):  # the tools' own parameters
                    walk(child, full + ".")
                continue
            kind = child._metadata.ref_type
            value = child._value()
            if kind in (int, float):
                out.append((full, kind))
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out.append((full, type(value)))  # an entry of a typed mapping or list

    walk(OmegaConf.structured(AppoConfig), "")
    return out


NUMBERS = _schema_numbers()


def _override(key: str, value: str) -> list[str]:
    """An override setting `key` (a list item as `key.INDEX`) to `value` (YAML text)."""
    head, _, last = key.rpartition(".")
    if last.isdigit():
        items = [str(v) for v in OmegaConf.select(OmegaConf.structured(AppoConfig), head)]
        items[int(last)] = value
        return [f"{head}=[{','.join(items)}]"]
    return [f"{key}={value}"]


def _bad_values(key: str, kind: type) -> list[str]:
    rng = range_for(key)
    bad = ["nan", "-inf"] + ([] if rng.inf_ok else ["inf"])
    if rng.lo is not None:
        bad.append(repr(rng.lo) if rng.lo_open else repr(rng.lo - 1))
    if rng.hi is not None:
        bad.append(repr(rng.hi) if rng.hi_open else repr(rng.hi + max(1, abs(rng.hi))))
    if kind is int:
        bad.append("1.5")
    return bad


def _good_values(key: str, kind: type) -> list[str]:
    """The closed ends of the range (and inf where allowed): accepted."""
    rng = range_for(key)
    good = [repr(rng.lo)] if rng.lo is not None and not rng.lo_open else []
    if rng.hi is not None and not rng.hi_open:
        good.append(repr(rng.hi))
    if rng.inf_ok:
        good.append("inf")
    return good


def test_the_schema_walk_finds_the_numbers():
    keys = {k for k, _ in NUMBERS}
    assert len(keys) > 80
    assert {"actor.grad_clip", "actor.optim.lr", "actor.optim.betas.0", "critic.optim.lr",
            "sft.warmup_ratio", "eval.tool_call_limits.python", "critic.ppo_epochs",
            "trainer.total_steps", "model.lora_alpha", "tools.timeout"} <= keys
    assert dict(NUMBERS)["critic.ppo_epochs"] is int  # optional ones keep their type


def test_every_numeric_key_declares_its_range():
    missing = [k for k, _ in NUMBERS if range_for(k) is None]
    assert not missing, f"add these keys to appo.config_ranges.RANGES: {missing}"
    stale = [k for k in RANGES if not any(range_for(n) is RANGES[k] and
                                          (n == k or k.endswith(".*")) for n, _ in NUMBERS)]
    assert not stale, f"RANGES names keys the schema does not have: {stale}"


CASES = [(k, kind, v) for k, kind in NUMBERS for v in _bad_values(k, kind)]


@pytest.mark.parametrize("key, kind, value", CASES, ids=[f"{k}={v}" for k, _, v in CASES])
def test_a_bad_number_is_one_line_naming_the_key(key, kind, value):
    with pytest.raises(AppoError) as e:
        load_config(None, _override(key, value))
    message = str(e.value)
    assert "\n" not in message, message
    assert repr(key) in message, message


GOOD = [(k, kind, v) for k, kind in NUMBERS for v in _good_values(k, kind)]


@pytest.mark.parametrize("key, kind, value", GOOD, ids=[f"{k}={v}" for k, _, v in GOOD])
def test_the_ends_of_a_range_are_accepted(key, kind, value):
    cfg = load_config(None, _override(key, value))
    head, _, last = key.rpartition(".")
    got = OmegaConf.select(cfg, head)[int(last)] if last.isdigit() else OmegaConf.select(cfg, key)
    assert got == float(value) or (math.isinf(got) and value == "inf")


def test_nan_in_a_yaml_file_names_the_file_and_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  grad_clip: .nan\n")
    with pytest.raises(AppoError, match=r"'actor\.grad_clip'.*nan"):
        load_config(path)


@pytest.mark.parametrize("overrides, names", [
    (["actor.grad_clip=${nope}"], ["'actor.grad_clip'", "'nope' not found"]),
    (["actor.grad_clip=${actor.grad_clip}"], ["'actor.grad_clip'", "Recursive"]),
    (["actor.kl_loss_coef=${actor.entropy_coeff}", "actor.entropy_coeff=${actor.kl_loss_coef}"],
     ["Recursive"]),
    (["model.path=${oc.env:APPO_NO_SUCH_VARIABLE}"], ["'model.path'", "APPO_NO_SUCH_VARIABLE"]),
    (["data.train_files=[a"], ["'data.train_files=[a'", "cannot parse"]),
    (["data.train_files={a: [1"], ["'data.train_files={a: [1'"]),
])
def test_interpolation_and_override_errors_are_one_line(overrides, names):
    with pytest.raises(AppoError) as e:
        load_config(None, overrides)
    message = str(e.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message


def test_interpolations_in_a_yaml_file_are_resolved_once(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  seed: 7\nrollout:\n  seed: ${data.seed}\n")
    cfg = load_config(path)
    assert cfg.rollout.seed == 7
    path.write_text("rollout:\n  seed: ${nope}\n")
    with pytest.raises(AppoError, match=r"'rollout\.seed'.*'nope' not found"):
        load_config(path)


def test_a_value_out_of_range_via_interpolation_is_refused():
    with pytest.raises(AppoError, match=r"'sft\.warmup_ratio': 5\.0"):
        load_config(None, ["sft.warmup_ratio=${actor.clip_ratio_c}", "actor.clip_ratio_c=5"])
