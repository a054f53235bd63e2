"""One rank of `test_vllm_colocate.py`: appo's process group, then appo's vLLM engine in this
rank (external launcher), weights of this rank's own policy streamed in, log-probs checked.

Run under `accelerate launch` with 2 processes; writes `{layout}{R}.json` into argv[1]; argv[2] is
the model dir (the session's tiny model, `tiny_llama.py`).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    import torch

    from appo.config import load_config
    from appo.models import load_model
    from appo.rollout import vllm_server
    from appo.rollout.sampling import SamplingParams
    from appo.rollout.vllm_engine import VLLMEngine
    from appo.trainer.distributed import init_process_group

    out, model_dir = Path(sys.argv[1]), sys.argv[2]
    init_process_group()
    rank = torch.distributed.get_rank()
    # This rank's own temp dir, watched for files a sync writes: the machine's /tmp also gets
    # other processes' files (another launch's torchelastic_* dir failed the check once).
    private_tmp = out / f"tmp{rank}"
    private_tmp.mkdir()
    tempfile.tempdir = str(private_tmp)
    cfg = load_config(overrides=[f"model.path={model_dir}", "rollout.name=vllm",
                                 "rollout.kv_cache_gib=0.5", "data.max_prompt_length=448",
                                 "data.max_response_length=64", f"rollout.seed={rank}"])
    lm = load_model(model_dir, device="cpu")
    engine = VLLMEngine.from_config(cfg, lm.tokenizer)

    def no_file(*a, **k):
        raise AssertionError("a colocated engine's sync must not write a file")

    vllm_server.save_state = no_file  # the file route, refused
    ids = lm.tokenizer.encode("The capital of France is")

    def errors(model) -> list[float]:
        """|vLLM's behaviour log-prob - an HF forward's| over 12 sampled tokens."""
        engine.reseed(5)
        rid = engine.add_row(list(ids))
        seg = engine.decode([rid], 12, SamplingParams(temperature=1.0))[0]
        engine.release([rid])
        full = torch.tensor([ids + seg.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(full).logits[0].float(), -1)
        return [abs(float(logp[len(ids) + k - 1, t]) - lp)
                for k, (t, lp) in enumerate(zip(seg.token_ids, seg.logps, strict=True))]

    def check(layout: str, change, shard: bool) -> None:
        """Engine matches the policy; `change` it (the engine is then stale); sync (from a
        sharded copy when `shard`); the engine matches again. No file on the way."""
        import copy

        from appo.trainer.fsdp import shard_model

        base_err = max(errors(lm.model))
        with torch.no_grad():
            change()
        stale_err = max(errors(lm.model))
        source = lm.model
        if shard:
            source = copy.deepcopy(lm.model)
            shard_model(source, torch.distributed.get_world_size())
        syncs = engine.weight_syncs
        tmp = Path(tempfile.gettempdir())
        before = {p.name for p in tmp.iterdir()}
        engine.sync_weights(source)
        created = sorted({p.name for p in tmp.iterdir()} - before)
        synced_err = max(errors(lm.model))
        result = {"rank": rank, "in_process": engine.in_process, "base_err": base_err,
                  "stale_err": stale_err, "synced_err": synced_err, "created": created,
                  "pid": os.getpid(), "syncs": engine.weight_syncs - syncs}
        (out / f"{layout}{rank}.json").write_text(json.dumps(result))

    m = lm.model.model
    embed0 = m.embed_tokens.weight.detach().clone()

    def own_policy():  # each rank's own: the norm and the (tied) embedding, by rank
        m.norm.weight.mul_(1.0 + 0.5 * (rank + 1))
        m.embed_tokens.weight.mul_(1.0 + 0.05 * (rank + 1))

    def shared_policy():  # one policy on both ranks: shards hold one model
        m.norm.weight.fill_(1.25)
        m.embed_tokens.weight.copy_(embed0 * 1.07)

    check("whole", own_policy, shard=False)  # vLLM's LM head must follow the tied embedding
    check("fsdp", shared_policy, shard=True)
    torch.distributed.barrier()
