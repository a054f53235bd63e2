"""The demo's SFT stage alone (runs/demo/sft/global_step_20), with the frozen code: the
study's starting checkpoint, rebuilt on a new machine (the base/SFT evaluations and the
demo's RL are skipped; the SFT's data order depends on trainer.seed only)."""
import sys

from appo.models import load_model
from appo.trainer.demo import _sft_stage, demo_config
from appo.trainer.loop import RLTrainer

if __name__ == "__main__":
    cfg = demo_config("configs/demo.yaml", sys.argv[1:])
    lm = load_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.model.device)
    trainer = RLTrainer(cfg, lm=lm)
    result, n = _sft_stage(trainer, cfg)
    print("sft", result.steps, "steps on", n, "demos; loss", result.train_loss[0], "->",
          result.train_loss[-1], flush=True)
