"""The trainer's calls to an engine that holds its own weights and sleeps (vLLM on GPUs), in
order, with a recording engine around the hf engine: the policy's weights before the first
token, sleep before every update, wake (with the updated weights) before every rollout."""

from __future__ import annotations

from test_trainer_rl import make_toy, toy_config

from appo.trainer import loop
from appo.trainer.loop import RLTrainer


class RecordingEngine:
    """Delegates rows and decoding to the real hf engine; records sync / sleep / wake."""

    def __init__(self, inner, events: list):
        self.inner, self.events = inner, events
        self.asleep = False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, *a, **k):
        assert not self.asleep, "decode on a sleeping engine"
        self.events.append("decode")
        return self.inner.decode(*a, **k)

    def sync_weights(self, model):
        self.events.append("weights")

    def sleep(self):
        self.events.append("sleep")
        self.asleep = True

    def wake(self, model=None):
        if model is not None:
            self.sync_weights(model)
        self.events.append("wake")
        self.asleep = False


def test_weights_before_tokens_sleep_before_update_wake_before_rollout(tmp_path, monkeypatch):
    events: list[str] = []
    real_update = loop.update_policy
    monkeypatch.setattr(loop, "update_policy",
                        lambda *a, **k: events.append("update") or real_update(*a, **k))
    cfg = toy_config(make_toy(tmp_path), "trainer.total_steps=2", "rollout.strategy=grpo")
    trainer = RLTrainer(cfg, progress=False)
    trainer.engine = RecordingEngine(trainer.engine, events)
    trainer._rollout_stale = True  # an engine with its own weights starts stale
    trainer.fit()
    collapsed = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]
    assert collapsed == ["weights", "wake", "decode", "sleep", "update",
                         "weights", "wake", "decode", "sleep", "update"]
