# ruff: noqa
"""FSDP013, the correct way: cut, shard, then the pipeline stage."""

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage as Stage


def build(model, rank, device):
    for name in list(model.layers.keys()):
        if int(name) // 4 != rank:
            del model.layers[name]
    if rank < 1:
        model.norm, model.output = None, None
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    return Stage(model, rank, 2, device)


def zero_grads(model, rank, device):
    # Gradients set to None after the stage is built are not a cut.
    stage = Stage(model, rank, 2, device)
    for param in model.parameters():
        param.grad = None
    model.output.weight.grad = None
    return stage
