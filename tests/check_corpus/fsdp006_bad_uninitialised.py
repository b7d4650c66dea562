# ruff: noqa
"""FSDP006: to_empty without any initialisation: the parameters hold garbage."""

import torch
from torch.distributed.fsdp import fully_shard

from mymodels import Transformer

with torch.device("meta"):
    model = Transformer()
fully_shard(model)
model.to_empty(device="cuda")  # expect: FSDP006
optimizer = torch.optim.AdamW(model.parameters())
model(torch.zeros(1)).sum().backward()
