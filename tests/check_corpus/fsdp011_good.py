# ruff: noqa
"""FSDP011, the right order: float8 conversion first, then fully_shard (which all-gathers float8 weights)."""

import torch
from torch.distributed.fsdp import fully_shard
from torchao.float8 import Float8LinearConfig, convert_to_float8_training


def convert_blocks(blocks: torch.nn.ModuleList) -> None:
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    for block in blocks:
        convert_to_float8_training(block, config=config)


def build(net: torch.nn.Module, head: torch.nn.Module) -> torch.nn.Module:
    # Another model sharded earlier does not matter: only what the conversion touches.
    fully_shard(head)
    convert_blocks(net.layers)
    for block in net.layers:
        fully_shard(block)
    fully_shard(net)
    return net
