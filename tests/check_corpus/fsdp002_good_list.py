# ruff: noqa
"""FSDP002, the right order with blocks that arrive as a list: the blocks first, then the root."""

from torch.distributed.fsdp import fully_shard


def shard_model(model, blocks, mesh):
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
