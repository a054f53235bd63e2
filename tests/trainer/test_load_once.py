"""Weights read once under several processes (`appo.trainer.load_once`): rank 0 reads a Hugging
Face directory, the other ranks build the architecture and receive exact copies; a directory
only rank 0 finds broken fails on every rank with one line instead of a hang."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from appo.models import load_model
from appo.trainer.distributed import DataParallel
from appo.trainer.load_once import load_once, reads_once

sys.path.insert(0, str(Path(__file__).parent))
from two_procs import accelerate_launch  # noqa: E402


def _hf_dir(where: Path) -> Path:
    lm = load_model("tiny-test")
    out = where / "tiny-hf"
    lm.model.generation_config.eos_token_id = 7  # something from_config would not know
    lm.model.save_pretrained(out)
    lm.tokenizer.save_pretrained(out)
    return out


def _full_state(model) -> dict[str, torch.Tensor]:
    return {n: t for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def test_one_process_loads_as_load_model(tmp_path):
    model_dir = _hf_dir(tmp_path)
    assert not reads_once(str(model_dir), DataParallel())
    got, want = load_once(str(model_dir), DataParallel(), device="cpu"), load_model(
        str(model_dir), device="cpu")
    for name, t in _full_state(want.model).items():
        assert torch.equal(_full_state(got.model)[name], t), name


def test_the_other_ranks_model_has_the_loaded_ones_tensors(tmp_path):
    """What the other ranks build without reading the weights: the same parameters (the
    head tied again after `to_empty`), buffers, shapes and dtypes, in the same order (the
    broadcasts pair them by position)."""
    from appo.trainer.load_once import _layout, _skeleton

    model_dir = _hf_dir(tmp_path)
    built = _skeleton(str(model_dir), "float32", "cpu", False).model
    loaded = load_model(str(model_dir), device="cpu").model
    assert _layout(built) == _layout(loaded)
    assert built.get_output_embeddings().weight is built.get_input_embeddings().weight
    assert built.generation_config.eos_token_id == 7


def test_two_processes_read_the_weights_once_and_agree_on_errors(tmp_path):
    model_dir = _hf_dir(tmp_path)
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    out = tmp_path / "ranks.pt"
    r = accelerate_launch(str(Path(__file__).parent / "ddp_load_worker.py"), str(out),
                          str(model_dir), str(broken))
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = sorted(torch.load(out), key=lambda x: x["rank"])
    want = load_model(str(model_dir), device="cpu")
    want_state = _full_state(want.model)
    assert [len(x["reads"]) for x in ranks] == [1, 0]  # rank 0 alone read the weights
    for x in ranks:
        assert set(x["state"]) == set(want_state)
        for name, t in want_state.items():
            assert torch.equal(x["state"][name], t), (x["rank"], name)  # buffers included
        assert x["tied"]
        assert x["eos"] == want.model.generation_config.eos_token_id == 7
        assert x["attn"] == want.model.config._attn_implementation
        assert x["pad"] == want.tokenizer.pad_token_id
        # The broken weights file: rank 0's read failed, and every rank raised its line.
        assert x["error"] is not None and x["error"].startswith(
            f"cannot load model from {broken}"), x["error"]


def test_a_two_process_ddp_run_from_a_model_directory(tmp_path):
    """The trainer's call sites (the policy, and a critic from `critic.model.path`) under
    DDP: a `gae` run from a model directory, both models shared from rank 0."""
    import json

    from test_trainer_rl import make_toy

    toy = make_toy(tmp_path)
    model_dir = _hf_dir(tmp_path)
    run = tmp_path / "run"
    r = accelerate_launch(
        "-m", "appo.cli", "train", f"model.path={model_dir}", f"critic.model.path={model_dir}",
        f"data.train_files=[{toy['data']}]", "data.val_files=[]", "data.train_batch_size=2",
        "data.max_response_length=16", f"custom_reward_function.path={toy['reward']}",
        "rollout.n=2", "actor.ppo_mini_batch_size=2", "algorithm.adv_estimator=gae",
        f"trainer.default_local_dir={run}", "trainer.logger=[jsonl]", "trainer.parallel=ddp",
        "trainer.total_steps=1")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1]
    assert rows[0]["critic/vf_loss"] > 0 and rows[0]["rollout/trajectories"] == 4
