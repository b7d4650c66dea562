# ruff: noqa
"""FSDP001 across helper functions: main builds the optimizer (in a helper) before it shards (in another)."""

import torch
from torch.distributed.fsdp import fully_shard


def build_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    return model


def main() -> None:
    model = torch.nn.Transformer()
    optimizer = build_optimizer(model)  # expect: FSDP001
    model = shard_model(model)


def build_model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    # The optimizer comes back with the model that it was built from.
    net = torch.nn.Transformer()
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


def setup(net: torch.nn.Module) -> torch.nn.Module:
    # A helper that calls a helper: shard_model shards setup's argument.
    return shard_model(net)


def main_nested() -> None:
    model, optimizer = build_model_and_optimizer()  # expect: FSDP001
    setup(model)


def main_direct_optimizer() -> None:
    model = torch.nn.Transformer()
    optimizer = torch.optim.AdamW(model.parameters())  # expect: FSDP001
    setup(net=model)


class Trainer:
    def __init__(self) -> None:
        self.model = torch.nn.Transformer()
        self.optimizer = self.make_optimizer()  # expect: FSDP001
        self.shard()

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters())

    def shard(self) -> None:
        fully_shard(self.model)
