"""Run under `accelerate launch` (2 processes): `load_once` of a Hugging Face directory, then
of a copy whose weights file is corrupt; rank 0 saves what every rank got.

Each rank records its `AutoModelForCausalLM.from_pretrained` calls (the weights reads), its
parameters and buffers, whether the head is still tied to the embeddings, its generation
config's eos id, and the error line of the corrupt copy (which only rank 0 can notice: the
others never read the weights, and must not be left waiting in a broadcast).

argv: output file, the model directory, the corrupt copy.
"""

import sys

import torch
import transformers

from appo.errors import AppoError
from appo.trainer.distributed import DataParallel
from appo.trainer.load_once import load_once

dp = DataParallel.from_env()
assert dp.world == 2, dp.world
reads: list[str] = []
read_weights = transformers.AutoModelForCausalLM.from_pretrained


def recording_read(path, *args, **kwargs):
    reads.append(str(path))
    return read_weights(path, *args, **kwargs)


transformers.AutoModelForCausalLM.from_pretrained = recording_read
lm = load_once(sys.argv[2], dp, device="cpu")
model = lm.model
mine = {
    "rank": dp.rank,
    "reads": list(reads),
    "state": {n: t.detach().clone() for n, t in
              list(model.named_parameters()) + list(model.named_buffers())},
    "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight,
    "eos": model.generation_config.eos_token_id,
    "attn": model.config._attn_implementation,
    "pad": lm.tokenizer.pad_token_id,
}
try:
    load_once(sys.argv[3], dp, device="cpu")
    mine["error"] = None
except AppoError as e:
    mine["error"] = str(e)
everyone = dp.gather_objects([mine])
if dp.is_main:
    torch.save(everyone, sys.argv[1])
