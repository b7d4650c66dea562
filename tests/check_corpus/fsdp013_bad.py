# ruff: noqa
"""FSDP013: the pipeline stage (or its sharding) set up before the other stages' blocks are deleted."""

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage as Stage


def build(model, rank, device):
    stage = Stage(model, rank, 2, device)  # expect: FSDP013
    for name in list(model.layers.keys()):
        if int(name) // 4 != rank:
            del model.layers[name]
    return stage


def shard_then_cut(model, rank, device):
    fully_shard(model)  # expect: FSDP013
    if rank < 1:
        model.output = None
    return Stage(model, rank, 2, device)
