# ruff: noqa
"""FSDP012, the correct way: cut the stage, then build the optimizer from the stage's parameters."""

import copy

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage


def build(model, rank, device):
    for name in list(model.layers.keys()):
        if int(name) // 4 != rank:
            del model.layers[name]
    if rank > 0:
        model.tok_embeddings = None
    fully_shard(model)
    stage = PipelineStage(model, rank, 2, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return stage, optimizer


def build_from_a_copy(model, rank, device):
    stage_module = copy.deepcopy(model)
    for name in list(stage_module.layers.keys()):
        if int(name) // 4 != rank:
            del stage_module.layers[name]
    del model  # a variable, not a cut
    stage = PipelineStage(stage_module, rank, 2, device)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=1e-3)
    return stage, optimizer


def build_from_several_stages(stages, whole, device):
    # An optimizer over modules unrelated to the stage's (the stages put together under one module).
    pipeline_stages = [PipelineStage(stage, index, 4, device) for index, stage in enumerate(stages)]
    optimizer = torch.optim.AdamW(whole.parameters(), lr=1e-3)
    return pipeline_stages, optimizer
