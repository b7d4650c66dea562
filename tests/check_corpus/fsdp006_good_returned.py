# ruff: noqa
"""FSDP006 stays silent when to_empty's caller (not in this file) initialises the model."""

import torch


def materialise(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    model.to_empty(device=device)
    return model
