# ruff: noqa
"""FSDP002: the root is sharded before blocks that arrive as a list (a parameter), as train.py's shard_model."""

from torch.distributed.fsdp import fully_shard


def shard_model(model, blocks, mesh):
    fully_shard(model, mesh=mesh)  # expect: FSDP002
    for block in blocks:
        fully_shard(block, mesh=mesh)
