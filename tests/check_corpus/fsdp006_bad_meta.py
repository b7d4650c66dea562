# ruff: noqa
"""FSDP006: models built on the meta device that nothing materialises."""

import torch
from torch.distributed.fsdp import fully_shard

from mymodels import Transformer

with torch.device("meta"):
    model = Transformer()  # expect: FSDP006
fully_shard(model)
head = torch.nn.Linear(8, 8, device="meta")  # expect: FSDP006
print(model(torch.zeros(1)), head(torch.zeros(8)))
