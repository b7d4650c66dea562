# ruff: noqa
"""FSDP012: the optimizer built over the whole model instead of this rank's pipeline stage."""

import copy

import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage


def build_before_the_cut(model, rank, device):
    # Built first: it holds every block's parameters, the deleted ones too.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # expect: FSDP012
    for name in list(model.layers.keys()):
        if int(name) // 4 != rank:
            del model.layers[name]
    stage = PipelineStage(model, rank, 2, device)
    return stage, optimizer


def build_over_the_whole_model(model, rank, device):
    # The stage is a copy cut from the model; the optimizer still steps the whole model.
    stage_module = copy.deepcopy(model)
    for name in list(stage_module.layers.keys()):
        if int(name) // 4 != rank:
            del stage_module.layers[name]
    fully_shard(stage_module)
    stage = PipelineStage(stage_module, rank, 2, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # expect: FSDP012
    return stage, optimizer


def build_over_the_parent(model, rank, device):
    stage = PipelineStage(model.stages[rank], rank, 2, device)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)  # expect: FSDP012
    return stage, optimizer
