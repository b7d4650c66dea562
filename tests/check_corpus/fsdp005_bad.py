# ruff: noqa
"""FSDP005: no_sync() on FSDP2 modules."""

from torch.distributed.fsdp import fully_shard

from mymodels import Transformer

model = Transformer()
fully_shard(model)
with model.no_sync():  # expect: FSDP005
    model(1).sum().backward()

alias = model
context = alias.no_sync()  # expect: FSDP005
