# ruff: noqa
"""FSDP014: a stage's blocks renumbered from 0 in a new list: two stages save the same DCP keys."""

from torch import nn
from torch.distributed.pipelining import PipelineStage


def build(model, rank, device):
    first, last = rank * 4, rank * 4 + 4
    model.layers = nn.ModuleList(model.layers[first:last])  # expect: FSDP014
    return PipelineStage(model, rank, 2, device)


def build_sequential(model, rank, device):
    blocks = nn.Sequential(*[model.layers[i] for i in range(rank * 4, rank * 4 + 4)])  # expect: FSDP014
    return PipelineStage(blocks, rank, 2, device)
