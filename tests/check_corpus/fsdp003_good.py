# ruff: noqa
"""FSDP003 done right: call the module; forward() on modules that are not sharded is fine."""

import torch
from torch.distributed.fsdp import fully_shard


class Wrapper(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def train(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    fully_shard(model)
    head = torch.nn.Linear(8, 8)
    return head.forward(model(batch))
