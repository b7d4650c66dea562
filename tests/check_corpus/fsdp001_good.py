# ruff: noqa
"""FSDP001 done right: the optimizer comes after fully_shard (or belongs to another model)."""

import torch
from torch.distributed.fsdp import fully_shard as fs
from torch.optim import AdamW

teacher = torch.nn.Linear(8, 8)
teacher_optimizer = AdamW(teacher.parameters())

model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
for layer in model:
    fs(layer)
fs(model)
optimizer = AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def build_optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    # Sharded elsewhere: nothing in this function shards `net` afterwards.
    return torch.optim.AdamW([p for p in net.parameters() if p.requires_grad])
