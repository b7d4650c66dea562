# ruff: noqa
"""FSDP001 across helper functions done right: the sharding helper runs before the optimizer helper."""

import torch
from torch.distributed.fsdp import fully_shard


def build_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def build_sharded_model() -> torch.nn.Module:
    model = torch.nn.Transformer()
    return shard_model(model)


def main() -> None:
    model = torch.nn.Transformer()
    model = shard_model(model)
    optimizer = build_optimizer(model)


def main_returned() -> None:
    model = build_sharded_model()
    optimizer = build_optimizer(model)


def main_other_model() -> None:
    # The teacher is never sharded: its optimizer may come first.
    teacher, student = torch.nn.Linear(8, 8), torch.nn.Transformer()
    teacher_optimizer = build_optimizer(teacher)
    shard_model(student)
    optimizer = build_optimizer(student)


def fresh_model(model: torch.nn.Module) -> torch.nn.Module:
    # Rebinds its parameter: what it shards is not the caller's model.
    model = torch.nn.Transformer()
    fully_shard(model)
    return model


def main_rebound() -> None:
    model = torch.nn.Transformer()
    optimizer = build_optimizer(model)
    sharded = fresh_model(model)


class Trainer:
    def __init__(self) -> None:
        self.model = torch.nn.Transformer()
        self.shard()
        self.optimizer = self.make_optimizer()

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters())

    def shard(self) -> None:
        fully_shard(self.model)
