# ruff: noqa
"""FSDP005 done right: set_requires_gradient_sync; DDP's no_sync is fine."""

from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from mymodels import Transformer

model = Transformer()
fully_shard(model)
for step in range(4):
    model.set_requires_gradient_sync(step == 3)
    model(step).sum().backward()

replicated = DistributedDataParallel(Transformer())
with replicated.no_sync():
    replicated(1).sum().backward()
