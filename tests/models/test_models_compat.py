"""The transformers-version shims: the cache argument's name and the caches' `update` calls."""

import pytest
import torch

from appo.models.compat import cache_argument
from appo.rollout.hf_batch import BatchCache
from appo.trainer.forward import _PrefixCache


class _NewStyle(torch.nn.Module):  # transformers >= 5.24
    def forward(self, input_ids=None, cache=None, **kwargs):
        return cache


class _OldStyle(torch.nn.Module):  # transformers < 5.24
    def forward(self, input_ids=None, past_key_values=None, **kwargs):
        return past_key_values


class _Wrapper(torch.nn.Module):  # what DDP/FSDP look like from outside
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


@pytest.mark.parametrize("cls, name", [(_NewStyle, "cache"), (_OldStyle, "past_key_values")])
def test_cache_argument_follows_the_forward_signature(cls, name):
    marker = object()
    for model in (cls(), _Wrapper(cls())):
        kwargs = cache_argument(model, marker)
        assert kwargs == {name: marker}
        assert model(**kwargs) is marker


def _kv(rows: int, steps: int) -> torch.Tensor:
    return torch.randn(rows, 2, steps, 4)


def test_caches_accept_old_and_new_update_calls():
    # the same update through `cache_kwargs` positionally (old) and `kwargs=` (new)
    # must store and return the same tensors
    key, value = _kv(1, 3), _kv(1, 3)
    for call in (lambda c: c.update(key, value, 0, {"cache_position": None}),
                 lambda c: c.update(key, value, 0, kwargs={"position_ids": None})):
        prefix = _PrefixCache()
        k, v = call(prefix)
        assert k is key and v is value
        buf = torch.zeros(1, 2, 1, 2, 5, 4)  # [layers, k/v, rows, heads, T, head_dim]
        batch = BatchCache(buf, length=1)
        k, v = call(batch)
        assert torch.equal(k[:, :, 1:4], key) and torch.equal(v[:, :, 1:4], value)
        assert k.shape[2] == 4
