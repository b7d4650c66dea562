# ruff: noqa
"""FSDP002 done right: blocks first, then the root."""

import torch.distributed.fsdp as fsdp

from mymodels import Transformer

model = Transformer()
for index, block in enumerate(model.layers):
    fsdp.fully_shard(block, reshard_after_forward=index < len(model.layers) - 1)
model = fsdp.fully_shard(model)

other = Transformer()
fsdp.fully_shard(other.layers[0])
fsdp.fully_shard(other)
