# ruff: noqa
"""FSDP002: the root is sharded before its blocks."""

import torch.distributed.fsdp as fsdp
from torch.distributed._composable.fsdp import fully_shard

from mymodels import Transformer

model = Transformer()
fsdp.fully_shard(model)  # expect: FSDP002
for block in model.layers:
    fsdp.fully_shard(block)


def shard(net):
    fully_shard(net, reshard_after_forward=True)  # expect: FSDP002
    fully_shard(net.layers[0])
