# ruff: noqa
"""FSDP006 done right: to_empty, then initialise (or load with assign=True)."""

import torch
from torch.distributed.fsdp import fully_shard

from mymodels import Transformer


def build(device: torch.device) -> Transformer:
    with torch.device("meta"):
        model = Transformer()
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    return model


def build_and_reset(device: torch.device) -> torch.nn.Module:
    with torch.device("meta"):
        model = Transformer()
    fully_shard(model)
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return model


def describe() -> Transformer:
    # Returned to a caller outside this file, which materialises it.
    with torch.device("meta"):
        shapes_only = Transformer()
    return shapes_only


def load(state_dict: dict) -> torch.nn.Module:
    with torch.device("meta"):
        model = Transformer()
    model.load_state_dict(state_dict, assign=True)
    return model


model = build(torch.device("cuda"))
