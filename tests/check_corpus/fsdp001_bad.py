# ruff: noqa
"""FSDP001: optimizers built from parameters that fully_shard replaces afterwards."""

import torch
from torch.distributed.fsdp import fully_shard as fs
from torch.optim import AdamW

model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
optimizer = AdamW(model.parameters(), lr=1e-3)  # expect: FSDP001
for layer in model:
    fs(layer)
fs(model)


def setup(net: torch.nn.Module) -> torch.optim.Optimizer:
    # Parameter groups through a variable, and an aliased model.
    decay = [p for p in net.parameters() if p.ndim >= 2]
    groups = [{"params": decay, "weight_decay": 0.1}]
    sgd = torch.optim.SGD(groups, lr=0.1)  # expect: FSDP001
    sharded = net
    for block in sharded.layers:
        fs(block)
    fs(sharded)
    return sgd
