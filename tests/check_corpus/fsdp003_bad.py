# ruff: noqa
"""FSDP003: forward() called directly on sharded modules."""

import torch
from torch.distributed.fsdp import fully_shard as shard


def train(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    for block in model.layers:
        shard(block)
    shard(model)
    hidden = model.layers[0].forward(batch)  # expect: FSDP003
    net = model
    return net.forward(hidden)  # expect: FSDP003
