# ruff: noqa
"""FSDP011: float8 conversion of modules that fully_shard has already sharded."""

import torch
from torch.distributed.fsdp import fully_shard
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8 import convert_to_float8_training as to_float8

model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
for layer in model:
    fully_shard(layer)
fully_shard(model)
convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))  # expect: FSDP011


def convert_blocks(blocks: torch.nn.ModuleList) -> None:
    for block in blocks:
        to_float8(block)


def build(net: torch.nn.Module) -> torch.nn.Module:
    # Through a helper of this file, on the blocks of a model whose blocks were sharded first.
    for block in net.layers:
        fully_shard(block)
    convert_blocks(net.layers)  # expect: FSDP011
    fully_shard(net)
    return net
